"""A separate small causal LM as the drafter (classic speculative decoding), sharing the target's
tokenizer and vocabulary, trained by distillation on the target's next-token distributions.

Built either from an existing checkpoint (`name_or_path`, same vocab as the target) or from the
target itself (`init: layers`): the target's config with `num_layers` decoder layers, holding a copy
of the target's embedding, its first `num_layers` decoder layers, final norm and lm_head, so the
fresh drafter is the target's early-exit model.

Training: full fine-tuning, or LoRA adapters (`lora`) on a frozen copy. Checkpoints are always a
plain model: with LoRA, `save_pretrained` writes the *merged* weights (plus the adapter alone in
`adapter/`, peft's format), and `load_drafter` rebuilds the plain architecture from the HF config
stored in the drafter section (`model_config`). Weight names are the HF model's under a `model.`
prefix (strip it for an HF checkpoint).

PARD (`parallel_drafting`, as vLLM serves it: `method: draft_model` with `parallel_drafting: true` and
`pard_token` in the draft's config.json): one draft forward proposes the whole chain. After the
committed tokens the draft reads `parallel_tokens - 1` copies of `mask_token_id` (a token of the
target's vocabulary) at the following positions; the last committed token's logits give draft 1 and
mask j's give draft j + 1. Training puts, after the real tokens of each row, `parallel_tokens - 1`
groups of mask tokens, one per anchor t: group k's mask for anchor t sits at position t + k, sees the
real tokens up to t and anchor t's masks of groups 1..k (a 4-D attention mask), and learns the target's
distribution for token t + k + 1; group 0 (the real tokens) trains as the plain draft model does.

Decoding (`DraftModelProposer`, heads/draft_model_proposer.py): the draft model runs autoregressively
with its own KV cache, which survives across calls and is cropped to the longest common prefix with the
committed tokens. At temperature 0 it proposes the argmax (`probs=None`); at T > 0 (the eval's sampling
temperature) it samples each token from q = softmax(logits / T) with its own generator and returns q as
`probs`, which the exact acceptance rule min(1, p/q) needs.
"""

from __future__ import annotations

import copy
import os
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from draftsmith.causal_lm import may_be_a_causal_lm, no_causal_lm, register_misfiled_causal_lms
from draftsmith.errors import UserError
from draftsmith.families import ATTENTION_KINDS, COMPRESSED, layer_types
from draftsmith.heads import register
from draftsmith.heads.base import Drafter, per_sample_stats
from draftsmith.heads.distill import KINDS, distill_loss, divergences, loss_terms
from draftsmith.heads.draft_model_config import DraftModelConfig
from draftsmith.heads.draft_model_proposer import DraftModelProposer
from draftsmith.heads.lora import ADAPTER_DIR
from draftsmith.heads.packing import (
    causal_document_mask,
    causal_lm_inputs,
    documents,
    is_packed,
    num_documents,
    require_packed_attention,
    same_document,
)
from draftsmith.heads.vocab_loss import at_rows, chunk_rows_for, rows_loss
from draftsmith.model_files import TRANSFORMERS_LAYERS, read_pretrained
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape
from draftsmith.vllm_window import serve_window


@register
class DraftModel(Drafter):
    type = "draft_model"
    TITLE = "Draft model"

    @classmethod
    def unshardable(cls, config) -> Optional[str]:
        if config.name_or_path is None:
            return (
                "it copies the target's first decoder layers, of which each rank holds only pieces; set "
                "drafter.name_or_path to a separate draft model"
            )
        return None

    Config = DraftModelConfig  # max_chain stays None: an autoregressive draft proposes chains of any length
    SERVED_BY = {"chain": ("vllm", "sglang")}  # SGLang: STANDALONE, sequential drafting only (not PARD)
    # At temperature > 0 its proposer samples each draft from q = softmax(logits / T) and the ratio test reads q:
    # its vLLM export pins draft_sample_method probabilistic, vLLM's same rule (formats/repo.py vllm_pinned).
    SAMPLES_DRAFTS = True

    def __init__(self, config: DraftModelConfig, target: TargetShape, model=None):
        super().__init__(config, target)
        if model is None:  # load_drafter: rebuild the plain architecture, the weights come next
            if config.model_config is None:
                raise UserError(
                    "draft_model checkpoint has no drafter.model_config; was it written by save_pretrained?"
                )
            from transformers import AutoConfig, AutoModelForCausalLM

            settings = dict(config.model_config)
            register_misfiled_causal_lms()
            built = AutoConfig.for_model(settings.pop("model_type"), **settings)
            serve_window(built)
            model = AutoModelForCausalLM.from_config(built, dtype=torch.float32)
        self.model = model
        self.packing_checked = False  # see loss

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, config: DraftModelConfig, target_model, name_or_path: str) -> DraftModel:
        shape = TargetShape.of(target_model, name_or_path)
        model = load_draft(config.name_or_path, shape) if config.name_or_path else layers_of(target_model, config)
        model.config.use_cache = True
        config = replace(config, model_config=model.config.to_dict())
        if config.lora is not None:
            model = config.lora.adapted(model, f"the draft model ({type(model).__name__})")
        return cls(config, shape, model)

    @classmethod
    def proposes_trees(cls, config: DraftModelConfig) -> bool:
        return False  # its proposer drafts one chain (PARD's in one forward): eval.tree refused by the recipe check

    @classmethod
    def max_chain(cls, config: DraftModelConfig) -> Optional[int]:
        return config.parallel_tokens if config.parallel_drafting else None  # deeper masks were never trained

    # -- training -------------------------------------------------------------------------------
    @classmethod
    def features(cls, config: DraftModelConfig, target: TargetShape) -> FeatureRequest:
        return FeatureRequest(final=False, logits=True)

    def loss(self, batch: dict, target_out: TargetOutput):
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        docs = documents(batch)
        depths = self.config.parallel_tokens if self.config.parallel_drafting else 1
        if depths > 1:
            inputs = parallel_inputs(self.model, batch, depths, self.config.mask_token_id)
            logits = self.model(**inputs, use_cache=False).logits
        else:
            if is_packed(batch) and not self.packing_checked:  # a draft of another family may not honour packing
                require_packed_attention(self.model, "the draft model")
                self.packing_checked = True
            logits = self.model(input_ids=input_ids, **causal_lm_inputs(batch), use_cache=False).logits
        length = input_ids.shape[1]
        chunk_rows = chunk_rows_for(self.loss_chunk_bytes, logits.shape[-1])
        loss, stats = 0.0, {}
        for depth in range(depths):
            # Depth 0: the real token at t predicts token t + 1. Depth k: anchor t's mask at position t + k
            # predicts token t + k + 1, which the target scores at t + k. Supervised where that token is an
            # assistant token of anchor t's document (packed rows hold several).
            shift = depth + 1
            if shift >= length:
                break
            mask = loss_mask[:, shift:] & same_document(docs, shift)
            teacher, labels = target_out.logits[:, depth:-1], input_ids[:, shift:]

            def per_row(rows, index, stats, teacher=teacher, labels=labels):
                return self.distill_rows(rows, at_rows(teacher, index), at_rows(labels, index), stats)

            # The rows run in chunks of `loss_chunk_bytes` (heads/vocab_loss.py rows_loss): no float32 copy of the
            # logits at every position, and no shape depends on the data on an accelerator (every position
            # runs there, the unscored ones zeroed), so nothing waits for the host. A sum over tokens
            # (heads/base.py, "The loss contract").
            student = logits[:, depth * length : (depth + 1) * length - shift]
            depth_loss, values = rows_loss(student, mask, per_row, chunk_rows)
            loss = loss + depth_loss
            stats |= per_sample_stats(
                {f"step{shift}/{name}": value for name, value in values.items()},
                docs[:, :-shift].clamp(min=0),  # padding is never scored
                num_documents(batch),
                where=mask,
            )
        return loss, self.loss_tokens(batch), stats

    def distill_rows(
        self, student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, stats: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each row's loss of the draft's logits `student` against the target's `teacher` ([n, V] each) and the
        data's tokens `labels` [n], and, when `stats`, every divergence, the cross-entropy, top1 and accept."""
        config = self.config
        student, teacher = student.float(), teacher.float()
        names = KINDS if stats else loss_terms(config.loss, config.mix_weights)
        terms = divergences(student, teacher, config.temperature, names)
        per_token = distill_loss(terms, config.loss, config.mix_weights)
        if config.ce_weight > 0:
            terms["ce"] = F.cross_entropy(student, labels, reduction="none")
            per_token = per_token + config.ce_weight * terms["ce"]
        if not stats:
            return per_token, {}
        terms["top1"] = student.argmax(-1) == teacher.argmax(-1)
        terms["accept"] = 1.0 - terms["tvd"]  # speculative sampling's acceptance at this temperature
        return per_token, terms

    def proposer(self, temperature: float = 0.0) -> DraftModelProposer:
        return DraftModelProposer(self, temperature)

    # -- files ----------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike, state_dict: Optional[dict] = None) -> None:
        """A plain model either way; with LoRA the adapters are merged into a copy (the training
        module keeps its adapters) and also written alone to `adapter/`."""
        from peft import PeftModel

        if isinstance(self.model, PeftModel):
            adapted = copy.deepcopy(self.model)
            if state_dict is not None:  # gathered from shards: the training module's own names
                adapted.float()  # DeepSpeed's float32 weights, not rounded again to its module's bfloat16
                adapted.load_state_dict({name.removeprefix("model."): value for name, value in state_dict.items()})
            adapted.save_pretrained(Path(directory) / ADAPTER_DIR)
            state_dict = {f"model.{name}": value for name, value in adapted.merge_and_unload().state_dict().items()}
        super().save_pretrained(directory, untied(self.state_dict() if state_dict is None else state_dict))


def parallel_inputs(model, batch: dict, depths: int, mask_token_id: int) -> dict[str, torch.Tensor]:
    """The forward's inputs in PARD training (module docstring): each row's T real tokens, then
    `depths - 1` groups of T mask tokens (group k's t-th at position t + k, for anchor t), with the
    4-D mask that lets group k's mask for anchor t see the real tokens up to t in its document and
    anchor t's masks of groups 1..k."""
    implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if implementation.startswith("flash"):
        raise UserError(
            f"drafter.parallel_drafting trains with a 4-D attention mask, which {implementation} cannot take: "
            "load the draft with sdpa or eager attention"
        )
    input_ids = batch["input_ids"]
    rows, length = input_ids.shape
    device = input_ids.device
    positions = (
        batch["position_ids"] if is_packed(batch) else torch.arange(length, device=device)[None].expand(rows, -1)
    )
    real = causal_document_mask(documents(batch))[:, 0]  # [B, T, T]
    own = torch.eye(length, dtype=torch.bool, device=device).expand(rows, -1, -1)
    allowed = torch.zeros(rows, depths * length, depths * length, dtype=torch.bool, device=device)
    for depth in range(depths):
        group = slice(depth * length, (depth + 1) * length)
        allowed[:, group, :length] = real
        for earlier in range(1, depth + 1):
            allowed[:, group, earlier * length : (earlier + 1) * length] = own
    mask = allowed[:, None]
    if implementation == "eager":  # eager attention adds the mask to the scores
        mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return {
        "input_ids": torch.cat([input_ids, input_ids.new_full((rows, (depths - 1) * length), mask_token_id)], dim=1),
        "position_ids": torch.cat([positions + depth for depth in range(depths)], dim=1),
        "attention_mask": mask,
    }


def untied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory: a tied lm_head is stored as its own copy (the
    model ties it again when the checkpoint is loaded)."""
    seen: set[int] = set()
    result = {}
    for name, tensor in state_dict.items():
        result[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    return result


def load_draft(name_or_path: str, target: TargetShape):
    """An existing HF causal LM as the draft; it must score the target's vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    register_misfiled_causal_lms()
    # the Hub handling (cache alone while out of reach, one line) and safetensors alone, as for the target
    refused = f"cannot load draft model {name_or_path!r}"
    built = read_pretrained(AutoConfig.from_pretrained, name_or_path, refused)
    serve_window(built)
    model = read_pretrained(
        AutoModelForCausalLM.from_pretrained, name_or_path, refused, config=built, dtype=torch.float32,
        use_safetensors=True, **TRANSFORMERS_LAYERS,
    )  # fmt: skip
    vocab = int(model.get_output_embeddings().weight.shape[0])
    if vocab != target.vocab_size:
        raise UserError(
            f"draft model {name_or_path!r} has vocab_size {vocab} but the target {target.name_or_path!r} has "
            f"{target.vocab_size}; a draft model must share the target's tokenizer"
        )
    return model


def layers_of(target_model, config: DraftModelConfig):
    """The target's first `num_layers` decoder layers with its embedding, final norm and lm_head,
    as a standalone float32 model of the target's architecture."""
    from transformers import AutoModelForCausalLM

    config.check(TargetShape.from_config(target_model.config, ""))
    draft_config = first_layers_config(target_model.config, config.num_layers)
    target_kinds = layer_types(target_model.config)
    wanted_kinds = target_kinds[: config.num_layers]
    kinds = layer_types(draft_config)
    if kinds != wanted_kinds:
        # the class changes the kinds it is given (Gemma-4 makes its last layer full attention): such a draft would
        # not compute the target's layers; the next layer count whose kinds the class keeps is the advice
        kept = next(
            (n for n in range(config.num_layers + 1, len(target_kinds) + 1)
             if layer_types(first_layers_config(target_model.config, n)) == target_kinds[:n]),
            None,
        )  # fmt: skip
        raise UserError(
            f"transformers' {type(draft_config).__name__} turns a draft of the target's first {config.num_layers} "
            f"layers ({wanted_kinds}) into {kinds}, which would not compute the target's layers: "
            + (f"set drafter.num_layers={kept}" if kept else "set drafter.name_or_path")
        )
    counting = {*ATTENTION_KINDS, *COMPRESSED}
    if not set(kinds) & counting:
        # transformers' cache measures its length on a layer of keys; a model of recurrent layers only has none
        first = next((i for i, kind in enumerate(target_kinds) if kind in counting), None)
        raise UserError(
            f"a draft of the target's first {config.num_layers} layers has no attention layer ({kinds}), which "
            + (
                f"transformers cannot decode with a cache: set drafter.num_layers={first + 1} or drafter.name_or_path"
                if first is not None
                else "transformers cannot decode with a cache: set drafter.name_or_path"
            )
        )
    if not may_be_a_causal_lm(draft_config.model_type):  # a wrapper's language model
        raise UserError(
            f"a draft of the target's first {config.num_layers} layers is a causal LM of its language model, and "
            f"{no_causal_lm(draft_config.model_type)}: set drafter.name_or_path"
        )
    register_misfiled_causal_lms()
    model = AutoModelForCausalLM.from_config(draft_config, dtype=torch.float32)
    wanted = model.state_dict()
    # Decoder layers 0..N-1 have the same names in both models; layers >= N exist only in the target.
    copied = {name: tensor for name, tensor in target_model.state_dict().items() if name in wanted}
    missing = sorted(set(wanted) - set(copied))
    if missing:
        raise UserError(
            f"cannot build the draft from {type(target_model).__name__}: no target weights for {missing[:3]}"
        )
    layers = (target_model.config.num_hidden_layers, config.num_layers)
    model.load_state_dict({name: first_layers_of(name, t, wanted[name].shape, *layers) for name, t in copied.items()})
    return model


def first_layers_config(target_config, num_layers: int):
    """The target's config for a model of its first `num_layers` layers, built by the config's class (as a
    saved draft is rebuilt when it loads): the first entries of every per-layer list (`layer_types`, the MLP kinds)
    and per-layer overrides of global sizes (`per_layer_config`, Gemma-4's wider heads on some layers)."""
    values = target_config.to_dict()
    # every per-layer list (a value per layer: layer_types, DeepSeek-V3.2's mlp_layer_types, ...): its first entries
    per_layer = [key for key, value in values.items() if isinstance(value, list) and not key.endswith("token_id")
                 and len(value) == target_config.num_hidden_layers]  # fmt: skip
    # (the attribute: a class deriving the count, Nemotron-H's from its pattern, leaves it out of its dict)
    values.update({key: values[key][:num_layers] for key in per_layer}, num_hidden_layers=num_layers)
    if values.get("per_layer_config"):
        kept = {layer: sizes for layer, sizes in values["per_layer_config"].items() if int(layer) < num_layers}
        values["per_layer_config"] = kept or None
    config = type(target_config).from_dict(values)
    serve_window(config)
    return config


def first_layers_of(name: str, tensor: torch.Tensor, shape: torch.Size, layers: int, kept: int) -> torch.Tensor:
    """A target tensor as a model of its first `kept` of `layers` layers holds it: a dimension that is
    layers x k in the target and kept x k in the draft stacks one slice per layer, layer 0 first (Gemma-4's
    per-layer input embeddings and their projection), and keeps its first kept x k entries; another
    difference is one line."""
    for dim, (theirs, ours) in enumerate(zip(tensor.shape, shape)):
        if theirs != ours and theirs % layers == 0 and ours == kept * (theirs // layers):
            tensor = tensor.narrow(dim, 0, ours)
    if tensor.shape != shape:
        raise UserError(
            f"cannot build a draft of the target's first {kept} layers: {name} is {tuple(tensor.shape)} in the "
            f"target, {tuple(shape)} in a model of {kept} layers; set drafter.name_or_path"
        )
    return tensor
