"""A released DFlash drafter (its folder, or a Hub id) as the start of a dflash drafter (`drafter.released_drafter`,
and the dflash format's reader of such a folder, formats/dflash.py): the drafter keeps the folder's own draft layers
(widths, heads, norm epsilon, RoPE and sliding windows, which need not be the target's), its settings and its weights.

Two layouts are read. vLLM's `DFlashDraftModel` (formats/dflash.py writes it) keeps draftsmith's names and its
settings under `dflash_config`. The *encoder layout* (transformers' DFlash assistants) keeps `target_layer_ids`,
`block_size` and `mask_token_id` at the top of its config and names the fused context's projection and norm
`encoder.fc` and `encoder.output_norm_enc` (vLLM 0.32 builds it as its generic DFlash, qwen3_dflash.py renaming those
to `fc` and `hidden_norm`). Its layers compute draftsmith's DFlash layers: Llama's function with per-head q/k norms,
non-causal over [context ; block], a sliding window on the layers its `layer_types` mark sliding
(draftsmith/families.py `layer_window`). The export writes such a drafter back in the encoder layout, its
config as released plus a `dflash_config` (its settings again, where vLLM's model runner V1 reads them, and
`causal: false`, what vLLM's config for it sets), so the export starts a later run the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from draftsmith.errors import UserError, one_line
from draftsmith.families import FULL, SLIDING
from draftsmith.files import read_json, require_readable
from draftsmith.heads.eagle_base import decoder_spec
from draftsmith.hub_cache import hub_folder
from draftsmith.model_files import prefix_renamed, tensor_names

log = logging.getLogger(__name__)
ENCODER_NAMES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}  # released -> draftsmith's
LAYOUT = "released_layout"  # the decoder's key holding an encoder-layout folder's config, for the export
NEEDED_SHAPE = ("hidden_size", "intermediate_size", "num_attention_heads")  # the rest has defaults
LAYER_SHAPE = (
    *NEEDED_SHAPE, "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
    "layer_types", "sliding_window",
)  # fmt: skip
FAMILIES = ("llama", "qwen3")  # layer families computing the released layers' function (with q/k norms)
# dflash_config keys of vLLM's DFlash that change the layers' function; draftsmith computes none of them
UNREAD = ("use_swa", "swa_window_size", "attention_sink_bias", "attention_value_scale")


def encoder_layout(config: dict[str, Any], tensors: Collection[str]) -> bool:
    """Whether a folder (its config.json, its tensors' names) is in the encoder layout (module docstring)."""
    return "encoder.fc.weight" in tensors and all(
        key in config for key in ("target_layer_ids", "block_size", "mask_token_id")
    )


def renamed(tensors: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """`tensors` with each name starting with a key of `names` given that key's value instead."""
    return {prefix_renamed(name, names.items()): tensor for name, tensor in tensors.items()}


def released_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A drafter's state under the encoder layout's names."""
    return renamed(state, {ours: theirs for theirs, ours in ENCODER_NAMES.items()})


def open_release(name_or_path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A released drafter's config.json and weights: a folder's, or a Hub id's (draftsmith/hub_cache.py
    `hub_folder`: downloaded, or read from the Hub cache); one line where it holds none."""
    key = f"drafter.released_drafter={name_or_path}"
    folder = hub_folder(name_or_path, f"cannot load {key}")
    if not (folder / "config.json").is_file():
        raise UserError(f"{key}: no config.json there (give a released DFlash drafter's folder)")
    require_readable(folder / "model.safetensors")
    try:
        return read_json(folder / "config.json"), load_file(str(folder / "model.safetensors"))
    except (SafetensorError, OSError) as err:
        raise UserError(f"{key}: its model.safetensors cannot be read ({one_line(err)})") from None


def folder_settings(folder, config: dict[str, Any]) -> dict[str, Any]:
    """The drafter settings a released folder's config fixes (num_layers, target_layers, block_size, mask_token_id),
    either layout's."""
    options = config if "target_layer_ids" in config else config.get("dflash_config") or {}
    needed = {"target_layer_ids": options.get("target_layer_ids"), "mask_token_id": options.get("mask_token_id"),
              "block_size": config.get("block_size"), "num_hidden_layers": config.get("num_hidden_layers")}  # fmt: skip
    missing = [key for key, value in needed.items() if value is None]
    if missing:
        raise UserError(f"{folder}: a released DFlash drafter's config.json needs {', '.join(missing)}")
    return {
        "num_layers": int(needed["num_hidden_layers"]),
        "target_layers": [int(layer) for layer in needed["target_layer_ids"]],
        "block_size": int(needed["block_size"]),
        "mask_token_id": int(needed["mask_token_id"]),
    }


def unread_function(config: dict[str, Any], encoder: bool) -> Optional[str]:
    """What of a released folder's layers draftsmith's DFlash layers do not compute, or None."""
    options = config.get("dflash_config") or {}
    kinds = config.get("layer_types") or []
    causal = config.get("is_causal", options.get("causal"))
    if causal or (causal is None and not encoder and SLIDING in kinds):  # vLLM's rule for an unset one
        return "causal attention within the block (draftsmith's DFlash layers are non-causal)"
    found = [f"dflash_config.{key}" for key in UNREAD if options.get(key)]
    found += [key for key in ("attention_bias", "mlp_bias") if config.get(key)]
    if config.get("is_neox_style") is False:
        found.append("is_neox_style false (interleaved RoPE)")
    if set(kinds) - {FULL, SLIDING}:
        found.append(f"layer_types {sorted(set(kinds) - {FULL, SLIDING})}")
    if kinds and len(kinds) != config.get("num_hidden_layers"):
        found.append(f"layer_types of {len(kinds)} layers for {config.get('num_hidden_layers')}")
    return ", ".join(found) or None


def released_layers(folder, config: dict[str, Any], target_config, family: str, num_layers: int) -> dict[str, Any]:
    """The draft layers' spec (heads/eagle_base.py `decoder_spec`) at the released folder's own shape (`family` one
    of FAMILIES: `released_settings`)."""
    rope = config.get("rope_parameters")
    if rope is None and config.get("rope_theta") is not None:
        rope = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    missing = [key for key in NEEDED_SHAPE if config.get(key) is None]
    if rope is None or missing:
        raise UserError(f"{folder}: its config.json names no {', '.join(missing) or 'RoPE (rope_parameters)'}")
    spec = decoder_spec(target_config, family, num_layers)
    heads = config["num_attention_heads"]
    # the engines' defaults where the folder leaves them out, not the target's
    layers = {"num_key_value_heads": heads, "head_dim": config["hidden_size"] // heads, "rope_parameters": rope}
    spec["config"] |= layers | {key: config[key] for key in LAYER_SHAPE if config.get(key) is not None}
    return spec


def released_settings(config, released: dict[str, Any], names: Collection[str]) -> dict[str, Any]:
    """The settings the released folder `config.released_drafter` fixes, from its config.json (`released`) and its
    tensors' `names`: the recipe's must be unset (the kind's defaults) or the folder's, its layers what draftsmith's
    compute, else one line. Read before any data loads where the folder is local (the kind's recipe check), and
    again as the drafter is built."""
    folder = config.released_drafter
    encoder = encoder_layout(released, names)
    if not encoder and "dflash_config" not in released:
        raise UserError(
            f"drafter.released_drafter={folder} is no released DFlash drafter (no dflash_config, no encoder.fc)"
        )
    unread = unread_function(released, encoder)
    if unread:
        raise UserError(f"drafter.released_drafter={folder}: its layers compute what draftsmith does not: {unread}")
    if config.layer_family not in FAMILIES:
        raise UserError(
            f"drafter.layer_family={config.layer_family}: a released DFlash drafter's layers are Llama's function "
            f"with q/k norms; set drafter.layer_family to {' or '.join(FAMILIES)}"
        )
    own = folder_settings(folder, released) | {"qk_norm": True}  # every released layer norms queries and keys
    default = type(config)()
    differ = [
        f"drafter.{key}={getattr(config, key)} ({folder} has {value})"
        for key, value in own.items()
        if getattr(config, key) not in (getattr(default, key), value)
    ]
    if differ:
        raise UserError(f"{'; '.join(differ)}: leave those unset, the released drafter's are its own")
    return own


def check_local_release(config) -> None:
    """`released_settings` of a released drafter in a local folder, from its config.json and its weights' names (the
    safetensors header), before any data or model loads; a Hub id's files are read as the drafter is built."""
    folder = Path(config.released_drafter).expanduser()
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        return  # a Hub id, or a folder open_release names what it lacks in
    try:
        names, released = tensor_names(folder), read_json(folder / "config.json")
    except (SafetensorError, OSError, ValueError):
        return  # open_release says what of it cannot be read, in its own line
    released_settings(config, released, names)


def start_from_release(cls, config, target_model, shape):
    """A drafter of class `cls` (DFlash) built as the released folder `config.released_drafter` is, with its
    weights: the recipe's settings the folder fixes unset (the kind's defaults) or the folder's, else one line."""
    folder = config.released_drafter
    released, tensors = open_release(folder)
    encoder = encoder_layout(released, tensors)
    own = released_settings(config, released, tensors)
    taken = [f"{key} {value} (for the recipe's {getattr(config, key)}, the kind's default)"
             for key, value in own.items() if getattr(config, key) != value]  # fmt: skip
    if taken:  # the recipe's unset ones: recipe.yaml keeps the recipe as given, final/config.json what trains
        log.info("drafter.released_drafter=%s sets %s: the released drafter's own", folder, ", ".join(taken))
    hidden = released.get("hidden_size")
    if hidden != shape.hidden_size:
        raise UserError(
            f"drafter.released_drafter={folder} has hidden_size {hidden}, the target {shape.hidden_size}: its context "
            "and block inputs are the target's states and embedding rows"
        )
    config = replace(config, **own)
    config.check(shape)
    spec = released_layers(folder, released, target_model.config, config.layer_family, config.num_layers)
    if encoder:
        spec[LAYOUT] = released
    drafter = cls(replace(config, decoder=spec), shape)
    drafter.attach_target(target_model)
    missing, unexpected = drafter.load_state_dict(renamed(tensors, ENCODER_NAMES), strict=False)
    if missing or unexpected:
        raise UserError(
            f"drafter.released_drafter={folder}: its weights are not this drafter's (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    return drafter
