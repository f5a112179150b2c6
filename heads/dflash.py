"""DFlash: a block drafter. One draft forward proposes a whole block of tokens.

The block is `[x_a, m, m, ..., m]` (block_size positions, at RoPE positions a .. a+block_size-1): the
last committed token x_a (the anchor) followed by block_size-1 copies of the mask input m: the target's
embedding of `mask_token_id` (a token of its vocabulary, frozen: what the engines feed, so the export is
exact) or, with mask_token_id null, a vector the drafter learns (draftsmith's eval only: the engines'
layout has no slot for it). A small stack of the target family's decoder layers denoises it in one
pass; the target's own (frozen, shared, not saved) lm_head turns block position k's output into a
guess of x_{a+k}. Every layer's attention reads

    queries: the block;   keys/values: [projected context ; the block]   non-causal within the block

where the context is the fused target feature c_j = hidden_norm(fc(cat(h^l_j for l in target_layers)))
at every position j < a (strictly before the anchor: the target has not run on x_a yet), projected by
each layer's own k_proj/v_proj (no input_layernorm on it). The context does not change across layers.
With `qk_norm` (the default) every layer normalises queries and keys per head (Qwen3's q_norm/k_norm,
added where the target's family has none): vLLM's DFlash layers always apply them.

Decoding (`DFlashProposer`, heads/dflash_proposer.py): the context keys and values of committed
positions are cached per layer and cropped on rejection (they change only when the committed sequence
does); the block is recomputed per cycle.
A chain of γ tokens runs a block of 1 + γ queries, as vLLM runs DFlash with num_speculative_tokens γ
(so γ = block_size - 1 is the block trained on), and is the per-position argmax (T=0) or a sample from
each position's q (T>0, q returned for the exact rule); DDTree runs the whole block and is a
best-first tree over the per-position top-k under the node budget `eval.tree`, scored by summed log q.
Either way: one draft forward per decode cycle.

Training (`loss`): random anchors per sequence, positions a where x_a and x_{a+1} both bear loss,
at most `anchors` of them; one block per anchor, its context the positions before a. Block position
k (1..block_size-1) is scored against x_{a+k} (cross-entropy to the data, or soft cross-entropy to
the target's distribution of x_{a+k}) with weight exp(-(k-1)/loss_decay), or with D-PACE's weights
(`loss_weighting=dpace`, arXiv 2605.18810; speculators' default for DFlash): from the draft's own,
detached, confidence c_k = exp(-CE_k) smoothed to s_k = (1-α)c_k + α, position k weighs
sum_{j>=k} prod_{i<=j} s_i, how much of the block's expected accepted length rides on it. Either way a
block's weights are normalised to sum 1 (its loss a weighted mean). Attention cost per layer
and sequence: anchors × block_size queries against T context keys plus block_size block keys, i.e.
O(A·B·(T+B)) scores, never the O((A·B)²) of a dense mask over all blocks (see `block_attention`,
heads/dflash_layer.py).

Layer ids: `target_layers` use draftsmith's convention (draftsmith.target: id i is the output of
decoder layer i, transformers' hidden_states[i + 1]), which is also DFlash's own `target_layer_ids`;
speculators' `aux_hidden_state_layer_ids` are these + 1. Default: `num_layers` ids spread evenly
over [1, L-3] (the reference's choice).

Checkpoint names follow the public DFlash layout: `fc.weight [H, n*H]`, `hidden_norm.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.*` (and `q_norm`/`k_norm` for families that have them),
`layers.{i}.mlp.*`, `layers.{i}.{input,post_attention}_layernorm.weight`, `norm.weight`, and with a
learned mask `mask_embedding [H]`, the one tensor the public layout lacks (it names the mask by
`mask_token_id`): formats/dflash.py refuses such a drafter. Gemma-4 layers (`layer_family=gemma4_text`,
heads/dflash_gemma4.py) keep transformers' Gemma-4 names, which vLLM reads for DSpark only (formats/dspark_gemma4.py).
Laguna layers (`layer_family=laguna`, heads/dflash_laguna.py) gate their attention per head, and the drafter norms
each tapped state (`aux_hidden_norms`) and each layer its context input, as vLLM's DFlashLagunaForCausalLM computes
(formats/dflash_laguna.py).

A drafter started from a released one (`released_drafter`, heads/dflash_released.py) keeps that one's layers: its
widths, heads and RoPE, and a sliding window on the layers its `layer_types` mark sliding, where a block query at
position p sees the context keys at positions > p - window (vLLM's non-causal window; `within`), the block whole.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Optional

import torch
from torch import nn

from draftsmith.errors import UserError
from draftsmith.families import layer_family, layer_window, tap_layers
from draftsmith.heads import register
from draftsmith.heads.base import filled_from_target, per_sample_stats
from draftsmith.heads.dflash_config import DFlashConfig
from draftsmith.heads.dflash_gemma4 import FullAttentionRope, Gemma4DFlashLayer
from draftsmith.heads.dflash_laguna import GatedDFlashLayer, is_gated, tap_norms
from draftsmith.heads.dflash_layer import DFlashLayer, add_qk_norm, within
from draftsmith.heads.dflash_proposer import DFlashProposer
from draftsmith.heads.dflash_released import start_from_release
from draftsmith.heads.eagle_base import EagleBase, import_qualified, start_from_norm
from draftsmith.heads.packing import conversation_rand, documents, num_documents, positions, same_document
from draftsmith.heads.vocab_loss import chunk_rows_for, cross_entropy, soft_cross_entropy
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape

# The batch's keys for `host_fields`' counts: the blocks of its fullest row (the loss's width), and of all its rows
ROW_BLOCKS, BLOCKS = "dflash_row_blocks", "dflash_blocks"


def host_field(batch: dict, key: str) -> int:
    """A count `DFlash.host_fields` added to the batch, or a KeyError that says to add it."""
    if key not in batch:
        raise KeyError(
            f"the DFlash loss reads batch[{key!r}], counted on the host before the batch moves to the device: "
            "pass batch | drafter.host_fields(batch) (heads/base.py)"
        )
    return batch[key]


@register
class DFlash(EagleBase):
    """Built like the EAGLE drafters (EagleBase: decoder layers of the target's family, the target's
    embedding and lm_head shared, frozen and not saved), decoded by `DFlashProposer`."""

    type = "dflash"
    TITLE = "DFlash"
    DEPTH_TOP1 = "block{depth}/top1"  # block position k is depth k
    Config = DFlashConfig
    SERVED_BY = {"chain": ("vllm",), "tree": ()}  # vLLM: with drafter.mask_token_id set; DDTree: the eval only
    # At temperature > 0 its chain's block positions are each sampled from their own q = softmax(logits / T), which
    # the ratio test reads: its vLLM export pins draft_sample_method probabilistic (formats/repo.py vllm_pinned).
    SAMPLES_DRAFTS = True

    def __init__(self, config: DFlashConfig, target: TargetShape):
        super().__init__(config, target)
        if not config.target_layers:
            raise filled_from_target("target_layers")
        hidden = target.hidden_size
        layer_cls = import_qualified(config.decoder["layer"])
        self.fc = nn.Linear(len(config.target_layers) * hidden, hidden, bias=False)
        family_layers = [layer_cls(self.layer_config, layer_idx=i) for i in range(config.num_layers)]
        if config.qk_norm:
            for layer in family_layers:
                add_qk_norm(layer, self.layer_config)
        self.hidden_norm = copy.deepcopy(family_layers[0].input_layernorm)  # fresh norms of the family's class
        sandwich = hasattr(family_layers[0], "pre_feedforward_layernorm")  # Gemma-4's (heads/dflash_gemma4.py)
        gated = is_gated(family_layers[0])  # Laguna's (heads/dflash_laguna.py)
        wrapper = Gemma4DFlashLayer if sandwich else GatedDFlashLayer if gated else DFlashLayer
        self.layers = nn.ModuleList(wrapper(layer, self.layer_config) for layer in family_layers)
        # vLLM's Laguna DFlash norms each tapped state before the fc
        self.aux_hidden_norms = tap_norms(family_layers[0], len(config.target_layers), hidden) if gated else None
        # vLLM's Gemma-4 DSpark embeds its block with the target's table times sqrt(hidden)
        self.embed_scale = hidden**0.5 if sandwich else None
        if layer_family(config.layer_family).per_kind:  # its rotary table takes the layer kind
            self.rotary_emb = FullAttentionRope(self.rotary_emb)
        self.norm = copy.deepcopy(family_layers[0].input_layernorm)
        # Each layer's sliding window (None: full attention): a released drafter's layers may have one
        # a query at position p sees the keys at p - window < j < p + window: vLLM's non-causal attention's window
        # ((window - 1, window - 1) in flash-attention's terms)
        self.windows = [layer_window(self.layer_config, i) for i in range(config.num_layers)]
        narrow = [window for window in self.windows if window is not None and window < config.block_size]
        if narrow:
            raise UserError(
                f"draft layers with a sliding window of {min(narrow)} positions cannot see a whole block of "
                f"{config.block_size}: DFlash's block attends to itself whole"
            )
        if config.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.randn(hidden) * 0.02)

    @classmethod
    def from_target(cls, config: DFlashConfig, target_model, name_or_path: str) -> DFlash:
        shape = TargetShape.of(target_model, name_or_path)
        # DFlash's own key: DSpark's config has none (its export would not write the release's layers back)
        if getattr(config, "released_drafter", None) is not None:
            return start_from_release(cls, config, target_model, shape)
        config.check(shape)
        config = cls.for_target(config, shape, target_model.config)
        drafter = super().from_target(config, target_model, name_or_path)
        final_norm = getattr(target_model.get_decoder(), "norm", None)
        with torch.no_grad():
            # The output norm starts as the target's final norm (it feeds the target's lm_head); the
            # mask embedding as the mean token embedding, the neutral point of the input space.
            start_from_norm(drafter.norm, final_norm)
            if config.mask_token_id is None:
                drafter.mask_embedding.copy_(target_model.get_input_embeddings().weight.float().mean(0))
        return drafter

    @classmethod
    def decoder_layers(cls, config) -> int:
        return config.num_layers

    @classmethod
    def for_target(cls, config: DFlashConfig, target: TargetShape, target_config) -> DFlashConfig:
        layers = config.layers_for(target.num_hidden_layers)
        return replace(
            config, target_layers=layers if config.target_layers is not None else tap_layers(target_config, layers)
        )

    @classmethod
    def features(cls, config: DFlashConfig, target: TargetShape) -> FeatureRequest:
        return FeatureRequest(
            final=False, layers=tuple(config.layers_for(target.num_hidden_layers)), logits=config.loss == "soft_ce"
        )

    @classmethod
    def max_chain(cls, config: DFlashConfig) -> int:
        return config.block_size - 1

    def proposer(self, temperature: float = 0.0) -> DFlashProposer:
        return DFlashProposer(self, temperature)

    # -- the draft model ------------------------------------------------------------------------
    def context(self, layers: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's states [..., H] per context layer -> the context feature [..., H]."""
        dtype = self.fc.weight.dtype
        states = [layers[layer].to(dtype) for layer in self.config.target_layers]
        if self.aux_hidden_norms is not None:
            states = [norm(state) for norm, state in zip(self.aux_hidden_norms, states)]
        return self.hidden_norm(self.fc(torch.cat(states, dim=-1)))

    def context_keys(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys/values [B, kv, C, d] of the context [B, C, H] at positions [B, C]."""
        rope = self.rotary_emb(context, positions)
        return [layer.context_keys_values(context, rope) for layer in self.layers]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The block's token inputs: the target's embedding rows (EagleBase's), scaled where the layers' engine
        model scales them (`embed_scale`)."""
        rows = super().embed(tokens)
        return rows if self.embed_scale is None else rows * self.embed_scale

    def mask_input(self) -> torch.Tensor:
        """The mask queries' input [H]: the target's embedding of mask_token_id, or the learned vector."""
        if self.config.mask_token_id is None:
            return self.mask_embedding
        # filled on the device: a tensor copied from the host would make the host wait for the device
        return self.embed(torch.full((1,), self.config.mask_token_id, device=self.fc.weight.device))[0]

    def denoise(
        self,
        anchors: torch.Tensor,
        positions: torch.Tensor,
        context_kv,
        visible: torch.Tensor,
        context_positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Blocks [anchor, mask, ...]: anchor tokens [B, A] at block positions [B, A, S] -> the
        final-norm outputs [B, A, S, H] of every block position (`logits` turns them into tokens).
        `context_positions` [B, C]: the context's positions, which sliding-window layers read (default 0..C-1,
        decoding's)."""
        batch, blocks, size = positions.shape
        dtype = self.fc.weight.dtype
        first = self.embed(anchors).to(dtype)[:, :, None]
        hidden = torch.cat([first, self.mask_input().to(dtype).expand(batch, blocks, size - 1, -1)], dim=2)
        rope = self.rotary_emb(hidden, positions.view(batch, blocks * size))
        if context_positions is None:
            context_positions = torch.arange(visible.shape[-1], device=positions.device)[None]
        for layer, kv, window in zip(self.layers, context_kv, self.windows):
            hidden = layer(
                hidden, rope, kv, visible if window is None else within(visible, positions, context_positions, window)
            )
        return self.norm(hidden)

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        _, lm_head = self.target_modules()
        return lm_head(outputs.to(lm_head.weight.dtype)).float()

    # -- training -------------------------------------------------------------------------------
    def sample_anchors(
        self, loss_mask: torch.Tensor, draws: torch.Tensor, count: int, docs: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to `anchors` random positions a per document (`docs` [B, T], heads/packing.py; default:
        one per row) with x_a and x_{a+1} loss-bearing and in a's document, sorted by position:
        ([B, A] positions, [B, A] whether real; rows with fewer anchors are padded with 0). `draws` [B, T]:
        uniform [0, 1) per position, the highest ones picked (heads/packing.py conversation_rand). `count`:
        A, the blocks of the fullest row, `host_fields`' count (the draw picks which anchors, never how many)."""
        batch_size, length = loss_mask.shape
        docs = torch.arange(batch_size, device=loss_mask.device)[:, None].expand(-1, length) if docs is None else docs
        valid = loss_mask[:, :-1] & loss_mask[:, 1:] & same_document(docs, 1)
        valid = torch.cat([valid, valid.new_zeros(batch_size, 1)], dim=1)
        scores = draws.masked_fill(~valid, -1.0)
        # Each position's rank by score within its document: sort by (document, score descending),
        # then count from the first position of each document's run.
        key = docs.double() * 4 + (1 - scores.double())  # 1 - score lies in (0, 2]
        order = key.argsort(dim=1)
        index = torch.arange(length, device=loss_mask.device).expand(batch_size, -1)
        sorted_docs = docs.gather(1, order)
        run_start = torch.cat(
            [sorted_docs.new_ones(batch_size, 1, dtype=torch.bool), sorted_docs[:, 1:] != sorted_docs[:, :-1]], dim=1
        )
        rank = torch.empty(batch_size, length, dtype=torch.long, device=loss_mask.device).scatter_(
            1, order, index - (index * run_start).cummax(dim=1).values
        )
        picked = valid & (rank < self.config.anchors)
        anchors = index.masked_fill(~picked, length).sort(dim=1).values[:, :count]  # picked positions first, in order
        real = anchors < length
        return anchors.masked_fill(~real, 0), real

    def blocks(
        self,
        input_ids: torch.Tensor,
        layers: dict[int, torch.Tensor],
        anchors: torch.Tensor,
        batch: Optional[dict] = None,
    ) -> torch.Tensor:
        """Teacher-forced blocks: for anchors [B, A] (positions in input_ids [B, T]) the block outputs
        [B, A, S, H], block a reading the context of the target's `layers` [B, T, H] at positions < a,
        exactly what decoding computes after committing x_0..x_a. With a packed `batch` the context
        is also only a's document, and RoPE positions restart per document (heads/packing.py)."""
        batch = {"input_ids": input_ids} if batch is None else batch
        length = input_ids.shape[1]
        docs, context_positions = documents(batch), positions(batch)
        offsets = torch.arange(self.config.block_size, device=input_ids.device)
        block_positions = context_positions.gather(1, anchors)[..., None] + offsets  # [B, A, S]
        before = torch.arange(length, device=input_ids.device)[None, None, :] < anchors[..., None]
        visible = before & (
            docs[:, None, :] == docs.gather(1, anchors)[..., None]
        )  # [B, A, T]: strictly before, same document
        context_kv = self.context_keys(self.context(layers), context_positions)
        return self.denoise(input_ids.gather(1, anchors), block_positions, context_kv, visible, context_positions)

    def row_blocks(self, batch: dict) -> torch.Tensor:
        """[B] long: the blocks each row of `batch` trains, per document in it min(anchors, the positions
        `sample_anchors` draws from): a function of the batch alone (the draw picks which anchors, never how
        many), counted on the host."""
        loss_mask, docs = batch["loss_mask"].bool(), documents(batch)
        valid = loss_mask[:, :-1] & loss_mask[:, 1:] & same_document(docs, 1)
        rows, width = docs.shape[0], num_documents(batch)
        pairs = (torch.arange(rows, device=docs.device)[:, None] * width + docs[:, :-1])[valid]  # (row, document)
        per_document = torch.bincount(pairs, minlength=rows * width).view(rows, width)
        return per_document.clamp(max=self.config.anchors).sum(1)

    def loss_tokens(self, batch: dict) -> torch.Tensor:
        """DFlash trains on blocks, so its normaliser counts blocks, not tokens: exactly the blocks the
        loss samples (`row_blocks`; heads/base.py, "The loss contract"), as `host_fields` counted them."""
        return torch.tensor(host_field(batch, BLOCKS))

    def host_fields(self, batch: dict) -> dict[str, int]:
        """The blocks of the batch's fullest row (at least 1), the width A of the loss's [B, A] blocks
        (heads/base.py `host_fields`). Counted on the host so that no shape of the loss waits for the device,
        and exact, not a static bound (anchors x the documents a packed row holds, or its length), which would
        run many empty blocks. With them the batch's blocks, `loss_tokens`, counted once."""
        blocks = self.row_blocks(batch)
        return {ROW_BLOCKS: max(1, int(blocks.max())), BLOCKS: int(blocks.sum())}

    @staticmethod
    def block_teacher(clamped: torch.Tensor, input_ids: torch.Tensor, target_out: TargetOutput):
        """soft_ce's teacher of the scored positions (by flat index): the target's distribution of each scored token,
        its logits at the position before it (`clamped` - 1, in its row)."""
        rows, length = input_ids.shape
        before = (torch.arange(rows, device=input_ids.device)[:, None, None] * length + clamped - 1).flatten()
        return lambda index: target_out.logits_at(before[index]).float().softmax(-1)

    def vocab_loss(self, features, weight, labels, teacher, row_weight: torch.Tensor):
        """The blocks' vocabulary loss of `features` over `weight` (the target's lm_head, or DSpark's extension of
        it), each scored position weighted by `row_weight`: cross-entropy with `labels`, or soft_ce with `teacher`."""
        chunk_rows = chunk_rows_for(self.loss_chunk_bytes, weight.shape[0])
        if self.config.loss == "soft_ce":
            return soft_cross_entropy(features, weight, teacher, row_weight, chunk_rows)
        return cross_entropy(features, weight, labels.flatten(), row_weight, chunk_rows)

    def loss(self, batch: dict, target_out: TargetOutput):
        """Weighted (soft) cross-entropy over every block position k >= 1 whose token x_{a+k} exists
        and bears loss, summed: sum over blocks and k of w_k·CE, the weights normalised to sum 1 over a
        whole block (w_k = exp(-(k-1)/loss_decay) / sum_j exp(-(j-1)/loss_decay)), with the number of
        blocks as the normaliser (`loss_tokens`). Per complete block that is its weighted mean
        sum w_k·CE / sum w_k, as before; a block cut short by its document's end weighs less. With
        D-PACE (`dpace_weights`) every block's weights sum to 1 over the positions it scores.

        No shape depends on the batch's values: the blocks' width is `host_fields`' count (the batch must
        carry it), and every block position runs, weighted by whether it is scored, through the fused
        vocabulary loss (heads/vocab_loss.py, `loss_chunk_bytes` of logits at a time), so nothing waits for the
        host on an accelerator.

        Metrics: `block{k}/top1`, the argmax at block position k equal to the data's token (the
        target's own greedy text when the data were regenerated by it), teacher-forced on the context
        but not on the earlier block positions (as in decoding: the block is drafted in one pass);
        `accepted`, per anchor the number of leading block positions whose argmax is right, what a
        greedy chain of block_size-1 would accept on this data.
        """
        input_ids = batch["input_ids"]
        size = self.config.block_size
        anchors, real, outputs = self.sampled_blocks(batch, target_out)
        outputs = outputs[:, :, 1:]  # [B, A, S-1, H]: block position k scores x_{a+k}, k = 1..S-1
        clamped, labels, supervised = self.scored(batch, anchors, real, size - 1)

        weight = self.target_modules()[1].weight  # the target's lm_head, frozen
        features = outputs.flatten(0, 2).to(weight.dtype)
        teacher = self.block_teacher(clamped, input_ids, target_out)
        dpace = self.config.loss_weighting == "dpace"
        if dpace:
            # D-PACE's weights come from this very pass's cross-entropies, so the loss is a weighted sum of its
            # per-position losses (differentiable w.r.t. the features; the lm_head is frozen): the pass only
            # marks the scored positions.
            pass_weight = supervised.flatten().float()
        else:
            decay = torch.exp(
                -torch.arange(size - 1, device=input_ids.device, dtype=torch.float32) / self.config.loss_decay
            )
            # a whole block's weights sum to 1: its loss is a weighted mean
            pass_weight = (supervised * (decay / decay.sum())).flatten()
        result = self.vocab_loss(features, weight, labels, teacher, pass_weight)
        token_loss = result.token_loss.view_as(supervised)  # 0 where not supervised
        if dpace:  # the weights: constants of the loss, from the detached confidence (module docstring)
            total = (self.dpace_weights(supervised, token_loss.detach()).flatten() * result.token_loss).sum()
        else:
            total = result.loss  # the trainer divides by the blocks (loss_tokens)

        return total, real.sum(), self.block_stats(result.best, labels, supervised, token_loss, anchors, real, batch)

    def sampled_blocks(self, batch: dict, target_out: TargetOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's anchors [B, A], which are real [B, A], and their blocks' outputs [B, A, S, H]."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        draws = conversation_rand(batch, (), input_ids.device, self.optimizer_step if self.training else None)
        anchors, real = self.sample_anchors(loss_mask, draws, host_field(batch, ROW_BLOCKS), documents(batch))
        return anchors, real, self.blocks(input_ids, target_out.layers, anchors, batch)

    @staticmethod
    def scored(
        batch: dict, anchors: torch.Tensor, real: torch.Tensor, count: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `count` tokens after each anchor that its block scores, x_{a+1} .. x_{a+count}: their positions
        clamped into the row [B, A, count], the data's tokens there, and whether each is scored (a real anchor's, in
        the row, a loss token, in the anchor's document: a packed row holds several)."""
        input_ids, loss_mask, docs = batch["input_ids"], batch["loss_mask"].bool(), documents(batch)
        scored = anchors[..., None] + torch.arange(1, count + 1, device=input_ids.device)
        clamped = scored.clamp(max=input_ids.shape[1] - 1)

        def at_scored(values: torch.Tensor) -> torch.Tensor:
            return values.gather(1, clamped.flatten(1)).view_as(scored)

        same = at_scored(docs) == docs.gather(1, anchors)[..., None]
        supervised = real[..., None] & (scored < input_ids.shape[1]) & at_scored(loss_mask) & same
        return clamped, at_scored(input_ids), supervised

    @torch.no_grad()
    def block_stats(self, best, labels, supervised, token_loss, anchors, real, batch) -> dict[str, torch.Tensor]:
        """The metrics per block position (the k-th drafted token), per anchor and per scored token: `best` the
        argmax per scored position (-1 where not supervised), `token_loss` its cross-entropy [B, A, k]."""
        docs, num_docs = documents(batch), num_documents(batch)
        correct = (best.view_as(supervised) == labels) & supervised
        anchor_docs = docs.gather(1, anchors).clamp(min=0)  # [B, A]: each block's document (padding: never counted)
        stats = {}
        for k in range(supervised.shape[-1]):
            values = {self.DEPTH_TOP1.format(depth=k + 1): correct[..., k].float()}
            stats |= per_sample_stats(values, anchor_docs, num_docs, where=supervised[..., k])
        block_docs = anchor_docs[..., None].expand_as(supervised)
        stats |= per_sample_stats({"token_loss": token_loss.detach()}, block_docs, num_docs, where=supervised)
        accepted = correct.cumprod(-1).sum(-1).float()
        return stats | per_sample_stats({"accepted": accepted}, anchor_docs, num_docs, where=real)

    def dpace_weights(self, supervised: torch.Tensor, token_loss: torch.Tensor) -> torch.Tensor:
        """D-PACE's weights [B, A, S-1] (module docstring) from the supervised positions' cross-entropies
        `token_loss` [B, A, S-1] (detached), 0 off them, each block's summing to 1."""
        alpha = self.config.dpace_alpha
        smoothed = torch.where(supervised, (1 - alpha) * torch.exp(-token_loss.float()) + alpha, 1.0)  # 1: unscored
        reach = smoothed.cumprod(-1) * supervised  # the chance the block's drafts are accepted up to k
        weights = reach.flip(-1).cumsum(-1).flip(-1) * supervised
        return weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
