"""DFlash in vLLM 0.32's Laguna layout (`DFlashLagunaForCausalLM`, vllm/model_executor/models/laguna_dflash.py), for
a drafter trained with Laguna layers (`drafter.layer_family=laguna`, heads/dflash_laguna.py); formats/dflash.py
writes every other DFlash drafter in the Qwen3 layout (`DFlashDraftModel`).

vLLM builds the folder's class from its `architectures`; what its Laguna DFlash model reads, each as trained:

- the layers' Laguna config (`model_type: laguna`): every layer `full_attention` (vLLM requires one kind for all,
  and runs sliding layers causally), `mlp_layer_types` all dense, `gating: true` (a softplus gate per head), no
  biases, RoPE under `rope_parameters.full_attention` with `partial_rotary_factor: 1.0` (every dimension rotated,
  as trained), `draft_vocab_size` = the target's vocabulary (vLLM requires it: it shares the lm_head);
- `dflash_config.target_layer_ids` in draftsmith's convention (vLLM adds 1) and `mask_token_id`, `block_size`;
- tensors under vLLM's own parameter names (its loader maps none): q/k/v fused into `self_attn.qkv_proj.weight`
  ([q; k; v] rows), gate/up/down separate, `aux_hidden_norms.{j}.weight` (each tapped state's RMSNorm before `fc`).

embed_tokens and lm_head are not written: the model never claims its own (`has_own_embed_tokens`/`has_own_lm_head`
false), so vLLM shares the target's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from draftsmith.families import FULL
from draftsmith.formats.repo import VLLM_SERVE, EngineRepo, require_layers

ARCHITECTURE = "DFlashLagunaForCausalLM"
FAMILY = "laguna"  # the draft layer family (draftsmith.families) whose layers this layout carries
# the layer config fields vLLM's Laguna DFlash model and LagunaDecoderLayer read (through transformers' config)
CONFIG_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_parameters", "attention_bias",
    "layer_types", "mlp_layer_types", "gating", "num_experts", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip
PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # fused in this order into vLLM's qkv_proj


def has_laguna_layers(drafter) -> bool:
    return drafter.config.decoder["config"]["model_type"] == FAMILY


def layer_config(drafter) -> dict[str, Any]:
    """The Laguna layers' config as trained, under vLLM's names; layers vLLM's model would build otherwise refused in
    one line."""
    layers = drafter.config.decoder["config"]
    heads = layers["num_attention_heads"]
    require_layers(
        (
            ("a layer other than full_attention", set(layers.get("layer_types") or ()) == {FULL}),
            ("a sparse (mixture-of-experts) MLP", set(layers.get("mlp_layer_types") or ()) == {"dense"}),
            ("attention biases", not layers.get("attention_bias")),
            ("a per-layer head count", set(layers.get("num_attention_heads_per_layer") or [heads]) == {heads}),
        ),
        f"vLLM's {ARCHITECTURE} is written for full-attention Laguna layers with dense MLPs, no biases and one "
        "head count",
    )
    config = {key: layers[key] for key in CONFIG_KEYS if key in layers}
    config["rope_parameters"] = {FULL: {**layers["rope_parameters"][FULL], "partial_rotary_factor": 1.0}}
    return {**config, "num_hidden_layers": int(layers["num_hidden_layers"]), "torch_dtype": "float32"}


def fused(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The drafter's tensors under vLLM's names: each layer's q/k/v stacked into `qkv_proj`."""
    out = dict(state)
    for i in range(num_layers):
        prefix = f"layers.{i}.self_attn."
        out[prefix + "qkv_proj.weight"] = torch.cat([out.pop(f"{prefix}{name}.weight") for name in PROJECTIONS])
    return out


def unfused(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`fused` undone for the folder's `config`: the drafter's own tensor names."""
    out = dict(tensors)
    head_dim = config["head_dim"]
    sizes = [config["num_attention_heads"] * head_dim] + [config["num_key_value_heads"] * head_dim] * 2
    for i in range(int(config["num_hidden_layers"])):
        prefix = f"layers.{i}.self_attn."
        parts = out.pop(prefix + "qkv_proj.weight").split(sizes)
        out |= {f"{prefix}{name}.weight": part for name, part in zip(PROJECTIONS, parts)}
    return out


def context_input_norms_limit(drafter) -> Optional[str]:
    """Why vLLM's CPU build cannot serve this drafter, or None: its Laguna DFlash model norms the context by every
    layer's input_layernorm in one `ops.rms_norm` call over the stacked weights ([L, H]; laguna_dflash.py
    `_project_context_kv`), whose CPU kernel reads the first layer's row for all of them (as for the stacked k_norm
    weights: formats/dflash.py `context_key_norms_limit`; measured on 0.32.0: tests/test_dflash_laguna.py)."""
    weights = [layer.input_layernorm.weight for layer in drafter.layers]
    if all(torch.equal(weights[0], weight) for weight in weights[1:]):
        return None
    return (
        "its kernel norms every Laguna DFlash draft layer's context with the first layer's input_layernorm weight, "
        "and this drafter's layers' weights differ (it would draft from another context than it trained on; vLLM's "
        "source reads each layer's)"
    )


def layout(drafter, config: dict[str, Any], expected: dict[str, tuple], conventions: dict[str, Any]):
    """The vLLM folder for the backbone's `config`, `expected` tensors and `conventions`
    (formats/dflash.py `backbone_parts` of `layer_config`), with the Laguna layers and the tapped states' norms."""
    settings, layer = drafter.config, layer_config(drafter)
    hidden, head_dim, width = layer["hidden_size"], layer["head_dim"], layer["intermediate_size"]
    heads, kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
    config |= {"architectures": [ARCHITECTURE], "draft_vocab_size": drafter.target.vocab_size}
    expected |= {f"aux_hidden_norms.{j}.weight": (hidden,) for j in range(len(settings.target_layers))}
    for i in range(settings.num_layers):
        prefix = f"layers.{i}."
        gate = heads if drafter.layers[i].self_attn.gate_per_head else heads * head_dim
        expected |= {
            f"{prefix}input_layernorm.weight": (hidden,),
            f"{prefix}post_attention_layernorm.weight": (hidden,),
            f"{prefix}self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * head_dim, hidden),
            f"{prefix}self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{prefix}self_attn.g_proj.weight": (gate, hidden),
            f"{prefix}self_attn.q_norm.weight": (head_dim,),
            f"{prefix}self_attn.k_norm.weight": (head_dim,),
            f"{prefix}mlp.gate_proj.weight": (width, hidden),
            f"{prefix}mlp.up_proj.weight": (width, hidden),
            f"{prefix}mlp.down_proj.weight": (hidden, width),
        }
    conventions |= {
        "block": f"vLLM runs 1 + num_speculative_tokens queries; trained on block_size {settings.block_size}",
        "most_num_speculative_tokens": settings.block_size - 1,
        "layers": (
            "Laguna: q/k norms, a softplus gate per head on the attention's output, dense SiLU MLP, RoPE over every "
            "dimension; non-causal within the block, the context before it, normed by each layer's input_layernorm"
        ),
        "context": "each tapped state normed by aux_hidden_norms.{j}, then fc and hidden_norm",
        "tensors": "q/k/v fused into self_attn.qkv_proj ([q; k; v] rows)",
        "shared": "embed_tokens and lm_head are the target's (not in the folder; vLLM shares them)",
    }
    return EngineRepo(
        "vllm", config, fused(drafter.state_dict(), settings.num_layers), expected, VLLM_SERVE, conventions,
        cpu_build_limit=context_input_norms_limit(drafter),
    )  # fmt: skip
