"""DFlash for vLLM (`DFlashDraftModel`, vllm/model_executor/models/qwen3_dflash.py).

vLLM builds Qwen3 decoder layers with non-causal attention over [context keys/values ; the block]:
the context is `hidden_norm(fc(cat(target layers)))` at every position before the block's first token,
projected by each layer's k_proj (then k_norm, RoPE) and v_proj; the block's queries are the bonus
token and then `num_speculative_tokens` copies of `dflash_config.mask_token_id`, embedded with the
target's embedding; the target's lm_head reads `norm` of the output. That is draftsmith's DFlash with
these conventions, each checked here and recorded in draftsmith_export.json:

- The mask is a token: a drafter trained with a learned mask vector (drafter.mask_token_id null) has
  no place in the layout (safetensors weights, `mask_token_id` naming a row of the target's embedding)
  and is refused.
- q_norm/k_norm are in every vLLM layer: a drafter of a family without them trained with
  drafter.qk_norm=false is refused (an RMSNorm cannot be switched off by its weights).
- Layer ids: `dflash_config.target_layer_ids` are draftsmith's ids (output of layer i); vLLM adds 1
  itself. Our last id (transformers' post-norm state) has no vLLM counterpart and is refused.
- The block: vLLM runs 1 + γ queries for num_speculative_tokens γ, and so does draftsmith's chain of γ;
  γ = block_size - 1 is the block the drafter was trained on (recorded as the recommended γ).
- Embedding and lm_head are the target's (not in the folder; vLLM shares them). Targets with
  attention or MLP biases are refused: their placement in vLLM's layer has not been checked.
- A drafter started from a released one (`drafter.released_drafter`, heads/dflash_released.py) keeps that one's
  layers: their own widths and RoPE, and sliding windows where its `layer_types` say so (written with
  `use_sliding_window` and `dflash_config.causal: false`, vLLM's non-causal window); one started from the encoder
  layout is written back in it (the released config, its settings at the top and under `dflash_config`, `encoder.fc`
  and `encoder.output_norm_enc`), which vLLM 0.32 maps to this same DFlash model.
- A drafter of Laguna layers (`drafter.layer_family=laguna`) goes to vLLM's `DFlashLagunaForCausalLM` instead
  (formats/dflash_laguna.py), which builds Laguna layers.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any, Optional

import torch

from draftsmith.errors import UserError
from draftsmith.formats import Exporter, Source, dflash_laguna, register
from draftsmith.formats.eagle import llama_layers_expected
from draftsmith.formats.repo import (
    VLLM_SERVE,
    EngineRepo,
    TargetInfo,
    check_draft_layer,
    draft_layer_config,
    require_vllm_state_capture,
)
from draftsmith.formats.versions import CPU_BUILD
from draftsmith.heads import drafter_class
from draftsmith.heads.dflash_released import ENCODER_NAMES, FAMILIES, LAYOUT, encoder_layout, released_names


def backbone_parts(layer: dict[str, Any], settings) -> tuple[dict[str, Any], dict[str, tuple], dict[str, Any]]:
    """What every layout of vLLM's DFlash backbone shares (its Qwen3 DFlash and DSpark, its Gemma-4 DSpark), for the
    draft layers' config `layer` and the drafter's `settings`: the config's block and `dflash_config`, the fc's and
    norms' tensors, the tap and mask conventions."""
    ours = list(settings.target_layers)
    hidden = layer["hidden_size"]
    config = {
        **layer,
        "tie_word_embeddings": False,  # no lm_head of its own: vLLM shares the target's
        "block_size": settings.block_size,
        "dflash_config": {"mask_token_id": settings.mask_token_id, "target_layer_ids": ours},
    }
    expected = {"fc.weight": (hidden, len(ours) * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    conventions = {
        "target_layer_ids": {
            "draftsmith": ours,
            "vllm_capture": [i + 1 for i in ours],
            "rule": "written as draftsmith's ids; vLLM adds 1",
        },
        "mask": f"token {settings.mask_token_id}, embedded with the target's embedding (as trained)",
    }
    return config, expected, conventions


def context_key_norms_limit(drafter) -> Optional[str]:
    """Why vLLM's CPU build cannot serve this drafter, or None: its DFlash model norms the context's keys of every
    draft layer in one `ops.rms_norm` call over the layers' stacked k_norm weights (qwen3_dflash.py
    `_normalize_context_k`), whose CPU kernel reads the first layer's row for all of them (measured on 0.32.0:
    tests/test_dflash_cpu_build.py), so layers whose k_norm weights differ would attend to other keys than trained."""
    weights = [layer.self_attn.k_norm.weight for layer in drafter.layers]
    if all(torch.equal(weights[0], weight) for weight in weights[1:]):
        return None
    return (
        "its kernel norms every DFlash draft layer's context keys with the first layer's k_norm weight, and this "
        "drafter's layers' k_norm weights differ (it would draft from other keys than it trained on; vLLM's source "
        "says its GPU kernel reads each layer's)"
    )


def mixed_kinds_limit(drafter) -> Optional[str]:
    """Why vLLM's CPU build cannot build this drafter, or None: its DFlash builds draft layers of mixed sliding and
    full attention only in its model runner V2 (qwen3_dflash.py `_resolve_layer_attention`), which needs Triton's GPU
    backend: the CPU build runs V1 (measured on 0.32.0: building such layers raises "DFlash drafters with mixed
    sliding/full attention require the V2 model runner")."""
    windows = set(drafter.windows)
    if None in windows and len(windows) > 1:
        return (
            "it builds DFlash draft layers of mixed sliding and full attention only in its model runner V2, which "
            "needs Triton's GPU backend"
        )
    return None


def window_config(drafter) -> dict[str, Any]:
    """The draft layers' sliding windows as vLLM's DFlash reads them (qwen3_dflash.py `_resolve_layer_attention`:
    `layer_types`, the window where `use_sliding_window` keeps it, non-causal by `dflash_config.causal`); nothing
    where every layer attends to every key."""
    if all(window is None for window in drafter.windows):
        return {}
    layers = drafter.config.decoder["config"]
    return {
        "layer_types": layers["layer_types"],
        "sliding_window": layers["sliding_window"],
        "use_sliding_window": True,
    }


def encoder_layout_config(released: dict[str, Any], config: dict[str, Any], settings) -> dict[str, Any]:
    """The encoder layout's config.json (heads/dflash_released.py) for the vLLM `config` of the same drafter: the
    released folder's, with the drafter's layers and settings at the top, and under `dflash_config` too, with
    `causal: false`: vLLM 0.32's model runner V1 (its CPU build's) reads the context layers there only
    (gpu_model_runner.py), and would capture others for a folder that names them at the top alone (measured)."""
    written = {key: value for key, value in released.items() if key not in ("torch_dtype", "transformers_version")}
    written |= {key: value for key, value in config.items() if key != "torch_dtype"}
    return written | {
        "architectures": released.get("architectures") or config["architectures"],
        "model_type": released.get("model_type", config["model_type"]),
        "target_layer_ids": list(settings.target_layers),
        "mask_token_id": settings.mask_token_id,
        "dflash_config": config["dflash_config"] | {"causal": False},
        "dtype": "float32",
    }


def check_block_layers(folder: Path, config: dict[str, Any], drafter) -> None:
    """A block-parallel drafter's folder (DFlash's, DSpark's) builds in vLLM the layers draftsmith reads it as: its
    draft layer config (`check_draft_layer`: the layers attend within the block both ways, `is_causal` false), and
    what vLLM's qwen3_dflash.py reads besides: no causal or sliding attention, sink bias or value scale in
    `dflash_config`, the target's hidden states and vocabulary."""
    check_draft_layer(folder, config, drafter.config.decoder["config"], {"is_causal": False})
    options = config.get("dflash_config") or {}
    target = drafter.target
    unread = [
        f"dflash_config.{key}={json.dumps(options[key])}"
        for key, neutral in (("causal", False), ("use_swa", False), ("attention_sink_bias", False),
                             ("attention_value_scale", None), ("use_aux_hidden_state", True))
        if options.get(key, neutral) != neutral
    ] + [
        f"{key}={config[key]} (the target's: {value})"
        for key, value in (("target_hidden_size", target.hidden_size), ("draft_vocab_size", target.vocab_size))
        if config.get(key) not in (None, value)
    ]  # fmt: skip
    if unread:
        raise UserError(
            f"{folder}: vLLM would build its layers otherwise than draftsmith reads them: {', '.join(unread)}"
        )


@register
class DFlashExporter(Exporter):
    kinds = ("dflash",)
    vllm_method = "dflash"
    vllm_shares_embedding = CPU_BUILD  # V1's proposer shares it; GPU builds' V2 loader takes a bare decoder as it is
    sglang_reason = "draftsmith's DFlash export has been checked against vLLM's loader only; export it for vllm"

    def refuse(self, engine: str, drafter, target: TargetInfo, vllm_format: str) -> None:
        super().refuse(engine, drafter, target, vllm_format)  # SGLang: refused there
        kind = drafter.TITLE  # DFlash, or DSpark on DFlash's backbone (formats/dspark.py)
        require_vllm_state_capture(target, kind)
        self.layer_config(drafter)
        if drafter.config.mask_token_id is None:
            raise UserError(
                f"this {kind} drafter learned its own mask vector, which vLLM's {kind} layout has no place for (it "
                "embeds the mask token id with the target's embedding); retrain with drafter.mask_token_id=<a token id>"
            )
        attention = drafter.layers[0].self_attn
        if getattr(attention, "q_norm", None) is None or getattr(attention, "k_norm", None) is None:
            raise UserError(
                f"this {kind} drafter has no q_norm/k_norm, which every vLLM {kind} layer applies; retrain with "
                "drafter.qk_norm=true"
            )
        last = target.shape.num_hidden_layers - 1
        if max(drafter.config.target_layers) >= last:
            raise UserError(
                f"target layer {max(drafter.config.target_layers)} is the target's post-norm last state, which vLLM "
                f"cannot capture; retrain with target_layers below {last}"
            )

    def layer_config(self, drafter) -> dict[str, Any]:
        """The draft layers' config under vLLM's names; layers of a family vLLM's layout does not build refused."""
        # vLLM builds Laguna layers for DFlash only: a DSpark of them is refused by its config's check (ENGINE_MODELS),
        # at the recipe and as its checkpoint loads
        if dflash_laguna.has_laguna_layers(drafter):
            return dflash_laguna.layer_config(drafter)
        return draft_layer_config(drafter, FAMILIES, "vLLM", drafter.TITLE)

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        drafter = source.drafter
        settings = drafter.config
        layer = self.layer_config(drafter)
        config, expected, conventions = backbone_parts(layer, settings)
        if layer["model_type"] == dflash_laguna.FAMILY:
            repo = dflash_laguna.layout(drafter, config, expected, conventions)
            repo.cpu_build_limit = context_key_norms_limit(drafter) or repo.cpu_build_limit
            return repo
        windows = window_config(drafter)
        config |= {"architectures": ["DFlashDraftModel"], "model_type": "qwen3"} | windows
        if windows:  # vLLM's DFlash runs a sliding layer causally unless told (`_dflash_layer_causal`)
            config["dflash_config"]["causal"] = False
        head_dim = layer["head_dim"]
        expected |= llama_layers_expected(layer, skip_first_input_norm=False)
        for i in range(settings.num_layers):
            expected |= {
                f"layers.{i}.self_attn.q_norm.weight": (head_dim,),
                f"layers.{i}.self_attn.k_norm.weight": (head_dim,),
            }
        conventions |= {
            "block": f"vLLM runs 1 + num_speculative_tokens queries; trained on block_size {settings.block_size}",
            "most_num_speculative_tokens": settings.block_size - 1,
            "attention": "non-causal within the block, the context before it; q_norm/k_norm in every layer",
            "shared": "embed_tokens and lm_head are the target's (not in the folder)",
        }
        state = drafter.state_dict()
        released = settings.decoder.get(LAYOUT)
        if released is not None:
            config = encoder_layout_config(released, config, settings)
            state, expected = released_names(state), released_names(expected)
            names = ", ".join(f"{theirs} (vLLM's {ours})" for theirs, ours in ENCODER_NAMES.items())
            conventions["layout"] = f"the released encoder layout: settings at the config's top, {names}"
        return EngineRepo(
            "vllm", config, state, expected, VLLM_SERVE, conventions,
            cpu_build_limit=context_key_norms_limit(drafter) or mixed_kinds_limit(drafter),
        )  # fmt: skip

    def recognises(self, config: dict[str, Any], names: Collection[str]) -> bool:
        layouts = {"DFlashDraftModel", dflash_laguna.ARCHITECTURE}
        vllms = "dflash_config" in config and bool(layouts & set(config.get("architectures", [])))
        return vllms or encoder_layout(config, names)

    def read(
        self, folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], target_model, info: dict[str, Any]
    ):
        dflash = drafter_class("dflash")
        recorded = {
            key: value
            for key, value in info.get("drafter_config", {}).items()
            if key in ("tree_topk", "anchors", "loss", "loss_decay")
        }
        laguna = dflash_laguna.ARCHITECTURE in config.get("architectures", [])
        if not laguna and (encoder_layout(config, tensors) or config.get("layer_types")):  # the folder's own layers
            drafter = dflash.from_target(
                dflash.Config(released_drafter=str(folder), **recorded), target_model, info.get("verifier", "target")
            )
            drafter.learned = dict(info.get("learned") or {})
            return drafter
        options = config["dflash_config"]
        block_size = config.get("block_size") or info.get("drafter_config", {}).get("block_size")
        if not block_size or "mask_token_id" not in options:
            raise UserError(
                f"{folder}: a DFlash folder needs block_size and dflash_config.mask_token_id in its config.json"
            )
        settings = {
            "num_layers": int(config["num_hidden_layers"]),
            "target_layers": [int(layer) for layer in options["target_layer_ids"]],
            "block_size": int(block_size),
            "mask_token_id": int(options["mask_token_id"]),
            "qk_norm": True,
        }
        if laguna:
            settings["layer_family"] = dflash_laguna.FAMILY
            tensors = dflash_laguna.unfused(tensors, config)
        drafter = dflash.from_target(
            dflash.Config(**settings, **recorded), target_model, info.get("verifier", "target")
        )
        if not laguna:  # the engine builds the folder's layers (Laguna's config names its own keys)
            check_block_layers(folder, config, drafter)
        drafter.load_state_dict(tensors)
        drafter.learned = dict(info.get("learned") or {})
        return drafter
