"""What the EAGLE family shares: `EagleBase`, a draft model of the target family's layers over the target's
embedding and lm_head, and `EagleProposer`, its decoding side (its own KV cache, chains and EAGLE-2's dynamic
tree). EAGLE-1 (heads/eagle.py), EAGLE-3, DFlash and MTP build on it, without importing EAGLE-1's file.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import UserError
from draftsmith.families import layer_family, within_window
from draftsmith.heads.base import Drafter, filled_from_target
from draftsmith.heads.proposer import DraftState, DraftTree, DynamicTree, Proposer, Tree
from draftsmith.target import TargetShape

if TYPE_CHECKING:
    from transformers import DynamicCache


def import_qualified(name: str):
    """A class named in a checkpoint's config. Only transformers' own model code may be named: a
    checkpoint is data, and must not be able to make us import arbitrary modules."""
    if not name.startswith("transformers."):
        raise UserError(f"EAGLE drafter config names {name!r}; only classes from transformers are loaded")
    module, _, attribute = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise UserError(
            f"EAGLE drafter: cannot import {name!r} ({err}); is the target's model code installed?"
        ) from None


class NoPositions(nn.Module):
    """The rotary table of a family without one: no position embeddings."""

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, **kwargs) -> None:
        return None


def decoder_spec(target_config, family: str, num_layers: int) -> dict:
    """What it takes to build the draft's decoder layers without the target: the layer, rotary and
    config classes of `family` and its config at the target's shape with `num_layers` layers."""
    chosen = layer_family(family)
    return {
        "layer": chosen.layer,
        "rotary": chosen.rotary,
        "config_class": chosen.config_class,
        "config": chosen.config(target_config, num_layers),
    }


@torch.no_grad()
def start_from_norm(draft_norm: nn.Module, target_norm: Optional[nn.Module]) -> None:
    """Load the target's final norm into a draft norm where, with those weights, both compute the same
    function: Llama's, Qwen's and Mistral's RMSNorms do, Gemma's (x * (1 + w)) and Cohere's LayerNorm
    do not (their weights would mean something else in a Llama norm). Elsewhere the draft norm keeps
    its fresh weights."""
    if target_norm is None or target_norm.state_dict().keys() != draft_norm.state_dict().keys():
        return
    trial = copy.deepcopy(draft_norm)
    trial.load_state_dict(target_norm.state_dict())
    weight = next(target_norm.parameters(), None)
    if weight is None:
        return
    probe = torch.randn(3, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight)
    # the draft norm is built on the host; the target may be on a GPU
    trial.to(device=weight.device, dtype=weight.dtype)
    if torch.allclose(trial(probe).float(), target_norm(probe).float(), rtol=1e-3, atol=1e-3):
        draft_norm.load_state_dict(target_norm.state_dict())


class EagleBase(Drafter):
    """What EAGLE-1 (`eagle`) and EAGLE-3 (`eagle3`) share: a draft model of the target family's
    layers that reads the target's token embedding; decoded by `EagleProposer`.

    A subclass defines `draft` (the draft model over given input features), `top_tokens` (its best
    next tokens, in target ids) and `committed_features` (the input features of newly committed
    positions, from the target's hidden states in a DraftState), and sets `fc`.
    """

    SERVED_BY = {"chain": ("vllm", "sglang"), "tree": ("sglang",)}  # SGLang verifies EAGLE trees (topk > 1)

    def __init__(self, config, target: TargetShape):
        super().__init__(config, target)
        if config.decoder is None:
            raise filled_from_target("decoder")
        layer_config = import_qualified(config.decoder["config_class"]).from_dict(config.decoder["config"])
        layer_config._attn_implementation = "sdpa"  # takes the explicit tree masks of decoding
        self.layer_config = layer_config
        rotary = config.decoder["rotary"]  # None: a family without rotary embeddings (NoPE attention)
        self.rotary_emb = import_qualified(rotary)(config=layer_config) if rotary else NoPositions()
        self.shared: Optional[tuple[nn.Module, nn.Module]] = None  # target's (embedding, lm_head): see attach_target

    @classmethod
    def decoder_layers(cls, config) -> int:
        """How many of the target family's decoder layers `decoder_spec` configures."""
        return config.num_layers

    @classmethod
    def from_target(cls, config, target_model, name_or_path: str) -> EagleBase:
        config = replace(
            config, decoder=decoder_spec(target_model.config, config.layer_family, cls.decoder_layers(config))
        )
        drafter = cls(config, TargetShape.of(target_model, name_or_path))
        drafter.attach_target(target_model)
        return drafter

    def attach_target(self, target_model) -> None:
        # A plain tuple, not submodules: the target's modules stay out of state_dict(), parameters()
        # (so out of the optimizer, DDP and the checkpoint) and `.to()`; they are frozen already.
        self.shared = (target_model.get_input_embeddings(), target_model.get_output_embeddings())

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's embedding rows of `tokens`, as the engines hand them to a drafter: the shared
        table itself, without a family's scaling of it (Gemma's embedding module multiplies by
        sqrt(hidden); vLLM applies that in the target's model, not in the table it shares)."""
        embedding, _ = self.target_modules()
        return F.embedding(tokens, embedding.weight)

    def target_modules(self) -> tuple[nn.Module, nn.Module]:
        if self.shared is None:
            raise RuntimeError(
                f"the {self.type} drafter has no target embedding/lm_head: load it with load_drafter(..., "
                "target_model=target)"
            )
        return self.shared

    def new_cache(self) -> DynamicCache:
        """The draft layers' KV cache, transformers' for their config except that a sliding-window layer keeps every
        key (the masks hide those out of its window: `attention_window`), so that a rejected draft's entries are
        cropped like any other's."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.layer_config)
        cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
        return cache

    def attention_window(self) -> Optional[int]:
        """The draft layers' sliding window (keys at positions > p - window seen from position p), or
        None: every position (EAGLE-1)."""
        return None

    # -- what a subclass defines ----------------------------------------------------------------
    def draft(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        cache: Optional[DynamicCache] = None,
    ) -> torch.Tensor:
        """[B, q] tokens and [B, q, H] input features at [B, q] positions -> [B, q, H] output
        features, each the input feature of the entry after it. `mask` None is causal attention
        within the call; otherwise a boolean [1, 1, q, cached + q] mask (True = may attend) over
        `cache`'s entries and the new ones, which the call appends to `cache`."""
        raise NotImplementedError

    def top_tokens(self, feature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An output feature [H] -> the k best next tokens' log-probabilities (at most 0, best
        first) and their ids in the target's vocabulary."""
        raise NotImplementedError

    def committed_features(self, state: DraftState) -> Optional[torch.Tensor]:
        """The input features [m, H] of the positions committed since the last proposal."""
        raise NotImplementedError

    def proposer(self, temperature: float = 0.0) -> EagleProposer:
        return EagleProposer(self)


class EagleProposer(Proposer):
    """EAGLE decoding for one sequence at a time: the drafter's own KV cache over the committed
    sequence (`catch_up`) and a greedy chain or EAGLE-2's dynamic tree grown from it (`grow`).
    Deterministic (top-k tokens, probs None), so the loop's exact rule treats q as one-hot."""

    def __init__(self, drafter: EagleBase):
        self.drafter = drafter
        self.features = drafter.request
        self.cache: Optional[DynamicCache] = None

    def default_tree(self, size: int) -> DynamicTree:
        depth, topk = self.drafter.config.tree_depth, self.drafter.config.tree_topk
        most = topk + (depth - 1) * topk * topk  # `grow`'s candidates: topk children of the topk best, each step
        return DynamicTree(nodes=min(size, most), depth=depth, topk=topk)

    @torch.no_grad()
    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        if tree is not None and not isinstance(tree, DynamicTree):
            raise UserError(
                f"the {self.drafter.type} drafter grows its tree itself: pass eval.tree=<node budget>, not a static "
                "tree"
            )
        root_feature = self.catch_up(state)
        if tree is None:
            return self.grow(root_feature, depth=num_tokens, topk=1, nodes=num_tokens)
        return self.grow(root_feature, depth=tree.depth, topk=tree.topk, nodes=tree.nodes)

    def catch_up(
        self,
        state: DraftState,
        extra_tokens: Optional[torch.Tensor] = None,
        extra_features: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Bring the drafter's cache to the committed sequence and return the output feature after the root.
        With `extra_tokens` [k] and `extra_features` [k, H] (P-EAGLE's masked queries), k more entries
        follow the root in the same forward, at the next positions: the outputs of the root and of
        them are returned, [1 + k, H].

        Cache entry p holds (x_{p+1}, f_p), f_p the input feature the target's hidden states at p
        give. With n committed tokens the target's states are known at positions 0..n-2, and the
        state's new ones cover the last m of them. Everything in the cache from position n-1-m on
        is either a draft entry (own predicted feature) or an entry whose token was not yet
        committed, so it is cropped and rebuilt from the target's states; the last rebuilt entry,
        (root, f_{n-2}), predicts the feature behind the first draft token.
        """
        drafter = self.drafter
        features = drafter.committed_features(state)
        if features is None or len(features) == 0:
            raise ValueError(
                f"{drafter.type} needs the target's hidden states at the newly committed positions "
                "(DraftState.new_final / new_layers)"
            )
        tokens = state.tokens
        committed = len(tokens) - 1  # positions with the target's feature known
        start = committed - len(features)
        if state.fresh or self.cache is None:
            self.cache = drafter.new_cache()
        if self.cache.get_seq_length() < start:
            raise RuntimeError(
                f"{drafter.type} cache holds {self.cache.get_seq_length()} positions, the committed sequence needs "
                f"{start}"
            )
        self.cache.crop(start - self.cache.get_seq_length())  # crop takes minus the count to drop
        inputs, extra = tokens[start + 1 :], 0
        if extra_tokens is not None:
            inputs, features, extra = (
                torch.cat([inputs, extra_tokens]),
                torch.cat([features, extra_features]),
                len(extra_tokens),
            )
        new = torch.arange(start, committed + extra, device=tokens.device)
        mask = torch.ones(1, 1, len(new), committed + extra, dtype=torch.bool, device=tokens.device).tril(start)
        window = drafter.attention_window()
        if window is not None:  # cache entry p sits at position p
            mask &= within_window(new[:, None], torch.arange(committed + extra, device=tokens.device), window)
        out = drafter.draft(inputs[None], features[None], new[None], mask, self.cache)
        self.draft_forwards += 1
        return out[0, -1] if extra_tokens is None else out[0, -1 - extra :]

    def grow(self, root_feature: torch.Tensor, depth: int, topk: int, nodes: int) -> DraftTree:
        """EAGLE-2's dynamic tree: score nodes by cumulative draft log-prob; at each step give each
        of the `topk` best newest nodes its `topk` most likely children; after `depth` steps keep the
        best `nodes` nodes overall. A child never outscores its parent and ties go to the older node,
        so the kept set contains every kept node's parent. topk = 1 is the greedy chain."""
        drafter, device = self.drafter, root_feature.device
        committed = self.cache.get_seq_length()  # the root's entry is the last, at position committed-1
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        node_depth: list[int] = []
        entry_of: dict[int, int] = {}  # expanded node -> its cache entry
        window = drafter.attention_window()
        drafted_positions: list[int] = []  # of the expanded nodes' cache entries, after the committed ones
        output_of: dict[int, torch.Tensor] = {
            -1: root_feature
        }  # expanded node (or root) -> the feature its entry predicts

        def add_children(parent: int, parent_score: float, feature: torch.Tensor) -> list[int]:
            log_probs, ids = drafter.top_tokens(feature, topk)
            added = []
            for token, log_prob in zip(ids.tolist(), log_probs.tolist()):
                added.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
                scores.append(parent_score + log_prob)
                node_depth.append(1 if parent < 0 else node_depth[parent] + 1)
            return added

        newest = add_children(-1, 0.0, root_feature)
        for _ in range(depth - 1):
            frontier = sorted(newest, key=lambda n: (-scores[n], n))[:topk]
            features = torch.stack([output_of[parents[n]] for n in frontier])  # a node's entry reads its parent's f̂
            past = self.cache.get_seq_length()
            mask = torch.zeros(1, 1, len(frontier), past + len(frontier), dtype=torch.bool, device=device)
            mask[..., :committed] = True
            for row, node in enumerate(frontier):
                ancestor = parents[node]
                while ancestor >= 0:
                    mask[0, 0, row, entry_of[ancestor]] = True
                    ancestor = parents[ancestor]
                mask[0, 0, row, past + row] = True
            for row, node in enumerate(frontier):
                entry_of[node] = past + row
            positions = torch.tensor([[committed - 1 + node_depth[n] for n in frontier]], device=device)
            if window is not None:  # committed entry p sits at position p
                drafted_positions += positions[0].tolist()
                keys = torch.cat(
                    [torch.arange(committed, device=device), torch.tensor(drafted_positions, device=device)]
                )
                mask &= within_window(positions[0, :, None], keys, window)
            frontier_tokens = torch.tensor([[tokens[n] for n in frontier]], device=device)
            out = drafter.draft(frontier_tokens, features[None], positions, mask, self.cache)[0]
            self.draft_forwards += 1
            newest = []
            for row, node in enumerate(frontier):
                output_of[node] = out[row]
                newest += add_children(node, scores[node], out[row])

        kept = sorted(
            sorted(range(len(tokens)), key=lambda n: (-scores[n], n))[:nodes]
        )  # then by creation: parents first
        index = {node: i for i, node in enumerate(kept)}
        return DraftTree(
            tokens=torch.tensor([tokens[n] for n in kept], device=device),
            parents=torch.tensor([index[parents[n]] if parents[n] >= 0 else -1 for n in kept], device=device),
        )
