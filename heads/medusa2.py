"""Medusa-2: Medusa heads trained jointly with LoRA adapters on the target itself.

The heads read the *adapted* target's last hidden state, so the backbone can move its features
towards what the heads find predictable; the backbone keeps its behaviour through a forward KL to
the original (adapter-free) target's next-token distribution on the training data, which should be
the target's own answers (`python -m data_prep.regenerate`, Medusa's "self-distillation"). The heads'
loss weight ramps up on a sine over the first `heads_warmup` optimizer steps (the trainer's step, so the
weight is the same however a step is split over micro-batches, accumulation and ranks), so the adapters first
see a small heads loss (the Medusa maintainers: train the heads first, then together).

Decoding verifies with the adapted target (`verifier`), so "lossless" means identical to the adapted
target's own greedy output; the eval report says which model verified and how often the adapted
target's plain output still equals the original's.

The adapted target is a copy of the target's module tree that *shares* every frozen weight with the
target (only the LoRA matrices are new memory), built by `attach_target`. The checkpoint holds the
heads (vLLM's Medusa names) and the LoRA weights, never the target's weights; the
adapters are also written in peft's format to `adapter/`, for serving the adapted target. Sharing
weights rules out FSDP and ZeRO-3 (they re-shard parameters): train Medusa-2 with DDP or ZeRO-2.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from pathlib import Path
from typing import Optional

import torch

from draftsmith.heads import register
from draftsmith.heads.base import per_sample_stats
from draftsmith.heads.distill import forward_kl
from draftsmith.heads.lora import ADAPTER_DIR
from draftsmith.heads.medusa import Medusa
from draftsmith.heads.medusa2_config import Medusa2Config
from draftsmith.heads.packing import causal_lm_inputs, documents, num_documents, same_document
from draftsmith.heads.vocab_loss import at_rows, chunk_rows_for, rows_loss
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape

BACKBONE = "backbone."


@register
class Medusa2(Medusa):
    type = "medusa2"
    TITLE = "Medusa-2"

    @classmethod
    def unshardable(cls, config) -> Optional[str]:
        return (
            "it trains LoRA adapters inside the target's layers (trainable weights inside FSDP units are not supported "
            "here)"
        )

    Config = Medusa2Config

    def __init__(self, config: Medusa2Config, target: TargetShape):
        super().__init__(config, target)
        self.backbone: Optional[torch.nn.Module] = None  # the adapted target: see attach_target
        self._register_state_dict_hook(_without_target_weights)
        self.register_load_state_dict_post_hook(_target_weights_not_missing)

    @classmethod
    def from_target(cls, config: Medusa2Config, target_model, name_or_path: str) -> Medusa2:
        drafter = super().from_target(config, target_model, name_or_path)
        drafter.attach_target(target_model)
        return drafter

    def attach_target(self, target_model) -> None:
        """Build the adapted target: a copy of the target's modules whose frozen tensors *are* the
        target's (deepcopy's memo maps each to itself), with peft's LoRA layers injected."""
        shared = {id(t): t for t in itertools.chain(target_model.parameters(), target_model.buffers())}
        backbone = copy.deepcopy(target_model, memo=shared)
        self.backbone = self.config.lora.adapted(backbone, type(target_model).__name__)

    def adapted_target(self) -> torch.nn.Module:
        if self.backbone is None:
            raise RuntimeError(
                "the Medusa-2 drafter has no target: load it with load_drafter(..., target_model=target)"
            )
        return self.backbone.get_base_model()  # the target's own class with LoRA layers inside

    def verifier(self) -> torch.nn.Module:
        """The adapted target verifies: the heads read *its* hidden states."""
        return self.adapted_target()

    @classmethod
    def features(cls, config: Medusa2Config, target: TargetShape) -> FeatureRequest:
        return FeatureRequest(final=False, logits=True)  # the original target's distribution, the backbone's teacher

    def param_groups(self):
        heads = [p for p in itertools.chain(self.blocks.parameters(), self.lm_heads.parameters()) if p.requires_grad]
        adapters = [p for p in self.backbone.parameters() if p.requires_grad]
        return [(heads, self.config.heads_lr_scale), (adapters, 1.0)]

    def heads_weight_now(self) -> float:
        """heads_weight x sin(pi/2 x progress), progress = (optimizer_step + 1) / heads_warmup capped at 1."""
        warmup = self.config.heads_warmup
        progress = 1.0 if warmup == 0 else min(1.0, (self.optimizer_step + 1) / warmup)
        return self.config.heads_weight * math.sin(math.pi / 2 * progress)

    def loss(self, batch: dict, target_out: TargetOutput):
        input_ids = batch["input_ids"]
        # Packed rows need the same forward as the target's (no cache: see causal_lm_inputs).
        out = self.adapted_target()(
            input_ids=input_ids, **causal_lm_inputs(batch), use_cache=False, output_hidden_states=True, return_dict=True
        )
        heads_loss, stats = self.heads_loss(batch, out.hidden_states[-1])

        # The backbone keeps the original target's next-token distribution wherever a token is supervised, its
        # rows in chunks of `loss_chunk_bytes` (heads/vocab_loss.py rows_loss): no float32 copy of the logits at
        # every position, and no shape depends on the data on an accelerator (every position runs there, the
        # others zeroed), so nothing waits for the host.
        docs = documents(batch)
        mask = batch["loss_mask"].bool()[:, 1:] & same_document(docs, 1)
        teacher = target_out.logits[:, :-1]

        def per_row(rows: torch.Tensor, index: torch.Tensor, stats: bool):
            rows, theirs = rows.float(), at_rows(teacher, index).float()
            kl = forward_kl(rows, theirs)
            return kl, {"backbone/kl": kl, "backbone/top1": rows.argmax(-1) == theirs.argmax(-1)} if stats else {}

        student = out.logits[:, :-1]
        kl, values = rows_loss(student, mask, per_row, chunk_rows_for(self.loss_chunk_bytes, student.shape[-1]))
        heads_weight = self.heads_weight_now()
        total = self.config.backbone_loss_weight * kl + heads_weight * heads_loss  # sums (heads/base.py)
        samples = docs[:, :-1].clamp(min=0)  # padding is never scored
        stats.update(per_sample_stats(values, samples, num_documents(batch), where=mask))
        return total, self.loss_tokens(batch), stats

    def save_pretrained(self, directory: str | os.PathLike, state_dict: Optional[dict] = None) -> None:
        super().save_pretrained(directory, state_dict)
        if self.backbone is not None:
            # Given a gathered state dict, peft writes its LoRA entries rather than the local values.
            gathered = (
                None
                if state_dict is None
                else {k.removeprefix(BACKBONE): v for k, v in state_dict.items() if k.startswith(BACKBONE)}
            )
            self.backbone.save_pretrained(Path(directory) / ADAPTER_DIR, state_dict=gathered)


def _without_target_weights(module, state_dict, prefix, local_metadata):
    """Keep the LoRA weights of the backbone and drop the target's own (shared, frozen) weights."""
    for key in list(state_dict):
        if key.startswith(prefix + BACKBONE) and ".lora_" not in key:
            del state_dict[key]
    return state_dict


def _target_weights_not_missing(module, incompatible_keys) -> None:
    """The target's weights are never in a checkpoint: not missing, whether loading is strict or not; the
    micro-batch counter an earlier draftsmith saved for the heads' ramp (now the trainer's step) is not read."""
    missing = incompatible_keys.missing_keys
    missing[:] = [key for key in missing if not (BACKBONE in key and ".lora_" not in key)]
    unexpected = incompatible_keys.unexpected_keys
    unexpected[:] = [key for key in unexpected if key != "forward_calls"]
