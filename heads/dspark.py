"""DSpark: DFlash's block drafter (heads/dflash.py) with a Markov head and a confidence head.

The backbone is DFlash's, unchanged: a block `[x_a, m, ..., m]` of S queries at positions a .. a+S-1 read the
fused target context before a and one another (non-causally), and the target's frozen lm_head turns each output
into base logits. What DSpark changes:

- Every block position predicts the token after it (DSpark's "sample from anchor", vLLM's default for it):
  position k (0..S-1) guesses x_{a+k+1}, so a block of S queries proposes S tokens and a chain of γ runs a block
  of γ queries (the anchor and γ-1 masks), as vLLM runs DSpark with num_speculative_tokens γ.
- The Markov head adds a first-order transition bias: position k's logits are its base logits plus
  markov_w2(markov_w1[prev_k]), markov_w1 a V x r embedding of the previous token and markov_w2 an r -> V
  projection, where prev_0 = x_a and prev_k is the token drafted at k-1. So the block is drafted in one parallel
  pass and then sampled left to right, each position's q conditioned on the tokens drafted before it: a chain's
  q is the proposal the exact rule reads (heads/dspark_proposer.py).
- The confidence head, a linear map of cat(position k's output, markov_w1[prev_k]) to one logit, estimates the
  chance its token is accepted: vLLM's adaptive verification (`adaptive_verification`) verifies only the drafts whose
  survival pays for their cost, and the eval's chain is cut as vLLM would cut it (heads/dspark_proposer.py).

Training (`loss`): DFlash's anchors; position k teacher-forced on prev_k = x_{a+k} (the data's token, as
speculators trains it) and scored against x_{a+k+1}, by cross-entropy to the data's token or soft cross-entropy
to the target's distribution of it, with DFlash's per-block weights (decay exp(-k/loss_decay) or D-PACE), plus
`confidence_weight` times the confidence head's binary cross-entropy to its target c*_k = sum_v min(q_v, p_v),
the acceptance chance of a draft sampled from q against the teacher p (1 - total variation; q(x_{a+k+1}) against
the data's token), detached, weighed exp(-k/confidence_decay). Both terms are per-block weighted means, summed
over blocks, normalised by the blocks (DFlash's `loss_tokens`).

The Markov bias enters the fused vocabulary loss (heads/vocab_loss.py) exactly as a wider feature: the logits
cat(h, e) @ cat(W_lm, W_2).T = h @ W_lm.T + e @ W_2.T, e = markov_w1[prev]. The weight's gradient then covers the
frozen lm_head's columns too, computed and dropped: the price of one fused pass over the vocabulary.

Checkpoint names: DFlash's, plus `markov_head.markov_w1.weight [V, r]`, `markov_head.markov_w2.weight [V, r]` and
`confidence_head.proj.{weight [1, H+r], bias [1]}`: vLLM's Qwen3 DSpark names (formats/dspark.py).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads import register
from draftsmith.heads.base import per_sample_stats
from draftsmith.heads.dflash import DFlash
from draftsmith.heads.dspark_config import DSparkConfig
from draftsmith.heads.dspark_proposer import DSparkProposer
from draftsmith.heads.packing import documents, num_documents
from draftsmith.heads.vocab_loss import chunk_rows_for
from draftsmith.target import TargetOutput, TargetShape


class MarkovHead(nn.Module):
    """The low-rank transition bias: markov_w2(markov_w1[previous token])."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        with torch.no_grad():
            # small embeddings and a zero projection: a fresh head adds no bias, the backbone drafts as DFlash's would
            self.markov_w1.weight.normal_(std=0.01)
            self.markov_w2.weight.zero_()

    def bias(self, previous: torch.Tensor) -> torch.Tensor:
        """[..., V] float32 logit bias after the tokens `previous` [...]."""
        return self.markov_w2(self.markov_w1(previous)).float()


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, outputs: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        """The acceptance logit [...] of block outputs [..., H] after previous tokens embedded [..., r]."""
        features = torch.cat([outputs, markov_embedding.to(outputs.dtype)], dim=-1)
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1).float()


@register
class DSpark(DFlash):
    """DFlash's backbone (built, trained on anchors and cached as DFlash's) with the Markov and confidence heads."""

    type = "dspark"
    TITLE = "DSpark"
    DEPTH_TOP1 = "block{depth}/top1"  # the depth-th drafted token, block position depth-1
    # the Markov head's token embedding (V x r) and its projection back to the vocabulary (r -> V): AdamW's under Muon
    NOT_HIDDEN = (*DFlash.NOT_HIDDEN, "markov_head")
    Config = DSparkConfig
    SERVED_BY = {"chain": ("vllm",)}  # vLLM 0.32's GPU model runner V2 only (formats/dspark.py); no trees
    # At temperature > 0 each position is sampled from its own Markov-corrected q, which the ratio test reads
    SAMPLES_DRAFTS = True

    def __init__(self, config: DSparkConfig, target: TargetShape):
        super().__init__(config, target)
        self.markov_head = MarkovHead(target.vocab_size, config.markov_rank)
        if config.confidence_head:
            self.confidence_head = ConfidenceHead(target.hidden_size + config.markov_rank)

    @classmethod
    def max_chain(cls, config: DSparkConfig) -> int:
        return config.block_size

    def proposer(self, temperature: float = 0.0) -> DSparkProposer:
        return DSparkProposer(self, temperature)

    def block_logits(self, outputs: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """The Markov-corrected logits [..., V] (float32) of block outputs [..., H] after tokens `previous` [...]."""
        return self.logits(outputs) + self.markov_head.bias(previous)

    # -- training -------------------------------------------------------------------------------
    def loss(self, batch: dict, target_out: TargetOutput):
        """The block cross-entropy with the Markov bias from the data's previous token, and the confidence head's
        loss (module docstring); `(sum over blocks, blocks, stats)` as DFlash's loss. Metrics: DFlash's
        (`block{k}/top1` the k-th drafted token, `token_loss`, `accepted`), and `confidence_error`, the mean
        |sigmoid(confidence) - c*| where the head is."""
        input_ids = batch["input_ids"]
        size = self.config.block_size
        anchors, real, outputs = self.sampled_blocks(batch, target_out)  # [B, A, S, H]
        offsets = torch.arange(size, device=input_ids.device)
        clamped, labels, supervised = self.scored(batch, anchors, real, size)  # block position k scores x_{a+k+1}
        previous = input_ids.gather(1, (clamped - 1).flatten(1)).view_as(clamped)  # x_{a+k}: the anchor at k = 0

        lm_weight = self.target_modules()[1].weight  # the target's lm_head, frozen
        markov = self.markov_head.markov_w1(previous)  # [B, A, S, r]
        weight = torch.cat([lm_weight, self.markov_head.markov_w2.weight.to(lm_weight.dtype)], dim=1)
        features = torch.cat([outputs, markov.to(outputs.dtype)], dim=-1).flatten(0, 2).to(weight.dtype)
        chunk_rows = chunk_rows_for(self.loss_chunk_bytes, weight.shape[0])
        teacher = self.block_teacher(clamped, input_ids, target_out)
        vocab_loss = partial(self.vocab_loss, features, weight, labels, teacher)

        if self.config.loss_weighting == "dpace":
            # D-PACE's weights come from the draft's own detached cross-entropies; the weight's gradient (the Markov
            # projection's) follows a pass's weighted sum only (heads/vocab_loss.py), so a first pass without
            # gradients finds the weights and a second one is weighted by them
            with torch.no_grad():
                first = vocab_loss(supervised.flatten().float()).token_loss.view_as(supervised)
            block_weight = self.dpace_weights(supervised, first)
        else:
            decay = torch.exp(-offsets.float() / self.config.loss_decay)
            block_weight = supervised * (decay / decay.sum())  # a whole block's weights sum to 1
        result = vocab_loss(block_weight.flatten())
        total = result.loss
        token_loss = result.token_loss.detach().view_as(supervised)

        stats = {}
        if self.config.confidence_head:
            accepted_chance = self.acceptance(features, weight, teacher, supervised, token_loss, chunk_rows)
            confidence = self.confidence_head(outputs, markov)
            decay = torch.exp(-offsets.float() / self.config.confidence_decay)
            confidence_weight = supervised * (decay / decay.sum())
            bce = F.binary_cross_entropy_with_logits(confidence, accepted_chance, reduction="none")
            total = total + self.config.confidence_weight * (bce * confidence_weight).sum()
            with torch.no_grad():
                error = (confidence.sigmoid() - accepted_chance).abs()
                docs = documents(batch)
                block_docs = docs.gather(1, anchors).clamp(min=0)[..., None].expand_as(supervised)
                stats |= per_sample_stats(
                    {"confidence_error": error}, block_docs, num_documents(batch), where=supervised
                )
        stats |= self.block_stats(result.best, labels, supervised, token_loss, anchors, real, batch)
        return total, real.sum(), stats

    @torch.no_grad()
    def acceptance(self, features, weight, teacher, supervised, token_loss, chunk_rows) -> torch.Tensor:
        """c*_k [B, A, S]: sum_v min(q_v, p_v) of each scored position's Markov-corrected q and its teacher p;
        against the data's token q(token) = exp(-CE). 0 where not scored."""
        if self.config.loss != "soft_ce":
            return torch.exp(-token_loss) * supervised
        overlap = torch.zeros(supervised.numel(), device=features.device)
        for index in supervised.flatten().nonzero().squeeze(1).split(chunk_rows):
            q = F.linear(features[index], weight).float().softmax(-1)
            overlap[index] = torch.minimum(q, teacher(index)).sum(-1)
        return overlap.view_as(supervised)
