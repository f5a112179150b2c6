"""Medusa-1: K heads on the frozen target's last hidden state; head k guesses the token k+1
positions beyond the target's own next token.

Parameter names follow vLLM's Medusa layout (`blocks.{h}.layers.{l}.weight|bias`,
`lm_heads.{h}.weight`, with `medusa_fc_bias: true`), so export is a config rewrite, not a rename.
Head numbering in metrics is 1-based: `head1` predicts 2 tokens ahead of the hidden state it reads.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import UserError
from draftsmith.heads import register
from draftsmith.heads.base import EVAL_SPLIT_METRICS, Drafter, per_sample_stats
from draftsmith.heads.medusa_config import MedusaConfig
from draftsmith.heads.packing import documents, num_documents, same_document
from draftsmith.heads.proposer import DraftState, DraftTree, Proposer
from draftsmith.heads.vocab_loss import chunk_rows_for, cross_entropy
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape


class ResidualBlock(nn.Module):
    """x + SiLU(W x + b). Zero-initialised W and b make a fresh head start as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaBlocks(nn.Module):
    """One head's stack of residual blocks; `layers.{l}` are distinct modules with their own weights."""

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@register
class Medusa(Drafter):
    type = "medusa"
    TITLE = "Medusa-1"
    DEPTH_TOP1 = "head{depth}/top1"  # head h guesses depth h
    Config = MedusaConfig
    SERVED_BY = {"chain": ("vllm",), "tree": ()}  # vLLM's medusa method verifies chains; its trees: the eval only

    def __init__(self, config: MedusaConfig, target: TargetShape):
        super().__init__(config, target)
        self._verifier: tuple[nn.Module, ...] = ()  # see verify_with; a tuple keeps it out of the module tree
        hidden, vocab = target.hidden_size, target.vocab_size
        self.blocks = nn.ModuleList(MedusaBlocks(hidden, config.num_layers) for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(
            nn.utils.skip_init(nn.Linear, hidden, vocab, bias=False) for _ in range(config.num_heads)
        )
        for head in self.lm_heads:  # zeros, not nn.Linear's draw: from_target copies the target's lm_head in (or
            # draws them), a load fills them; the draw, then overwritten, cost 1.5 s a head more at 152k x 4096
            nn.init.zeros_(head.weight)
        self._register_state_dict_hook(_vllm_names)
        self._register_load_state_dict_pre_hook(_from_vllm_names)

    @classmethod
    def from_target(cls, config: MedusaConfig, target_model, name_or_path: str) -> Medusa:
        drafter = cls(config, TargetShape.of(target_model, name_or_path))
        weight = target_model.get_output_embeddings().weight.detach()
        for head in drafter.lm_heads:
            if config.init_lm_heads_from_target:
                head.weight.data.copy_(weight)  # cast into the head's float32 in place: no float copy of the table
            else:
                head.reset_parameters()
        return drafter

    @classmethod
    def features(cls, config: MedusaConfig, target: TargetShape) -> FeatureRequest:
        return FeatureRequest(final=True)

    @classmethod
    def max_chain(cls, config: MedusaConfig) -> int:
        return config.num_heads

    def loss_weights(self) -> list[float]:
        if self.config.loss_weights is not None:
            return list(self.config.loss_weights)
        return [self.config.loss_decay**k for k in range(self.config.num_heads)]

    def head_logits(self, head: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_heads[head](self.blocks[head](hidden))

    def loss(self, batch: dict, target_out: TargetOutput):
        total, stats = self.heads_loss(batch, target_out.final)
        return total, self.loss_tokens(batch), stats

    def heads_loss(self, batch: dict, hidden: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Weighted cross-entropy of every head on the data's tokens, read from `hidden`, the
        target's post-norm last hidden state [B, T, H] (Medusa-2 passes its adapted target's): the
        sum over heads k of loss_weights[k] x head k's cross-entropy summed over the tokens it scores
        (heads/base.py, "The loss contract"), and the per-sample statistics.

        No shape depends on the data, so nothing waits for the host on an accelerator: every position
        runs, weighted by whether it is scored, through the fused vocabulary loss (heads/vocab_loss.py),
        which holds `loss_chunk_bytes` of logits at a time rather than logits for every supervised
        position, and reads the top-5 statistic off the same logits."""
        hidden = hidden.to(self.lm_heads[0].weight.dtype)
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        docs, num_docs = documents(batch), num_documents(batch)
        vocab = self.lm_heads[0].weight.shape[0]
        chunk_rows = chunk_rows_for(self.loss_chunk_bytes, vocab)
        total = hidden.new_zeros(())
        stats: dict[str, torch.Tensor] = {}
        for k, weight in enumerate(self.loss_weights()):
            shift = k + 2  # hidden at t -> token t+2 for the first head
            if input_ids.shape[1] <= shift:
                continue
            # The label must be in the hidden state's own document (packed rows hold several).
            scored = (loss_mask[:, shift:] & same_document(docs, shift)).flatten()
            labels = input_ids[:, shift:].flatten()
            features = self.blocks[k](hidden[:, :-shift]).flatten(0, 1)
            head = self.lm_heads[k].weight
            result = cross_entropy(features, head, labels, scored.float(), chunk_rows, top_k=True)
            total = total + weight * result.loss
            values = {
                f"head{k + 1}/loss": result.token_loss.detach(),  # a statistic: no graph kept for it
                f"head{k + 1}/top1": (result.best == labels).float(),
                f"head{k + 1}/top5": result.top_k.float(),  # vocab_loss.TOP_K
            }
            stats |= per_sample_stats(values, docs[:, :-shift].clamp(min=0), num_docs, where=scored)
        return total, stats

    def verify_with(self, model: nn.Module) -> None:
        """Decode with `model` verifying instead of the target: the heads were trained on its hidden
        states (an exported Medusa-2, whose target has the adapters merged)."""
        self._verifier = (model,)

    def verifier(self) -> Optional[nn.Module]:
        return self._verifier[0] if self._verifier else None

    def proposer(self, temperature: float = 0.0) -> MedusaProposer:
        return MedusaProposer(self)


class MedusaProposer(Proposer):
    """Medusa decoding: every head reads the target's last hidden state before the root once; a
    chain takes each head's argmax, a tree each head's top candidates along static paths."""

    features = FeatureRequest(final=True)

    def __init__(self, drafter: Medusa):
        self.drafter = drafter
        self.verifier = drafter.verifier()

    @torch.no_grad()
    def propose(
        self, state: DraftState, num_tokens: int, tree: Optional[Sequence[tuple[int, ...]]] = None
    ) -> DraftTree:
        drafter, heads = self.drafter, self.drafter.config.num_heads
        self.draft_forwards += 1  # every head reads the same hidden state: one pass
        hidden = state.final.to(drafter.lm_heads[0].weight.dtype)[None]
        if tree is None:
            if not 1 <= num_tokens <= heads:
                raise UserError(
                    f"a Medusa drafter with {heads} heads proposes at most {heads} tokens (asked {num_tokens})"
                )
            tokens = torch.stack([drafter.head_logits(k, hidden)[0].argmax() for k in range(num_tokens)])
            return DraftTree.chain(tokens)
        depth = max(len(path) for path in tree)
        if depth > heads:
            raise UserError(f"tree depth {depth} exceeds the drafter's {heads} heads")
        width = max(max(path) for path in tree) + 1
        candidates = [drafter.head_logits(k, hidden)[0].topk(width).indices for k in range(depth)]
        index = {path: i for i, path in enumerate(tree)}
        tokens = torch.stack([candidates[len(path) - 1][path[-1]] for path in tree])
        parents = torch.tensor([index[path[:-1]] if len(path) > 1 else -1 for path in tree], device=tokens.device)
        return DraftTree(tokens=tokens, parents=parents)

    def default_tree(self, size: int) -> list[tuple[int, ...]]:
        """The `size` most likely paths under per-head, per-rank acceptance estimates (Medusa's
        static trees are built the same way from measured accuracies)."""
        heads = self.drafter.config.num_heads
        rank_probs = [self._rank_probabilities(k) for k in range(heads)]
        frontier = [(-rank_probs[0][r], (r,)) for r in range(len(rank_probs[0]))]
        heapq.heapify(frontier)
        paths: list[tuple[int, ...]] = []
        while frontier and len(paths) < size:
            neg_prob, path = heapq.heappop(frontier)
            paths.append(path)
            if len(path) < heads:
                for r, p in enumerate(rank_probs[len(path)]):
                    heapq.heappush(frontier, (neg_prob * p, path + (r,)))
        # Sort so every parent precedes its children (shorter paths first, then by rank).
        return sorted(paths, key=lambda path: (len(path), path))

    def _rank_probabilities(self, head: int) -> list[float]:
        """P(the true token is the head's rank-r candidate), from the top-1/top-5 accuracy measured
        on the eval split after training (`learned`), or rough priors for a head never measured."""
        measured = self.drafter.learned.get(EVAL_SPLIT_METRICS, {})
        topk = self.drafter.config.tree_topk
        top1 = float(measured.get(f"head{head + 1}/top1", 0.6 * 0.7**head))
        top5 = max(float(measured.get(f"head{head + 1}/top5", min(0.95, top1 * 1.6))), top1)
        spread = [0.4, 0.27, 0.2, 0.13]  # how the top-2..5 mass usually falls off
        tail = max(1.0 - top5, 0.0) / max(topk - 5, 1) * 0.5
        probs = [top1] + [(top5 - top1) * s for s in spread] + [tail] * max(topk - 5, 0)
        return probs[:topk]


def _vllm_names(module, state_dict, prefix, local_metadata):
    for key in list(state_dict):
        if key.startswith(prefix + "blocks.") and ".linear." in key:
            state_dict[key.replace(".linear.", ".")] = state_dict.pop(key)
    return state_dict


def _from_vllm_names(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for key in list(state_dict):
        if key.startswith(prefix + "blocks.") and key.count(".") - prefix.count(".") == 4:
            head, rest = key[len(prefix) :].split(".layers.", 1)
            layer, param = rest.split(".", 1)
            state_dict[f"{prefix}{head}.layers.{layer}.linear.{param}"] = state_dict.pop(key)
