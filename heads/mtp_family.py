"""An MTP block that vLLM 0.32 builds as another family's decoder layer than the target's (`Layout.block_family`):
LongCat-Flash's (vLLM's LongCatFlashMTP builds a DeepSeek-V2 decoder layer) and ERNIE-4.5's (ErnieMTP, a Llama one).

vLLM builds that layer on the target's own config, reading each field the layer needs by name. So here the family's
config class (transformers' auto mapping of its model type) takes every field of its own that the target's config has,
read by name on the target's config object (its aliases resolved: LongCat-Flash's `ffn_hidden_size` read as
`intermediate_size`, as vLLM reads it), then the layout's overrides (`Layout.block_fields`: the dense MLP vLLM asks
for); the family's layer and rotary classes are those of a one-layer model of that config, built without weights.
Where transformers' layer, built alone, computes otherwise than vLLM's, the block is set as vLLM's: every norm at the
config's epsilon (`with_config_eps`), LongCat-Flash's MLA LoRA norms scaled (`with_scaled_norms`). Beside: a config's
decoder layer count where its family derives it from another field (`decoder_layers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from draftsmith.heads.mtp_layer import Layout


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def block_spec(target_config, layout: Layout) -> dict:
    """The drafter's decoder spec entries (heads/mtp.py's `unloaded`) for the block family's layer: its config (dict
    form), the config, layer and rotary classes, and the norms vLLM scales (`norm_scales`)."""
    values = block_config(target_config, layout)
    classes = (family_config_class(layout.block_family), *block_classes(values, layout))
    return dict(zip(("config_class", "layer", "rotary"), map(qualified, classes))) | {
        "config": values,
        "norm_scales": norm_scales(target_config, layout),
    }


def decoder_layers(config: dict) -> int:
    """The decoder's layer count of a config (dict form) as its family's config class reads it: `num_hidden_layers`,
    or what the class derives it from (LongCat-Flash's `num_layers`, each layer two sublayers)."""
    if "num_hidden_layers" in config:
        return int(config["num_hidden_layers"])
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    # a config.json's infinite floats as transformers writes them (`{"__float__": "Infinity"}`: Nemotron-H's
    # time_step_limit), read back as its own loading reads them
    values = PreTrainedConfig._decode_special_floats(config)
    return int(CONFIG_MAPPING[config["model_type"]].from_dict(values).num_hidden_layers)


def family_config_class(family: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[family]


def block_config(target_config, layout: Layout) -> dict:
    """The block family's config (dict form) for the one layer vLLM builds, from the target's config object."""
    from transformers import PreTrainedConfig

    text = getattr(target_config, "text_config", None) or target_config
    generic = set(PreTrainedConfig().to_dict())
    own = set(family_config_class(layout.block_family)().to_dict()) - generic
    values = {name: getattr(text, name) for name in sorted(own) if hasattr(text, name)}
    return values | {"num_hidden_layers": 1} | dict(layout.block_fields)


def block_classes(values: dict, layout: Layout) -> tuple[type, type]:
    """The family's decoder layer and rotary embedding classes: those of a one-layer causal LM of `values`, built on
    the meta device (no weights, whatever the target's size)."""
    from transformers import AutoModelForCausalLM

    no_tokens = {"vocab_size": 1, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    config = family_config_class(layout.block_family).from_dict({**values, **no_tokens})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    decoder = model.get_decoder()
    return type(decoder.layers[0]), type(decoder.rotary_emb)


def with_config_eps(layer: nn.Module, eps: float) -> nn.Module:
    """The layer with every norm at the config's epsilon, as vLLM builds each (DeepSeek-V2's MLA LoRA norms among
    them, which transformers' layer builds at its class default 1e-6), in place."""
    for module in layer.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = eps
    return layer


def norm_scales(target_config, layout: Layout) -> dict[str, float]:
    """Block module -> the factor vLLM multiplies its release weight by as it loads it (`Layout.scaled_norms`:
    LongCat-Flash's MLA LoRA norms, sqrt(hidden_size / rank) where the config's flag is set)."""
    text = getattr(target_config, "text_config", None) or target_config
    return {
        name: (text.hidden_size / getattr(text, rank)) ** 0.5
        for name, flag, rank in layout.scaled_norms
        if getattr(text, flag, False)
    }


def with_scaled_norms(layer: nn.Module, scales: dict[str, float]) -> nn.Module:
    """The layer with each norm in `scales` scaling its output as vLLM's scaled weight does, in place: the weight
    stays the release's, so it reads back and exports bit for bit."""
    for name, factor in scales.items():
        layer.get_submodule(name).register_forward_hook(lambda module, inputs, out, factor=factor: out * factor)
    return layer
