"""EAGLE-3: a one-layer draft model over fused low/mid/high target features, trained with EAGLE-3's
training-time test (TTT), with its own lm_head over a pruned draft vocabulary.

Draft position t reads the fused target feature g_t = fc(cat(h^a_t, h^b_t, h^c_t)) of the `aux_layers`
and the embedding of the next token x_{t+1}; one decoder layer whose attention takes both side by
side (2H inputs) gives an output feature o_t, and norm + lm_head turn o_t into a guess of x_{t+2}:

    o_t = layer(cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t)), residual g_t)

Unlike EAGLE-1 there is no feature regression: the next draft step reads o_t itself in place of a
target feature (at decode time that is all there is), and training unrolls that (TTT, see `loss`,
heads/eagle3_training.py).

EAGLE-3.1 (`fc_norm`, `norm_output`, as vLLM reads them): g_t = fc(cat(n_a(h^a_t), n_b(h^b_t), n_c(h^c_t)))
with one RMSNorm per aux layer (`fc_norm.{i}`, vLLM's names), and the feature
passed on is o'_t = norm(o_t), read by the lm_head as it is. `norm_before_fc` (speculators' default,
vLLM's `input_norm`): one RMSNorm over the concatenated states, g_t = fc(n(cat(h^a_t, h^b_t, h^c_t))),
in place of fc_norm (speculators refuses the two together).

A sliding window (`sliding_window`, speculators' default draft layer): a query at position p attends
to the keys at positions > p - window only, in training and decoding alike, as vLLM's draft layer
does (the window moves with the draft's own position at every depth).

P-EAGLE (`parallel_drafting`, as vLLM serves it with `parallel_drafting: true`): one draft forward
proposes the whole chain. The first query is the usual (x_{t+1}, g_t); the k-th of the γ-1 after it
reads the embedding of `mask_token_id` (a token of the target's vocabulary) and the fused learned
`mask_hidden` (the aux layers' states side by side, [n_aux * H], through fc_norm and fc like a
captured state), at position t+k, attending to the committed entries and the mask queries before it.
Training is the training-time test with those inputs at every step after the first, so the chain is at
most `ttt_steps` long: a deeper mask query was never trained (`max_chain`).

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
from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn

from draftsmith.errors import UserError
from draftsmith.families import tap_layers
from draftsmith.heads import register
from draftsmith.heads.base import FlopProfile, filled_from_target
from draftsmith.heads.eagle3_config import Eagle3Config
from draftsmith.heads.eagle3_training import Eagle3Training
from draftsmith.heads.eagle_base import EagleBase, EagleProposer, import_qualified, start_from_norm
from draftsmith.heads.proposer import DraftState, DraftTree, Proposer, Tree
from draftsmith.heads.ttt_attention import ATTENTION, register_ttt_attention
from draftsmith.target import FeatureRequest, TargetShape

log = logging.getLogger("draftsmith.eagle3")
COVERAGE = "draft_vocab_coverage"  # `learned` key: share of the training data's loss tokens in the draft vocabulary


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer, built from one decoder layer of the draft's layer family: its attention
    reads cat(input_layernorm(embedding), hidden_norm(feature)), so q/k/v_proj take 2H inputs; the
    residual stream starts from the feature (see Eagle3Config.norm_before_residual)."""

    def __init__(self, layer: nn.Module, hidden: int, norm_before_residual: bool):
        super().__init__()
        attention = getattr(layer, "self_attn", None)
        projections = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        parts = [getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm", "mlp")]
        if not all(isinstance(p, nn.Linear) for p in projections) or any(p is None for p in parts):
            raise UserError(
                "EAGLE-3 needs a decoder layer with input_layernorm, self_attn.q/k/v_proj, post_attention_layernorm "
                f"and mlp; {type(layer).__name__} differs"
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
            hidden_states=hidden,
            position_embeddings=rope,
            attention_mask=mask,
            cache=cache,
            position_ids=positions,
            **attention,
        )
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def loss_token_counts(dataset, vocab_size: int) -> torch.Tensor:
    """How often each token id is a loss-bearing token of `dataset`, [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in token_rows(dataset):
        ids = torch.as_tensor(input_ids, dtype=torch.long)[torch.as_tensor(loss_mask).bool()]
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def token_rows(dataset) -> Iterable[tuple]:
    """(input_ids, loss_mask) per conversation: a FeatureStore's light accessor (no features are
    read), else the rows of a tokenized data set."""
    if hasattr(dataset, "token_rows"):
        return dataset.token_rows()
    if hasattr(dataset, "select_columns"):  # a datasets.Dataset: skip the other columns
        dataset = dataset.select_columns(["input_ids", "loss_mask"])
    return ((row["input_ids"], row["loss_mask"]) for row in dataset)


@register
class Eagle3(Eagle3Training, EagleBase):
    type = "eagle3"
    TITLE = "EAGLE-3"
    Config = Eagle3Config
    COMPILED_BLOCKS = "layers"  # the draft layer, once per training-time-test step

    def __init__(self, config: Eagle3Config, target: TargetShape):
        super().__init__(config, target)
        if not config.aux_layers:
            raise filled_from_target("aux_layers")
        if config.draft_vocab_size > target.vocab_size:
            raise UserError(
                f"drafter.draft_vocab_size={config.draft_vocab_size} exceeds the target's vocabulary "
                f"of {target.vocab_size}"
            )
        hidden = target.hidden_size
        register_ttt_attention()
        self.layer_config._attn_implementation = ATTENTION  # SDPA, plus the training-time test's attention
        layer = import_qualified(config.decoder["layer"])(self.layer_config, layer_idx=0)
        self.fc = nn.Linear(len(config.aux_layers) * hidden, hidden, bias=False)
        if config.norm_before_fc:  # a fresh norm of the family's class over all taps side by side
            self.input_norm = type(layer.input_layernorm)(
                len(config.aux_layers) * hidden, eps=self.layer_config.rms_norm_eps
            )
        if config.fc_norm:  # fresh norms of the family's class (weight 1)
            self.fc_norm = nn.ModuleList([copy.deepcopy(layer.input_layernorm) for _ in config.aux_layers])
        self.layers = nn.ModuleList([Eagle3Layer(layer, hidden, config.norm_before_residual)])
        if config.parallel_drafting:  # unit scale: through fc_norm it is a normalised state from the start
            self.mask_hidden = nn.Parameter(torch.randn(len(config.aux_layers) * hidden))
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
        config = replace(
            cls.for_target(config, shape, target_model.config),
            draft_vocab_size=min(config.draft_vocab_size, shape.vocab_size),
        )
        drafter = super().from_target(config, target_model, name_or_path)
        final_norm = getattr(target_model.get_decoder(), "norm", None)
        with torch.no_grad():
            # The lm_head starts as the target's rows of the draft tokens, read through the target's
            # final norm; the fused feature and layer are new.
            start_from_norm(drafter.norm, final_norm)
        drafter.set_draft_vocab(torch.arange(config.draft_vocab_size))
        return drafter

    @classmethod
    def for_target(cls, config: Eagle3Config, target: TargetShape, target_config) -> Eagle3Config:
        layers = config.layers_for(target.num_hidden_layers)
        return replace(
            config, aux_layers=layers if config.aux_layers is not None else tap_layers(target_config, layers)
        )

    @classmethod
    def proposes_trees(cls, config: Eagle3Config) -> bool:
        return not config.parallel_drafting  # one forward proposes one chain

    @classmethod
    def learned_card_lines(cls, learned: dict[str, Any]) -> list[str]:
        if COVERAGE not in learned:  # a drafter whose vocabulary was not pruned
            return []
        return [f"- draft vocabulary covers {learned[COVERAGE]:.1%} of the training data's assistant tokens"]

    @classmethod
    def max_chain(cls, config: Eagle3Config) -> Optional[int]:
        # P-EAGLE's chain position k is training-time-test step k (its mask query at offset k): the steps past
        # ttt_steps were never trained. A sequential chain feeds each step its own output, at any depth.
        return config.ttt_steps if config.parallel_drafting else None

    @classmethod
    def features(cls, config: Eagle3Config, target: TargetShape) -> FeatureRequest:
        return FeatureRequest(final=False, layers=tuple(config.layers_for(target.num_hidden_layers)), logits=True)

    @classmethod
    def flop_profile(cls, config: Eagle3Config) -> FlopProfile:
        # fc fuses the target's states once per token; the training-time test runs the layer and the
        # lm_head once a step at every position (the step is fixed-shape: `unroll`), so this is exact
        return FlopProfile(passes=config.ttt_steps, once=("fc.",))

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

    def prepare(self, dataset, vocab_from=None) -> None:
        """Pick the draft vocabulary: the draft_vocab_size tokens that most often are a loss-bearing
        (assistant) token of the training data `dataset` (or of `vocab_from`, data.draft_vocab), ties to the
        lower id, kept in id order (as EAGLE-3's scandata). Deterministic, so every rank picks the same. Its
        coverage is counted on the training data either way: what the drafter is trained and measured on.
        A no-op without pruning."""
        if not self.pruned:
            return
        counts = loss_token_counts(dataset, self.target.vocab_size)
        picked_on = counts if vocab_from is None else loss_token_counts(vocab_from, self.target.vocab_size)
        order = torch.argsort(-picked_on, stable=True)  # stable: equal counts stay in id order
        kept = order[: self.config.draft_vocab_size].sort().values
        self.set_draft_vocab(kept)
        total = int(counts.sum())
        if total:
            self.learned[COVERAGE] = float(counts[kept].sum()) / total
        log.info(
            "draft vocabulary: %d of %d tokens, picked on %s, covering %s of the training data's %d loss tokens",
            len(kept),
            len(counts),
            "the training data" if vocab_from is None else f"data.draft_vocab's {int(picked_on.sum())} loss tokens",
            f"{self.learned[COVERAGE]:.4f}" if total else "n/a",
            total,
        )

    # -- the draft model ------------------------------------------------------------------------
    def fuse(self, layers: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's aux-layer states [..., H] each -> the fused input feature [..., H]."""
        dtype = self.fc.weight.dtype
        states = [layers[layer].to(dtype) for layer in self.config.aux_layers]
        if self.config.norm_before_fc:
            return self.fc(self.input_norm(torch.cat(states, dim=-1)))
        if self.config.fc_norm:
            states = [norm(state) for norm, state in zip(self.fc_norm, states)]
        return self.fc(torch.cat(states, dim=-1))

    def mask_inputs(self, count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """P-EAGLE's masked queries: `count` mask tokens [count] and their feature, mask_hidden fused
        like a captured state [count, H] (vLLM: combine_hidden_states(mask_hidden))."""
        chunks = self.mask_hidden.chunk(len(self.config.aux_layers))
        feature = self.fuse(dict(zip(self.config.aux_layers, chunks)))
        tokens = torch.full((count,), self.config.mask_token_id, dtype=torch.long, device=device)
        return tokens, feature.expand(count, -1)

    def attention_window(self) -> Optional[int]:
        return self.config.sliding_window

    def draft(self, tokens, features, positions, mask=None, cache=None, rope=None, **attention) -> torch.Tensor:
        """o = layer(embed(x), g) for input features g (fused target features or earlier outputs);
        see EagleBase.draft. `rope`: RoPE's (cos, sin) at `positions` where the caller has them (`unroll`
        computes every step's at once). `attention` goes to the attention function (a later training-time-test
        step's `ttt_step`: heads/ttt_attention.py's `ttt_attention`, see `unroll`)."""
        rope = self.rotary_emb(features, positions) if rope is None else rope
        out = self.layers[0](self.embed(tokens).to(features.dtype), features, rope, positions, mask, cache, **attention)
        return self.norm(out) if self.config.norm_output else out

    def draft_logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """Output features [..., H] -> logits over the draft vocabulary [..., draft_vocab_size]
        (with norm_output the features are already normed)."""
        return self.lm_head(self.lm_input(outputs)).float()

    def lm_input(self, outputs: torch.Tensor) -> torch.Tensor:
        """What the lm_head reads of output features: norm(o), or o itself with norm_output (already normed)."""
        return outputs if self.config.norm_output else self.norm(outputs)

    def top_tokens(self, feature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Clamped so that rounding never lets a child outscore its parent (see `grow`).
        best = self.draft_logits(feature).log_softmax(-1).clamp(max=0).topk(k)
        return best.values, self.draft_ids()[best.indices]

    def committed_features(self, state: DraftState) -> Optional[torch.Tensor]:
        missing = [layer for layer in self.config.aux_layers if layer not in state.new_layers]
        if missing:
            raise ValueError(
                f"eagle3 needs the target's layers {missing} at the newly committed positions (DraftState.new_layers)"
            )
        return self.fuse(state.new_layers)

    def proposer(self, temperature: float = 0.0) -> EagleProposer:
        return ParallelProposer(self) if self.config.parallel_drafting else EagleProposer(self)


class ParallelProposer(EagleProposer):
    """P-EAGLE decoding: the committed entries and γ-1 masked queries in one draft forward, whose
    last γ outputs give the chain (greedy). The masked entries sit past the root in the cache and
    are cropped by the next catch-up like any draft entry. Chains only: the engines serve no
    parallel tree."""

    default_tree = Proposer.default_tree  # chains only: refused before decoding starts

    @torch.no_grad()
    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        if tree is not None:
            raise UserError(
                "a parallel-drafting eagle3 drafter proposes chains only (one forward per chain); set eval.tree=0"
            )
        tokens, features = self.drafter.mask_inputs(num_tokens - 1, state.tokens.device)
        outputs = self.catch_up(state, tokens, features)
        return DraftTree.chain(self.drafter.top_tokens(outputs, 1)[1][:, 0])
