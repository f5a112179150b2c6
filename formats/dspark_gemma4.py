"""DSpark's backbone in vLLM 0.32's Gemma-4 layout (`Gemma4DSparkModel`, vllm/model_executor/models/gemma4_dspark.py),
for a drafter trained with Gemma-4 layers (`drafter.layer_family=gemma4_text`, heads/dflash_gemma4.py); the DSpark
keys and heads on top are formats/dspark.py's, shared with the Qwen3 layout.

vLLM builds the folder's class from its `architectures`, whatever the target: this layout is the only one that
carries Gemma-4 layers (a drafter with them is refused for the Qwen3 one by DFlash's family check, and a drafter of
Llama/Qwen3 layers goes to the Qwen3 one whatever its target). What vLLM's Gemma-4 model reads, each as trained:

- the layers' Gemma-4 config (`model_type: gemma4_text`, so transformers gives vLLM its `per_layer_config`): every
  layer `full_attention` with `attention_k_eq_v` (vLLM's fused context projection asserts it on every layer, and
  computes the context's values as v_norm of its k_proj), `head_dim` = `global_head_dim`, plain RoPE under
  `rope_parameters.full_attention`, no `final_logit_softcapping` (vLLM's logits processor would cap the lm_head's
  logits before the Markov bias; draftsmith trains without), no biases;
- `dspark_target_layer_ids` in draftsmith's convention (vLLM adds 1), `dspark_noise_token_id`, `block_size`;
- tensors under transformers' Gemma-4 names (vLLM stacks gate/up itself), each layer's `layer_scalar` included.

embed_tokens and lm_head are not written: vLLM's DSpark loader shares the target's whenever the draft vocabulary is
the target's (`load_dspark_model`; `Gemma4DSparkForCausalLM` never claims its own), as draftsmith trains with them;
vLLM multiplies the embedding by sqrt(hidden), which draftsmith's Gemma-4 layers' drafter does too.
"""

from __future__ import annotations

from typing import Any

from draftsmith.families import FULL
from draftsmith.formats.dflash import backbone_parts
from draftsmith.formats.repo import VLLM_SERVE, EngineRepo, require_layers

ARCHITECTURE = "Gemma4DSparkModel"
FAMILY = "gemma4_text"  # the draft layer family (draftsmith.families) whose layers this layout carries
# the layer config fields vLLM's Gemma4DSparkModel and Gemma4MTPDecoderLayer read (through transformers' config)
CONFIG_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "global_head_dim", "num_global_key_value_heads", "hidden_activation", "rms_norm_eps", "vocab_size",
    "max_position_embeddings", "rope_parameters", "attention_bias", "layer_types", "attention_k_eq_v",
    "final_logit_softcapping", "hidden_size_per_layer_input", "num_kv_shared_layers", "enable_moe_block",
    "use_double_wide_mlp", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def has_gemma4_layers(drafter) -> bool:
    return drafter.config.decoder["config"]["model_type"] == FAMILY


def layer_config(drafter) -> dict[str, Any]:
    """The Gemma-4 layers' config as trained, under vLLM's names; layers vLLM's model would build otherwise (or
    not at all) refused in one line."""
    layers = drafter.config.decoder["config"]
    require_layers(
        (
            ("a layer other than full_attention", set(layers.get("layer_types") or ()) == {FULL}),
            ("values other than the keys (attention_k_eq_v false)", bool(layers.get("attention_k_eq_v"))),
            ("attention biases", not layers.get("attention_bias")),
            ("final_logit_softcapping", layers.get("final_logit_softcapping") is None),
        ),
        f"vLLM's {ARCHITECTURE} builds full-attention Gemma-4 layers whose values are their keys, without biases or "
        "soft-capping",
    )
    config = {key: layers[key] for key in CONFIG_KEYS if key in layers}
    return {**config, "num_hidden_layers": int(layers["num_hidden_layers"]), "torch_dtype": "float32"}


def backbone(drafter) -> EngineRepo:
    """The backbone's folder as formats/dflash.py's `vllm` gives the Qwen3 layout's (its `dflash_config` the keys
    formats/dspark.py renames), with Gemma-4 layers."""
    settings = drafter.config
    layer = layer_config(drafter)
    config, expected, conventions = backbone_parts(layer, settings)
    hidden, head_dim, width = layer["hidden_size"], layer["head_dim"], layer["intermediate_size"]
    heads, kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
    for i in range(settings.num_layers):
        prefix = f"layers.{i}."
        expected |= {f"{prefix}{norm}.weight": (hidden,) for norm in NORMS} | {f"{prefix}layer_scalar": (1,)}
        expected |= {
            f"{prefix}self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{prefix}self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{prefix}self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{prefix}self_attn.q_norm.weight": (head_dim,),
            f"{prefix}self_attn.k_norm.weight": (head_dim,),
            f"{prefix}mlp.gate_proj.weight": (width, hidden),
            f"{prefix}mlp.up_proj.weight": (width, hidden),
            f"{prefix}mlp.down_proj.weight": (hidden, width),
        }
    conventions |= {
        "layers": (
            "Gemma-4 (gemma4_text): sandwich norms, q/k norms and a weightless v norm, values = keys "
            "(attention_k_eq_v), attention scaling 1, GELU-tanh MLP, layer_scalar; non-causal within the block, the "
            "context before it"
        ),
        "shared": (
            "embed_tokens and lm_head are the target's (not in the folder; vLLM shares them), the embedding times "
            "sqrt(hidden_size) as vLLM's Gemma4DSparkModel scales it; no logit soft-capping"
        ),
    }
    return EngineRepo("vllm", config, drafter.state_dict(), expected, VLLM_SERVE, conventions)
