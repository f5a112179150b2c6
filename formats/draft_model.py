"""A distilled draft model for vLLM (`method: draft_model`) and SGLang (`STANDALONE`): a plain causal-LM
folder (its own config.json, the model's weights under the transformers names, the target's tokenizer).

PARD (`drafter.parallel_drafting`): the same folder with `pard_token` (the mask token) in config.json,
served with `"parallel_drafting": true`, so one draft forward proposes the whole chain; SGLang has no
parallel draft model and is refused (it would draft sequentially, from masks it never reads).

Checked: the vocabulary equals the target's (vLLM refuses another), max_position_embeddings is at
least the target's (vLLM raises an EAGLE drafter's, not a draft model's), and a tied lm_head is not
shipped twice. LoRA-trained checkpoints already hold merged weights. A folder read back is refused where vLLM would
serve another model than transformers builds (check_engine_only_keys).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from draftsmith.causal_lm import register_misfiled_causal_lms
from draftsmith.errors import UserError
from draftsmith.families import SLIDING, layer_types
from draftsmith.formats import Exporter, Source, register
from draftsmith.formats.repo import (
    ENGINE_ONLY_LAYER_KEYS,
    SGLANG_FLAGS,
    SGLANG_REVISION_FLAG,
    VLLM_SERVE,
    EngineRepo,
    TargetInfo,
)
from draftsmith.formats.versions import PARALLEL_DRAFTING_RELEASES, Releases
from draftsmith.formats.vllm_backend import backend_overrides, fused_experts_clash
from draftsmith.heads import drafter_class
from draftsmith.text_release import release_form
from draftsmith.vllm_window import VLLM_ONE_MORE_KEY, as_released

SGLANG_SERVE = (
    "python -m sglang.launch_server --model-path {target} --speculative-algorithm STANDALONE "
    "--speculative-draft-model-path {path} --speculative-num-steps {gamma} --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens {gamma_plus_one}" + SGLANG_FLAGS
)
PREFIX = "model."  # the DraftModel drafter holds the causal LM as `model`
FIRST_LAYER = re.compile(r"(^|\.)layers\.0\.")  # a causal LM's first decoder layer's tensors


def model_config(source: Source) -> dict[str, Any]:
    """The draft model's config.json: its config as its release would state it, which the engine reads (its family's
    release form where its releases name another architecture than transformers' class, which vLLM has a model of:
    draftsmith.text_release.release_form), with what vLLM's Transformers backend must be told of a model it builds
    (formats/vllm_backend.py's backend_overrides)."""
    drafter = source.drafter
    model = causal_lm(drafter)
    config = as_released(drafter.config.model_config)
    config["architectures"] = [type(model).__name__]
    config.pop("_name_or_path", None)
    config.pop("transformers_version", None)
    config = release_form(model.config, config)
    config |= backend_overrides(config)  # the engine builds the draft model as it builds a target of its config
    if drafter.config.parallel_drafting:
        config["pard_token"] = int(drafter.config.mask_token_id)  # what vLLM feeds at the masked positions
    return config


def widened_window_arguments(config: Mapping[str, Any]) -> dict[str, Any]:
    """The engine arguments vLLM serves this draft model with as trained: its hybrid KV cache manager off for one with
    sliding layers that vLLM widens by a key (draftsmith.vllm_window's VLLM_ONE_MORE_KEY). With the manager on, vLLM
    0.32 verifies drafts wrongly beside such a draft model (measured on its CPU build with draft models of a Cohere2
    and a Cohere2-MoE target's first layers: its greedy output with the drafter parted from its output without it on
    every prompt; with the manager off, or every draft layer full attention, it did not); the target's own sliding
    layers serve Medusa and EAGLE-3 drafters losslessly with it on. Off, every layer's keys are kept whole: more KV
    cache memory at long contexts."""
    widened = config.get("model_type") in VLLM_ONE_MORE_KEY and SLIDING in layer_types(config)
    return {"disable_hybrid_kv_cache_manager": True} if widened else {}


def expected_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The weights a checkpoint of this config holds, as transformers saves them (saved_as_released), which the
    engines load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    register_misfiled_causal_lms()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **settings))
    return {name: tuple(tensor.shape) for name, tensor in saved_as_released(model, model.state_dict(), config).items()}


def engine_tensors(source: Source, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The draft model's weights as transformers saves them (saved_as_released)."""
    tensors = {
        name.removeprefix(PREFIX): tensor
        for name, tensor in source.drafter.state_dict().items()
        if name.startswith(PREFIX)
    }
    return saved_as_released(causal_lm(source.drafter), tensors, config)


def causal_lm(drafter):
    """The drafter's causal LM, the base model under a LoRA adapter's wrapper."""
    model = drafter.model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def saved_as_released(model, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, Any]:
    """`tensors` (`model`'s, under the names transformers' model holds them) under the names its checkpoints hold
    them, as transformers saves them and releases ship them: its conversion mapping reversed (experts unfused, modules
    renamed: Mixtral's and Phi-3.5-MoE's `mlp` is `block_sparse_moe`, which vLLM's models of them read alone); the
    lm_head left out where it is tied to the embedding (the embedding serves, the engines skip a second copy)."""
    from transformers.core_model_loading import revert_weight_conversion

    saved = dict(revert_weight_conversion(model, tensors))
    if config.get("tie_word_embeddings"):
        saved.pop("lm_head.weight", None)
    return saved


def loaded_as_transformers(folder: Path) -> dict[str, torch.Tensor]:
    """A draft model folder's weights under the names transformers' model holds them: the folder loaded as
    transformers loads a checkpoint (its conversion mapping applied)."""
    from transformers import AutoModelForCausalLM

    register_misfiled_causal_lms()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


@register
class DraftModelExporter(Exporter):
    kinds = ("draft_model",)
    vllm_method = "draft_model"
    vllm_method_from_name = True
    vllm_shares_embedding = None  # the draft model embeds with its own weights
    vllm_writes_family_config = True  # a causal LM of the target's family, or of another with its vocabulary

    def releases(self, drafter_config: Mapping[str, Any], gamma: Optional[int] = None) -> Releases:
        return PARALLEL_DRAFTING_RELEASES if drafter_config.get("parallel_drafting") else self.vllm_releases

    def refuse(self, engine: str, drafter, target: TargetInfo, vllm_format: str) -> None:
        super().refuse(engine, drafter, target, vllm_format)
        if engine == "sglang" and drafter.config.parallel_drafting:
            raise UserError(
                "this draft model drafts in parallel (PARD), which SGLang does not serve: it would draft sequentially "
                "and never read the mask token it was trained for; export it for vllm"
            )
        config = drafter.config.model_config
        clash = fused_experts_clash(target.config, config) if engine == "vllm" else None
        if clash:
            raise UserError(f"vLLM cannot serve this draft model for this target: {clash}; export another kind for it")
        if config.get("vocab_size") != target.shape.vocab_size:
            raise UserError(
                f"the draft model's vocab_size {config.get('vocab_size')} differs from the target's "
                f"{target.shape.vocab_size}; engines refuse it"
            )
        theirs = target.config.get("max_position_embeddings")
        if theirs and config.get("max_position_embeddings", 0) < theirs:
            raise UserError(
                f"the draft model's max_position_embeddings {config.get('max_position_embeddings')} is below the "
                f"target's {theirs}: vLLM would clamp the served context to it"
            )

    def repo(self, source: Source, engine: str, serve: str, method: str) -> EngineRepo:
        config = model_config(source)
        conventions = {
            "tokenizer": "the target's (copied); the vocabulary is the target's",
            "weights": "the transformers names of the draft's causal LM",
        }
        options = {}
        if source.drafter.config.parallel_drafting:
            options = {"parallel_drafting": True}
            conventions["parallel_drafting"] = (
                f"PARD: pard_token {config['pard_token']} in config.json; serve with parallel_drafting: true; trained "
                f"for chains of up to {source.drafter.config.parallel_tokens} tokens"
            )
        return EngineRepo(
            engine,
            config,
            engine_tensors(source, config),
            expected_tensors(config),
            serve,
            conventions,
            tokenizer=True,
            method=method,
            options=options,
        )

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        repo = self.repo(source, "vllm", VLLM_SERVE, self.vllm_method)
        return replace(repo, engine_arguments=widened_window_arguments(repo.config))

    def sglang(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        return replace(self.repo(source, "sglang", SGLANG_SERVE, "STANDALONE"), revision_flag=SGLANG_REVISION_FLAG)

    def recognises(self, config: dict[str, Any], names: Collection[str]) -> bool:
        # a model of its own that reads tokens alone: no EAGLE fc, no width of another model it reads states of; its
        # first decoder layer among its tensors (an MTP folder holds layers past the target's only, and may hold an
        # embedding of its own: Dots3-Note's)
        return (
            any(name.endswith("embed_tokens.weight") for name in names)
            and any(FIRST_LAYER.search(name) for name in names)
            and "fc.weight" not in names
            and "backbone_hidden_size" not in config
        )

    def read(
        self, folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], target_model, info: dict[str, Any]
    ):
        draft = drafter_class("draft_model")
        settings = {"model_config": {k: v for k, v in config.items() if k not in ("architectures", "pard_token")}}
        settings |= {
            k: v
            for k, v in info.get("drafter_config", {}).items()
            if k in ("loss", "temperature", "mix_weights", "ce_weight", "parallel_tokens")
        }
        if "pard_token" in config:  # the engine drafts in parallel from this token, so the drafter does too
            settings |= {"parallel_drafting": True, "mask_token_id": int(config["pard_token"])}
        from draftsmith.target import TargetShape

        check_engine_only_keys(folder, config)
        drafter = draft(draft.Config(**settings), TargetShape.of(target_model, info.get("verifier", "target")))
        held = {name.removeprefix(PREFIX) for name in drafter.state_dict()}
        if set(tensors) - held:  # a checkpoint's names (saved_as_released): converted as transformers loads them
            tensors = loaded_as_transformers(folder)
        if config.get("tie_word_embeddings"):  # the engines read the embedding as the lm_head too, and drop one
            embedding = tensors["model.embed_tokens.weight"]
            if "lm_head.weight" in tensors and not torch.equal(tensors["lm_head.weight"], embedding):
                raise UserError(
                    f"{folder}: its config.json ties the lm_head to the embedding (tie_word_embeddings), and its "
                    "lm_head.weight is another tensor: the engines would serve the embedding as the lm_head"
                )
            tensors = tensors | {"lm_head.weight": embedding}
        drafter.load_state_dict({PREFIX + name: tensor for name, tensor in tensors.items()})
        return drafter


def check_engine_only_keys(folder: Path, config: dict[str, Any]) -> None:
    """Keys of the folder's config.json that its model type's transformers class keeps unread and vLLM's model
    reads (its llama.py: `bias`, `qkv_bias`, `is_causal`, `logit_scale`, and `layer_types` for sliding-window
    layers): draftsmith trains and evaluates the model transformers builds, so any value under which the two do not
    compute alike would serve another model than the one measured."""
    from transformers import AutoConfig

    known = AutoConfig.for_model(str(config.get("model_type"))).to_dict()
    differ = [
        f"{key}={config[key]!r} (transformers' model computes as {neutral!r})"
        for key, neutral in ENGINE_ONLY_LAYER_KEYS.items()
        if key not in known and config.get(key) is not None and config[key] != neutral
    ]
    kinds = config.get("layer_types") if "layer_types" not in known else None
    if isinstance(kinds, list) and set(kinds) - {"full_attention"}:
        differ.append(f"layer_types={sorted(set(kinds))} (transformers' model attends to every key)")
    if differ:
        raise UserError(
            f"{folder}: its config.json sets keys its model type's transformers class ignores and vLLM's model "
            f"reads: {', '.join(differ)}"
        )
