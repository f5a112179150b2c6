"""EAGLE-3: a one-layer draft model over fused low/mid/high target features, trained with EAGLE-3's
training-time test (TTT), with its own lm_head over a pruned draft vocabulary.

Draft position t reads the fused target feature g_t = fc(cat(h^a_t, h^b_t, h^c_t)) of the `aux_layers`
and the embedding of the next token x_{t+1}; one decoder layer whose attention takes both side by
side (2H inputs) gives an output feature o_t, and norm + lm_head turn o_t into a guess of x_{t+2}:

    o_t = layer(cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t)), residual g_t)

Unlike EAGLE-1 there is no feature regression: the next draft step reads o_t itself in place of a
target feature (at decode time that is all there is), and training unrolls that (TTT, see `loss`).

Layer ids: `aux_layers` use draftsmith's convention (draftsmith.target): id i is the *output* of
decoder layer i (transformers' hidden_states[i + 1]), -1 the embeddings. vLLM's
`eagle_aux_hidden_state_layer_ids` (and EAGLE-3's own code) name the layer whose *input* is captured,
so vLLM id = our id + 1. The default is EAGLE-3's and vLLM's [2, L//2, L-3] in their ids, i.e.
[1, L//2 - 1, L - 4] in ours (SGLang's explicit `eagle_aux_hidden_state_layer_ids` use ours). Our id
L-1 is transformers' *normed* last state, which vLLM cannot capture; ids must be increasing because
the engines concatenate the captured states in layer order.

Draft vocabulary: the lm_head has `draft_vocab_size` rows; `prepare` keeps the tokens most frequent as
loss-bearing next tokens of the training data. Buffers (in the checkpoint, as speculators/vLLM/SGLang
read them): `d2t` int64 [draft_vocab], an offset, target id = draft id + d2t[draft id]; `t2d` bool
[target vocab], whether a target token is in the draft vocabulary. With draft_vocab_size equal to the
target's vocabulary there is no pruning and neither buffer exists (as speculators omits them).

Checkpoint names follow the speculators/vLLM Eagle3 layout: `fc.weight [H, n*H]`, `layers.0.{self_attn.
{q,k,v}_proj [.., 2H], self_attn.o_proj, mlp.*, input_layernorm, hidden_norm, post_attention_layernorm}`,
`norm.weight`, `lm_head.weight [draft_vocab, H]`, `d2t`, `t2d` (SGLang: `layers.0.` -> `midlayer.`).
The token embedding is the target's, frozen, not saved (re-attached on load, as the engines share it).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from draftsmith.errors import UserError
from draftsmith.heads import register
from draftsmith.heads.base import DrafterConfig, DraftState, check_layer_ids, per_sample_stats
from draftsmith.heads.eagle import EagleBase, check_tree_settings, import_qualified
from draftsmith.heads.packing import documents, draft_attention_mask, num_documents, positions, same_document
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape

log = logging.getLogger("draftsmith.eagle3")
COVERAGE = "draft_vocab_coverage"  # `learned` key: share of the training data's loss tokens in the draft vocabulary


@dataclass
class Eagle3Config(DrafterConfig):
    type: str = "eagle3"
    # Target layers to fuse, our ids (output of layer i; vLLM id = ours + 1). None: EAGLE-3's default,
    # [1, L//2 - 1, L - 4] (= vLLM's [2, L//2, L-3]), filled in by from_target.
    aux_layers: Optional[list[int]] = None
    draft_vocab_size: int = 32000  # lm_head rows; clipped to the target's vocabulary (= no pruning)
    ttt_steps: int = 7  # training-time test: draft steps unrolled in training
    ttt_decay: float = 0.8  # step i's (0-based) loss weight: ttt_decay**i
    # False: the layer's residual is the fused feature itself, hidden_norm only feeds attention (EAGLE-3's
    # code, speculators' default). True: the residual is hidden_norm(fused). vLLM assumes True when the
    # key is missing, so an export must write it.
    norm_before_residual: bool = False
    tree_depth: int = 5  # dynamic tree (EAGLE-2): draft steps ...
    tree_topk: int = 8  # ... children expanded per node and nodes expanded per step; eval.tree = node budget
    decoder: Optional[dict] = None  # the target family's layer/rotary classes and config; set by from_target

    def check(self, target: Optional[TargetShape] = None) -> None:
        check_tree_settings(self)
        if self.ttt_steps < 1 or self.ttt_decay <= 0:
            raise UserError(f"drafter.ttt_steps must be >= 1 and ttt_decay > 0 (got {self.ttt_steps}, {self.ttt_decay})")
        if self.draft_vocab_size < 1:
            raise UserError(f"drafter.draft_vocab_size={self.draft_vocab_size} must be >= 1")
        if target is not None:
            default = None if self.aux_layers is not None else "EAGLE-3's default aux layers [1, L//2-1, L-4]"
            check_layer_ids(self.layers_for(target.num_hidden_layers), target.num_hidden_layers, "drafter.aux_layers", default, "low/mid/high layers")

    def layers_for(self, num_layers: int) -> list[int]:
        """The aux layers, EAGLE-3's default for a target of `num_layers` layers when unset."""
        return [int(layer) for layer in self.aux_layers] if self.aux_layers is not None else default_aux_layers(num_layers)


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers in our ids: the inputs of layers 2, L//2, L-3 are the outputs of
    layers 1, L//2 - 1, L - 4."""
    return [1, num_layers // 2 - 1, num_layers - 4]


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer, built from one decoder layer of the target's family: its attention
    reads cat(input_layernorm(embedding), hidden_norm(feature)), so q/k/v_proj take 2H inputs; the
    residual stream starts from the feature (see Eagle3Config.norm_before_residual)."""

    def __init__(self, layer: nn.Module, hidden: int, norm_before_residual: bool):
        super().__init__()
        attention = getattr(layer, "self_attn", None)
        projections = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        parts = [getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm", "mlp")]
        if not all(isinstance(p, nn.Linear) for p in projections) or any(p is None for p in parts):
            raise UserError(
                f"EAGLE-3 needs a decoder layer with input_layernorm, self_attn.q/k/v_proj, post_attention_layernorm and mlp; {type(layer).__name__} differs"
            )
        for name, proj in zip(("q_proj", "k_proj", "v_proj"), projections):
            setattr(attention, name, nn.Linear(2 * hidden, proj.out_features, bias=proj.bias is not None))
        self.self_attn = attention
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.hidden_norm = copy.deepcopy(layer.input_layernorm)  # a fresh norm of the family's class
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds, features, rope, positions, mask=None, cache=None, **attention) -> torch.Tensor:
        if self.norm_before_residual:
            features = self.hidden_norm(features)
            residual = features
        else:
            residual = features
            features = self.hidden_norm(features)
        hidden = torch.cat([self.input_layernorm(embeds), features], dim=-1)
        attended, _ = self.self_attn(
            hidden_states=hidden, position_embeddings=rope, attention_mask=mask, past_key_values=cache, position_ids=positions, **attention
        )
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def shifted(x: torch.Tensor, offset: int, length: int, fill=0) -> torch.Tensor:
    """x[:, offset : offset + length], padded with `fill` at the end to `length` columns."""
    part = x[:, offset : offset + length]
    missing = length - part.shape[1]
    if missing <= 0:
        return part
    return torch.cat([part, part.new_full((x.shape[0], missing), fill)], dim=1)


ATTENTION = "eagle3_ttt"


def ttt_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, ttt_width=None, **kwargs):
    """The draft layer's attention: SDPA (decoding, masks given), or with `ttt_width` W the attention
    of a training-time-test step i, whose keys and values come from `StepKeys` as lists of steps
    0..i, [B, kv heads, W, d] each. The query at position t sees step 0's keys at positions <= t
    (causal) and each later step's key at t only (the diagonal): what a draft at depth i+1 sees at
    decode time (the committed sequence, its ancestors, itself). EAGLE-3's trick: the diagonal costs
    W scores per step instead of a [W, (i+1)W] mask. A packed batch gives `attention_mask`, [B, 1, W, W]
    causal within each document (heads/packing.py), in place of the plain causal mask over step 0's
    keys; the diagonal is a position's own, always in its document."""
    if ttt_width is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, width, dim = query.shape
    kv_heads = key[0].shape[1]
    scaling = dim**-0.5 if scaling is None else scaling
    # Grouped-query attention without copying keys: query head h reads kv head h // (heads // kv_heads).
    grouped = query.view(batch, kv_heads, heads // kv_heads, width, dim)
    if attention_mask is None:
        visible = torch.ones(width, width, dtype=torch.bool, device=query.device).tril()
    else:
        visible = attention_mask[:, :, None]  # [B, 1, 1, W, W] against scores [B, kv, group, W, W]
    scores = (grouped @ key[0][:, :, None].transpose(-1, -2)).masked_fill_(~visible, float("-inf"))
    diagonal = [(grouped * k[:, :, None]).sum(-1, keepdim=True) for k in key[1:]]
    weights = (torch.cat([scores, *diagonal], dim=-1) * scaling).softmax(-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    weights = weights.split([width] + [1] * len(diagonal), dim=-1)
    out = weights[0] @ value[0][:, :, None]
    for weight, v in zip(weights[1:], value[1:]):
        out = out + weight * v[:, :, None]
    return out.reshape(batch, heads, width, dim).transpose(1, 2).contiguous(), None


class StepKeys:
    """The training-time test's stand-in for a KV cache: each step's keys and values as a list, which
    the family's attention module hands to `ttt_attention` unchanged (no growing concatenation)."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys.append(keys)
        self.values.append(values)
        return self.keys, self.values


def register_ttt_attention() -> None:
    """Make `ttt_attention` selectable as the draft layer's attn_implementation (idempotent)."""
    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, ttt_attention)


def token_rows(dataset) -> Iterable[tuple]:
    """(input_ids, loss_mask) per conversation: a FeatureStore's light accessor (no features are
    read), else the rows of a tokenized data set."""
    if hasattr(dataset, "token_rows"):
        return dataset.token_rows()
    if hasattr(dataset, "select_columns"):  # a datasets.Dataset: skip the other columns
        dataset = dataset.select_columns(["input_ids", "loss_mask"])
    return ((row["input_ids"], row["loss_mask"]) for row in dataset)


@register
class Eagle3(EagleBase):
    type = "eagle3"
    Config = Eagle3Config

    def __init__(self, config: Eagle3Config, target: TargetShape):
        super().__init__(config, target)
        if not config.aux_layers:
            raise UserError("an eagle3 drafter is built for a target: use from_target (drafter.aux_layers is filled there)")
        if config.draft_vocab_size > target.vocab_size:
            raise UserError(f"drafter.draft_vocab_size={config.draft_vocab_size} exceeds the target's vocabulary of {target.vocab_size}")
        hidden = target.hidden_size
        register_ttt_attention()
        self.layer_config._attn_implementation = ATTENTION  # SDPA, plus the training-time test's attention
        layer = import_qualified(config.decoder["layer"])(self.layer_config, layer_idx=0)
        self.fc = nn.Linear(len(config.aux_layers) * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(layer, hidden, config.norm_before_residual)])
        self.norm = copy.deepcopy(layer.input_layernorm)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.pruned = config.draft_vocab_size < target.vocab_size
        if self.pruned:  # until `prepare` picks the draft vocabulary: the first draft_vocab_size ids
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(target.vocab_size) < config.draft_vocab_size)

    @classmethod
    def decoder_layers(cls, config) -> int:
        return 1

    @classmethod
    def from_target(cls, config: Eagle3Config, target_model, name_or_path: str) -> Eagle3:
        shape = TargetShape.of(target_model, name_or_path)
        config.check(shape)
        config = replace(config, aux_layers=config.layers_for(shape.num_hidden_layers), draft_vocab_size=min(config.draft_vocab_size, shape.vocab_size))
        drafter = super().from_target(config, target_model, name_or_path)
        final_norm = getattr(target_model.get_decoder(), "norm", None)
        with torch.no_grad():
            # The lm_head starts as the target's rows of the draft tokens, read through the target's
            # final norm; the fused feature and layer are new.
            if final_norm is not None and final_norm.state_dict().keys() == drafter.norm.state_dict().keys():
                drafter.norm.load_state_dict(final_norm.state_dict())
        drafter.set_draft_vocab(torch.arange(config.draft_vocab_size))
        return drafter

    @classmethod
    def features(cls, config: Eagle3Config, target: TargetShape) -> FeatureRequest:
        return FeatureRequest(final=False, layers=tuple(config.layers_for(target.num_hidden_layers)), logits=True)

    # -- the draft vocabulary -------------------------------------------------------------------
    def draft_ids(self) -> torch.Tensor:
        """The target id of every draft id, [draft_vocab_size]."""
        ids = torch.arange(self.config.draft_vocab_size, device=self.lm_head.weight.device)
        return ids + self.d2t if self.pruned else ids

    @torch.no_grad()
    def set_draft_vocab(self, kept: torch.Tensor) -> None:
        """Make the draft vocabulary the (sorted, distinct) target ids `kept`; the lm_head's rows
        become the target's rows of those tokens."""
        kept = kept.to(self.lm_head.weight.device)
        if self.pruned:
            self.d2t.copy_(kept - torch.arange(len(kept), device=kept.device))
            self.t2d.zero_()
            self.t2d[kept] = True
        _, target_lm_head = self.target_modules()
        self.lm_head.weight.copy_(target_lm_head.weight[kept.to(target_lm_head.weight.device)])

    @classmethod
    def picks_draft_vocab(cls, config: Eagle3Config, target: Optional[TargetShape]) -> bool:
        return target is None or config.draft_vocab_size < target.vocab_size

    def prepare(self, dataset) -> None:
        """Pick the draft vocabulary: the draft_vocab_size tokens that most often are a loss-bearing
        (assistant) token of the training data (or of data.draft_vocab), ties to the lower id, kept in id order (as EAGLE-3's
        scandata). Deterministic, so every rank picks the same. A no-op without pruning."""
        if not self.pruned:
            return
        counts = torch.zeros(self.target.vocab_size, dtype=torch.long)
        for input_ids, loss_mask in token_rows(dataset):
            ids = torch.as_tensor(input_ids, dtype=torch.long)[torch.as_tensor(loss_mask).bool()]
            counts += torch.bincount(ids, minlength=len(counts))
        order = torch.argsort(-counts, stable=True)  # stable: equal counts stay in id order
        kept = order[: self.config.draft_vocab_size].sort().values
        self.set_draft_vocab(kept)
        total = int(counts.sum())
        if total:
            self.learned[COVERAGE] = float(counts[kept].sum()) / total
        log.info(
            "draft vocabulary: %d of %d tokens, covering %s of %d loss tokens",
            len(kept),
            len(counts),
            f"{self.learned[COVERAGE]:.4f}" if total else "n/a",
            total,
        )

    # -- the draft model ------------------------------------------------------------------------
    def fuse(self, layers: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's aux-layer states [..., H] each -> the fused input feature [..., H]."""
        dtype = self.fc.weight.dtype
        return self.fc(torch.cat([layers[layer].to(dtype) for layer in self.config.aux_layers], dim=-1))

    def draft(self, tokens, features, positions, mask=None, cache=None, **attention) -> torch.Tensor:
        """o = layer(embed(x), g) for input features g (fused target features or earlier outputs);
        see EagleBase.draft. `attention` goes to the attention function (`ttt_width`, see `unroll`)."""
        embed, _ = self.target_modules()
        rope = self.rotary_emb(features, positions)
        return self.layers[0](embed(tokens).to(features.dtype), features, rope, positions, mask, cache, **attention)

    def draft_logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """Output features [..., H] -> logits over the draft vocabulary [..., draft_vocab_size]."""
        return self.lm_head(self.norm(outputs)).float()

    def top_tokens(self, feature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Clamped so that rounding never lets a child outscore its parent (see `grow`).
        best = self.draft_logits(feature).log_softmax(-1).clamp(max=0).topk(k)
        return best.values, self.draft_ids()[best.indices]

    def committed_features(self, state: DraftState) -> Optional[torch.Tensor]:
        missing = [layer for layer in self.config.aux_layers if layer not in state.new_layers]
        if missing:
            raise ValueError(f"eagle3 needs the target's layers {missing} at the newly committed positions (DraftState.new_layers)")
        return self.fuse(state.new_layers)

    # -- training -------------------------------------------------------------------------------
    def unroll(self, input_ids: torch.Tensor, layers: dict[int, torch.Tensor], batch: Optional[dict] = None) -> list[torch.Tensor]:
        """Training-time test: the output features [B, T-2, H] of draft steps 0..ttt_steps-1.

        Alignment, with x_t = input_ids[:, t] and h_t the target's states at t (what it reads to
        predict x_{t+1}): at step 0, draft position t reads (x_{t+1}, fuse(h_t)), exactly the cache
        entry t of decoding, and its output guesses x_{t+2}. Step i > 0 at position t reads
        (x_{t+1+i}, step i-1's output at t) at RoPE position t+i and guesses x_{t+2+i}: it is the
        draft at depth i+1 after committing x_0..x_{t+1}, with the earlier drafts teacher-forced to
        the data. Its attention sees step 0's keys at positions <= t (the committed entries) and steps
        1..i's keys at t (its ancestors and itself), the decode-time tree mask (`ttt_attention`). Positions past the
        sequence's end read a pad token; the loss masks them out.

        `batch` (optional, the training batch) makes it packing-aware: RoPE positions restart per
        document and step 0's keys are seen only within a document. A position near a document's
        end reads the next document's tokens at later steps, exactly as one near a row's end reads
        padding: it is never scored (`loss`), and only its own later steps read it.
        """
        width = input_ids.shape[1] - 2
        features = self.fuse(layers)[:, :width]
        batch = {"input_ids": input_ids} if batch is None else batch
        start, mask = positions(batch)[:, :width], draft_attention_mask(batch, width)
        cache = StepKeys()  # step i's attention reads the keys of steps 0..i
        outputs = []
        for step in range(self.config.ttt_steps):
            tokens = shifted(input_ids, 1 + step, width)
            features = self.draft(tokens, features, start + step, mask, cache=cache, ttt_width=width)
            outputs.append(features)
        return outputs

    def loss(self, batch: dict, target_out: TargetOutput):
        """Soft cross-entropy to the target's distribution, summed over the TTT steps with weights
        ttt_decay**i (see `unroll` for the alignment).

        Step i at position t is scored against the target's distribution of x_{t+2+i} (its logits at
        t+1+i) where x_{t+2+i} bears loss (loss_mask[:, t+2+i]). The target's distribution is
        restricted to the draft vocabulary and renormalised there (EAGLE-3's softmax(logits[t2d])),
        and positions whose target argmax lies outside the draft vocabulary are left out of the loss
        (EAGLE-3's position mask: no draft token can be accepted there at T=0). Each step's loss is
        the mean over the positions it scores.

        Metrics: `step{i+1}/top1`, the draft's argmax (in target ids) equal to the target's argmax at
        every supervised position, an out-of-vocabulary argmax counting as a miss; teacher-forced,
        i.e. acceptance at depth i+1 given depths 1..i were the data's tokens. `step{i+1}/loss` per
        step, and `vocab_coverage` (share of supervised positions whose target argmax is in the draft
        vocabulary: the ceiling of step1/top1) when the vocabulary is pruned.
        """
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        length = input_ids.shape[1]
        docs, num_docs = documents(batch), num_documents(batch)
        outputs = self.unroll(input_ids, target_out.layers, batch)
        draft_ids = self.draft_ids()
        with torch.no_grad():  # the target's side, once for all steps: [B, T] argmax, [B, T, draft vocab] distribution
            logits = target_out.logits
            target_best = logits.argmax(-1)
            in_vocab = self.t2d[target_best] if self.pruned else torch.ones_like(target_best, dtype=torch.bool)
            p_all = (logits[..., draft_ids] if self.pruned else logits).float().softmax(-1)
            # Zero where the argmax is out of the vocabulary (and a captured top-k row may be all -inf there).
            p_all = p_all.masked_fill(~in_vocab[..., None], 0.0).flatten(0, 1)  # rows b * T + t
            target_best, in_vocab = target_best.flatten(), in_vocab.flatten()
        total = torch.zeros((), device=input_ids.device)
        stats: dict[str, torch.Tensor] = {}
        for step, output in enumerate(outputs):
            # x_{t+2+step} must bear loss and be in t's document (packed rows hold several).
            supervised = shifted(loss_mask, 2 + step, length - 2, fill=False) & same_document(docs, 2 + step, length - 2)
            rows, cols = supervised.nonzero(as_tuple=True)
            samples = docs[rows, cols]
            scored = rows * length + cols + 1 + step  # the target's distribution of x_{t+2+step}
            log_q = self.draft_logits(output[rows, cols]).log_softmax(-1)
            token_loss = -(p_all.index_select(0, scored) * log_q).sum(-1)  # 0 outside the draft vocabulary
            counted = in_vocab[scored]
            total = total + self.config.ttt_decay**step * token_loss.sum() / counted.sum().clamp(min=1)
            with torch.no_grad():
                top1 = (draft_ids[log_q.argmax(-1)] == target_best[scored]).float()
                stats |= per_sample_stats({f"step{step + 1}/top1": top1}, samples, num_docs)
                stats |= per_sample_stats({f"step{step + 1}/loss": token_loss[counted].detach()}, samples[counted], num_docs)
                if step == 0 and self.pruned:
                    stats |= per_sample_stats({"vocab_coverage": counted.float()}, samples, num_docs)
        return total, stats
