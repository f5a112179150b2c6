"""What every EAGLE-3 layout (formats/eagle3.py, formats/eagle3_sglang.py) shares: the `Layout`
interface, and the draft layer as each writes and reads it (its aux-layer ids in vLLM's convention, the
tensors it is loaded from, its config keys) with the checks a folder's layer must pass to be read, and what a
speculators folder's config says beside it (its release, its algorithm, a P-EAGLE folder's trained depths)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch

from draftsmith.errors import UserError
from draftsmith.families import SLIDING
from draftsmith.formats import Source
from draftsmith.formats.repo import EngineRepo, TargetInfo
from draftsmith.target import TargetShape

log = logging.getLogger(__name__)
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


def refuse_unhonoured(folder: Path, layer: dict[str, Any], ours: list[int], num_layers: int) -> None:
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

    def refuse(self, drafter, target: TargetInfo) -> None:
        """Raise the one-line UserError for a drafter this layout's engine would not serve for this target, from
        their configs alone (formats.Exporter.refuse asks it before `write`, which assumes it passed)."""
        raise NotImplementedError

    def write(self, source: Source, gamma: int) -> EngineRepo:
        raise NotImplementedError

    def recognises(self, config: dict[str, Any]) -> bool:
        raise NotImplementedError

    def layer(self, config: dict[str, Any]) -> dict[str, Any]:
        """The draft layer's config within the folder's config (at its top level unless overridden)."""
        return config

    def read(self, folder: Path, config: dict[str, Any], num_layers: Optional[int]) -> dict[str, Any]:
        """The drafter settings the folder sets in this format: `aux_layers` (draftsmith's ids; left out where the
        folder names none and `num_layers`, the target's, is not known), `layer_family`, `norm_before_residual`, and
        EAGLE-3.1's and P-EAGLE's keys where it has them."""
        raise NotImplementedError


def eagle3_architecture(config: dict[str, Any]) -> bool:
    return any("Eagle3" in arch for arch in config.get("architectures", []))


# the speculators release whose folders draftsmith reads and writes (tests/test_speculators_interop.py runs it)
SPECULATORS_READ = "0.9"


def require_read_speculators(folder: Path, config: dict[str, Any], model_type: str) -> None:
    """A speculators folder's algorithm must be its model type's (another would draft otherwise, read as this one);
    one saved by a later speculators release than SPECULATORS_READ is read as that release's, with a warning: a key
    whose meaning changed since would draft otherwise, unsaid."""
    from packaging.version import InvalidVersion, Version

    algorithm = (config.get("speculators_config") or {}).get("algorithm", model_type)
    if algorithm != model_type:
        raise UserError(
            f"{folder}: speculators_config.algorithm {algorithm!r} is not its speculators_model_type's "
            f"({model_type!r}), the algorithm draftsmith reads such a folder as"
        )
    saved = config.get("speculators_version")
    try:
        later = saved is not None and Version(str(saved)).release[:2] > Version(SPECULATORS_READ).release[:2]
    except InvalidVersion:
        later = True
    if later:
        log.warning(
            "%s was saved by speculators %s; draftsmith reads speculators %s's folders, and reads this one as such: "
            "check its drafts (draftsmith eval) before training on from it",
            folder, saved, SPECULATORS_READ,
        )  # fmt: skip


def trained_depths(config: dict[str, Any]) -> int | None:
    """The chain depths a speculators P-EAGLE folder trained (draftsmith's ttt_steps: its chain is at most this
    long), None where its config names none: speculators 0.6 writes `num_depths` (earlier, `para_depths`), and its
    trainer sets `speculators_config`'s proposal method's `speculative_tokens` to the depths it trained."""
    for key in ("num_depths", "para_depths"):
        if config.get(key) is not None:
            return int(config[key])
    speculators = config.get("speculators_config") or {}
    methods = speculators.get("proposal_methods") or []
    default = speculators.get("default_proposal_method")
    method = next((m for m in methods if m.get("proposal_type") == default), methods[0] if methods else {})
    return int(method["speculative_tokens"]) if method.get("speculative_tokens") is not None else None
