"""An MTP layer whose block is a stack of the family's decoder layers (vLLM 0.32's NemotronHMTP, read from
vllm/model_executor/models/nemotron_h_mtp.py): one layer per entry of the config's `mtp_layers_block_type`
(transformers' name for the release's `mtp_hybrid_override_pattern`: "*E", attention then experts, by default).

vLLM stores the stack under `mtp.layers.{i}.`, the wrapper's tensors inside its ends: `enorm`, `hnorm` and `eh_proj` in
the first layer (`has_start_projections`), `final_layernorm` in the last (`has_end_norm`). Its forward is the DeepSeek
formula with the stack as the block:

    h = eh_proj(cat(enorm(e(x)), hnorm(f)));  h = h + mixer_i(norm_i(h)) for each layer i;  out = final_layernorm(h)

(each layer's fused residual norm adds the residual before the next norm, and the last adds it before
`final_layernorm`), nothing masked at position 0, `out` fed back and read by the target's lm_head (`has_own_lm_head`
only where the checkpoint ships one). Its attention has no positions (the family's attention layers are NoPE), and
vLLM builds attention ("*") and experts ("E") only: another kind in the stack is refused in one line.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from draftsmith.errors import UserError
from draftsmith.families import FULL, LINEAR

KINDS_KEY = "mtp_layers_block_type"  # the config's list of the stack's layer kinds
LAYERS_KEY = KINDS_KEY.removeprefix("mtp_")  # the decoder's, which the stack's config replaces
# a release's config.json names the kinds by a pattern, one character a layer, as vLLM reads them; absent, transformers'
# default, attention then experts
PATTERN_KEY, DEFAULT_PATTERN = "mtp_hybrid_override_pattern", "*E"
PATTERN = {"*": FULL, "E": "moe", "M": LINEAR, "-": "mlp"}
SERVED_KINDS = (FULL, "moe")  # what vLLM 0.32's NemotronHMultiTokenPredictor builds: "*" and "E"
STARTS, ENDS = ("enorm", "hnorm", "eh_proj"), ("final_layernorm",)  # the wrapper's names, in the first and last layer


def kinds(config: dict) -> list[str]:
    """The stack's layer kinds (a config in dict form), refused in one line where vLLM builds another kind."""
    default = [PATTERN[char] for char in DEFAULT_PATTERN]
    found = list(config.get(KINDS_KEY) or default)
    if found == default and config.get(PATTERN_KEY):  # as transformers' config class reads both
        found = [PATTERN.get(char, char) for char in config[PATTERN_KEY]]
    other = sorted(set(found) - set(SERVED_KINDS))
    if other:
        raise UserError(
            f"drafter.type=mtp: vLLM 0.32 builds the MTP layer's stack of attention and expert layers only; the "
            f"target's {KINDS_KEY} is {found}"
        )
    return found


def stack_config(values: dict) -> dict:
    """The target's config (dict form) for a model of the stack's layers: its decoder's kinds are the stack's."""
    return {**values, LAYERS_KEY: kinds(values)}


def placed(wrapper: dict[str, str], depth: int) -> dict[str, str]:
    """The wrapper's tensor names (drafter's -> checkpoint's, under the layer's prefix) inside the stack's first and
    last layers, as vLLM stores them."""
    where = {name: 0 for name in STARTS} | {name: depth - 1 for name in ENDS}
    return {own: f"layers.{where[theirs.split('.')[0]]}.{theirs}" for own, theirs in wrapper.items()}


class StackedBlock(nn.ModuleList):
    """The stack's decoder layers, run in order on one residual stream (each layer adds its mixer's output); its
    parameters named `{i}.` as a decoder's `layers.{i}.`. An attention layer keeps its keys at its index in the
    drafter's cache, whose layers follow the stack's kinds (an expert layer's holds nothing)."""

    def __init__(self, layer_class, config):
        super().__init__([layer_class(config, layer_idx=i) for i in range(len(getattr(config, LAYERS_KEY)))])

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache=None,
        attention_mask: Optional[torch.Tensor] = None,
        position_embeddings=None,  # none: the stack's attention is NoPE (the drafter's NoPositions)
    ) -> torch.Tensor:
        for layer in self:
            hidden = layer(hidden, cache=cache, attention_mask=attention_mask, position_ids=position_ids)
        return hidden
