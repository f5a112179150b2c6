"""EAGLE-1 (with EAGLE-2's dynamic draft tree at decode time): a small autoregressive model over the
target's features.

Draft position t reads the target's post-norm last hidden state f_t (the lm_head input, EAGLE's
`hidden_states[-1]`) and the embedding of the *next* token x_{t+1}:

    f̂_{t+1} = layers(fc(cat(embed(x_{t+1}), f_t)))      layers: decoder layers of the target's family

and the target's own lm_head turns f̂_{t+1} into a guess of x_{t+2}. At decode time the drafter keeps
its own KV cache over (token, feature) pairs: committed positions carry the target's features, draft
positions its own predictions, which is how it runs several steps ahead.

The token embedding and the lm_head are the target's, frozen, and not part of the checkpoint
(vLLM and SGLang share them with the target too); `attach_target` re-attaches them after loading.
What EAGLE-1 and EAGLE-3 (heads/eagle3.py) share is `EagleBase`; their decoding side, the drafter's
own KV cache over the committed sequence with the greedy chain and EAGLE-2's dynamic tree grown from
it, is `EagleProposer`.

Parameter names are those of vLLM's/SGLang's EAGLE-1 loaders (`fc.weight|bias`, `layers.{i}.*`,
no `layers.0.input_layernorm`), so export is at most a prefix rename; vLLM's loader has no fc bias
(`fc_bias: false` for a checkpoint meant for it).
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import UserError
from draftsmith.families import layer_family, within_window
from draftsmith.heads import register
from draftsmith.heads.base import (
    Drafter,
    DrafterConfig,
    DraftState,
    DraftTree,
    DynamicTree,
    Proposer,
    Tree,
    per_sample_stats,
)
from draftsmith.heads.packing import documents, draft_attention_mask, num_documents, positions, same_document
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass
class EagleConfig(DrafterConfig):
    type: str = "eagle"  # the drafter kind (registry key)
    SETTINGS = ("feature_loss_weight", "token_loss_weight", "noise_std", "tree_depth", "tree_topk")  # see DrafterConfig
    num_layers: int = 1  # decoder layers (every published EAGLE-1 checkpoint has 1)
    fc_bias: bool = False  # EAGLE's code defaults to True; its LLaMA-3 checkpoints and vLLM's loader have none
    feature_loss_weight: float = 1.0  # v_w: SmoothL1 between predicted and target feature
    token_loss_weight: float = 0.1  # p_w: soft cross-entropy against the target's next-token distribution
    noise_std: float = 0.2  # width of the uniform noise on input features in training (see `loss`)
    tree_depth: int = 5  # dynamic tree (EAGLE-2): draft steps ...
    tree_topk: int = 8  # ... children expanded per node and nodes expanded per step; eval.tree = node budget
    # The family of the draft's own decoder layers, whatever the target's (draftsmith.families):
    # llama is what vLLM and SGLang build for an EAGLE drafter of any target.
    layer_family: str = "llama"
    decoder: Optional[dict] = None  # the draft layers' classes and config, resolved by from_target

    def check(self, target: Optional[TargetShape] = None) -> None:
        check_tree_settings(self)
        layer_family(self.layer_family)
        if self.num_layers < 1:
            raise UserError(f"drafter.num_layers must be >= 1 (got {self.num_layers})")
        if (
            self.feature_loss_weight < 0
            or self.token_loss_weight < 0
            or self.feature_loss_weight + self.token_loss_weight <= 0
        ):
            raise UserError("drafter.feature_loss_weight and token_loss_weight must be >= 0, not both 0")
        if self.noise_std < 0:
            raise UserError(f"drafter.noise_std={self.noise_std} must be >= 0")


def check_tree_settings(config) -> None:
    if config.tree_depth < 1 or config.tree_topk < 1:
        raise UserError(f"drafter.tree_depth and tree_topk must be >= 1 (got {config.tree_depth}, {config.tree_topk})")


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

    SERVED_BY = {"chain": "vLLM, SGLang", "tree": "SGLang"}  # SGLang verifies EAGLE trees (topk > 1)

    def __init__(self, config, target: TargetShape):
        super().__init__(config, target)
        if config.decoder is None:
            raise UserError(
                f"an {self.type} drafter is built for a target: use from_target (drafter.decoder is filled there)"
            )
        layer_config = import_qualified(config.decoder["config_class"]).from_dict(config.decoder["config"])
        layer_config._attn_implementation = "sdpa"  # takes the explicit tree masks of decoding
        self.layer_config = layer_config
        self.rotary_emb = import_qualified(config.decoder["rotary"])(config=layer_config)
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
        return DynamicTree(nodes=size, depth=self.drafter.config.tree_depth, topk=self.drafter.config.tree_topk)

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
            from transformers import DynamicCache

            self.cache = DynamicCache(config=drafter.layer_config)
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


@register
class Eagle(EagleBase):
    type = "eagle"
    TITLE = "EAGLE-1"
    Config = EagleConfig

    def __init__(self, config: EagleConfig, target: TargetShape):
        super().__init__(config, target)
        layer_cls = import_qualified(config.decoder["layer"])
        hidden = target.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        self.layers = nn.ModuleList(layer_cls(self.layer_config, layer_idx=i) for i in range(config.num_layers))
        # EAGLE feeds fc's output to the first layer unnormalised (vLLM: disable_input_layernorm).
        self.layers[0].input_layernorm = nn.Identity()

    @classmethod
    def features(cls, config: EagleConfig, target: TargetShape) -> FeatureRequest:
        return FeatureRequest(final=True, logits=True)

    # -- the draft model ------------------------------------------------------------------------
    def draft(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        cache: Optional[DynamicCache] = None,
    ) -> torch.Tensor:
        """EAGLE-1: f̂_{p+1} = layers(fc(cat(embed(x_{p+1}), f_p))) (see EagleBase.draft)."""
        hidden = self.fc(torch.cat([self.embed(tokens).to(features.dtype), features], dim=-1))
        rope = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, cache=cache, position_embeddings=rope)
        return hidden

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        _, lm_head = self.target_modules()
        return lm_head(features.to(lm_head.weight.dtype)).float()

    def top_tokens(self, feature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Clamped so that rounding never lets a child outscore its parent (see `grow`).
        best = self.logits(feature).log_softmax(-1).clamp(max=0).topk(k)
        return best.values, best.indices

    def committed_features(self, state: DraftState) -> Optional[torch.Tensor]:
        return None if state.new_final is None else state.new_final.to(self.fc.weight.dtype)

    # -- training -------------------------------------------------------------------------------
    def loss(self, batch: dict, target_out: TargetOutput):
        """EAGLE's loss, teacher-forced on the target's features of the same forward.

        Alignment, with x_t = input_ids[:, t] and f_t = target_out.final[:, t] (f_t is what the target
        reads to predict x_{t+1}): draft position t reads (embed(x_{t+1}), f_t) and predicts f_{t+1},
        whose lm_head output is a guess of x_{t+2}. So for t in [0, T-2): tokens input_ids[:, 1:-1],
        features final[:, :-2], regression target final[:, 1:-1], soft labels the target's
        distribution logits[:, 1:-1] (of x_{t+2}), and position t counts where x_{t+2} is
        supervised: loss_mask[:, 2:]. (EAGLE #317 and SpecForge #885 were off-by-ones here.)

        Packed rows: attention is block-diagonal per document and positions restart, and t counts
        only where x_{t+2} is in t's document. The last position of a document reads the next
        document's first token, but nothing in its own document attends to it and it is not scored.
        """
        dtype = self.fc.weight.dtype
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        length = input_ids.shape[1]
        docs = documents(batch)
        final = target_out.final.to(dtype)
        features = final[:, :-2]
        if self.training and self.config.noise_std > 0:
            # EAGLE's uniform noise, (rand - 0.5) * std, without its as-coded extra factor
            # 512 / seq_len, which makes the amplitude depend on the padded batch length.
            features = features + (torch.rand_like(features) - 0.5) * self.config.noise_std
        predicted = self.draft(
            input_ids[:, 1:-1], features, positions(batch)[:, :-2], draft_attention_mask(batch, length - 2)
        )

        mask = loss_mask[:, 2:] & same_document(docs, 2)
        rows = docs[:, :-2][mask]
        predicted = predicted[mask]  # only supervised positions reach the vocab projection (memory)
        feature_loss = F.smooth_l1_loss(predicted.float(), final[:, 1:-1][mask].float(), reduction="none").mean(-1)
        # The target's distribution of x_{t+2} (its logits at t+1), read at the supervised positions only.
        at_b, at_t = mask.nonzero(as_tuple=True)
        target_logits = target_out.logits_at(at_b * length + at_t + 1).float()
        log_probs = self.logits(predicted).log_softmax(-1)
        token_loss = -(target_logits.softmax(-1) * log_probs).sum(-1)
        # Sums over the scored positions; the trainer divides by loss_tokens (heads/base.py, "The loss contract").
        total = self.config.feature_loss_weight * feature_loss.sum() + self.config.token_loss_weight * token_loss.sum()

        with torch.no_grad():
            guess = log_probs.argmax(-1)
            values = {
                "feature_loss": feature_loss.detach(),
                "token_loss": token_loss.detach(),
                # agreement with the target's greedy token: greedy acceptance of the first draft token
                "step1/top1": (guess == target_logits.argmax(-1)).float(),
                "step1/top1_data": (guess == input_ids[:, 2:][mask]).float(),  # the data's next token
            }
        return total, self.loss_tokens(batch), per_sample_stats(values, rows, num_documents(batch))
