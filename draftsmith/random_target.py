"""Random-weight targets of any family transformers implements, built from its config class alone.

Two uses, neither of which may download anything: proving a target family end to end on a CPU (a
few-MB model of the family's real architecture: its layers, norms, attention kinds and chat-template
conventions are what the stages meet), and measuring training throughput at a real model's shape on
a GPU (throughput does not depend on the weights' values).

`build_config(model_type, ...)` goes through `transformers.AutoConfig.for_model`, so any decoder-only
model type of the installed transformers works with no code here; the only per-family knowledge is
the generic spelling of mixture-of-experts sizes, set where the config class has the field, and the
sizes some families keep apart from the usual ones (latent attention's ranks, linear attention's and
sparse indexers' heads, expert groups, per-layer overrides), derived from TINY's where the class has
the field, so that the model is consistent and small.
Every weight of two or more dimensions is drawn from N(0, std²) (std 0.08 makes greedy decoding
decisive on a tiny model: the top logit wins by a clear margin, so engines agree token for token).

`python -m draftsmith.random_target MODEL_TYPE DIRECTORY [--seed-from-demo]` writes one such target
with the demo target's tokenizer, ready for `target.name_or_path=DIRECTORY`.
"""

from __future__ import annotations

if __name__ == "__main__":  # run before the imports below (torch's: a second), which the command makes under run_cli
    import importlib

    from draftsmith.errors import run_cli

    # the command is this module by its installed name: nothing below runs in this copy
    run_cli(lambda argv: importlib.import_module("draftsmith.random_target").write_command(argv))

import argparse
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, NoReturn, Optional

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError

from draftsmith.causal_lm import may_be_a_causal_lm, no_causal_lm, text_has_causal_lm, wraps_a_text_model
from draftsmith.errors import UserError, one_line, run_cli
from draftsmith.families import COMPRESSED, LINEAR, own_layer_kinds, text_config
from draftsmith.files import publish_folder, staging
from draftsmith.outputs import check_output_dir

# The tiny shape every family is proven at (the target-families matrix): hidden 256, 4 layers,
# 4 heads over 2 KV heads of 64, and for mixtures of experts 4 experts of which 2 are routed.
TINY = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}
# Mixture-of-experts sizes under the names the config classes use; set where the class has the field.
EXPERTS = {
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "shared_intermediate_size": 128,
    "shared_experts_intermediate_size": 128,
}
EXPERT_COUNTS = ("n_routed_experts", "num_local_experts", "num_experts")  # EXPERTS' names of the expert count
# The sparse indexers' keys per query: short enough that a test's sequences go past it (the selection
# is exercised), a multiple of 64 as engines' sparse-attention kernels tile the selected keys.
INDEX_TOPK = 64
INDEX_HEADS = 16  # the sparse indexers' heads, at least (scaled_fields)
INDEX_BLOCK = 4  # a block-sparse indexer's keys pooled per block: a power of two, several blocks within INDEX_TOPK
# Multi-head latent attention's key-value latent and rotary sizes (DeepSeek-V3's, GLM-4.5-Air's, Kimi's):
# vLLM's CPU MLA kernel serves a 576-wide latent head only (mla/cpu_mla.py), so tiny targets keep them.
MLA_LATENT, MLA_ROPE = 512, 64
# A vision-language wrapper's vision tower at a tiny size (its out_hidden_size: the language model's hidden size):
# text prompts never reach it, but the wrapper's checkpoint holds one, as a release does.
TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_position_embeddings": 16}
# The demo target's tokenizer files a random target is given (formats/repo.py's TOKENIZER_FILES: any target's).
RANDOM_TARGET_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)
# what write_random_target writes
TARGET_FILES = frozenset({"config.json", "model.safetensors", *RANDOM_TARGET_TOKENIZER_FILES})


def demo_tokenizer_dir() -> Path:
    from draftsmith.resources import bundled

    return Path(bundled("demo/target"))


def build_config(
    model_type: str,
    vocab_size: int,
    special: Optional[dict[str, int]] = None,
    sliding_window: Optional[int] = None,
    **shape: Any,
):
    """A transformers config of `model_type` at the TINY shape (`shape` overrides any field): the
    vocabulary and special token ids given, sliding-window layers (where the family has them)
    limited to `sliding_window` positions so that short tests cross the window.

    The config is built by its class with every field at once, so that what the class derives in its
    own initialisation (per-layer kinds, MLA's query head size, rotary sizes) follows the tiny shape;
    the fields a family sizes apart from TINY's (latent ranks, linear-attention heads, indexer heads,
    expert groups, per-layer overrides) are derived from TINY's, by field name (`scaled_fields`)."""
    from transformers import AutoConfig

    try:
        default = AutoConfig.for_model(model_type)
    except ValueError as err:
        raise UserError(f"transformers has no model type {model_type!r}: {one_line(err)}") from None
    # A multimodal family: its language model's config, built with the fields (the outer config's
    # constructor would leave its text config at the full size).
    default = getattr(default, "text_config", None) or default
    aliases = type(default).attribute_map
    canonical = {key: aliases.get(key, key) for key in (*TINY, *EXPERTS, *shape)}
    # Expert sizes only for a family whose default has experts: a dense default with the fields (Gemma-4's
    # optional MoE block) stays dense, as engines read an expert count as "build the experts"
    has_experts = any(getattr(default, key, None) for key in EXPERT_COUNTS)
    experts = {key: value for key, value in EXPERTS.items() if has_experts and hasattr(default, key)}
    fields: dict[str, Any] = {}
    # Later sources win over a field's aliases too (an expert size that is another name of a TINY one).
    for source in (TINY, experts, shape):
        fields.update({canonical[key]: value for key, value in source.items()})
    fields.update(vocab_size=vocab_size, **(special or {}))
    defaults = default.to_dict()
    sizes = {key: fields[canonical[key]] for key in TINY} | {"vocab_size": vocab_size}
    sizes.update({key: fields[canonical[key]] for key in EXPERTS if canonical[key] in fields})
    given = shape.keys() - TINY.keys()  # a derived size given is kept; TINY's given are what sizes derive from
    fields.update({key: value for key, value in scaled_fields(defaults, sizes).items() if key not in given})
    cls = type(default)
    try:
        config = cls(**fields)
        kinds = getattr(config, "layer_types", None)
        if kinds and "layer_types" not in shape:
            config = cls(**fields) if every_kind(fields, kinds, defaults, cls) else config
        overrides = getattr(config, "is_heterogeneous", False) and config.to_dict().get("per_layer_config")
        if overrides and "per_layer_config" not in shape:
            # Per-layer overrides (wider heads on some layers) at the tiny shape: each overridden size scaled
            # as its global field was, so that those layers keep their proportion to the others.
            scaled = {layer: scaled_overrides(values, defaults, fields) for layer, values in overrides.items()}
            config = cls(**fields, per_layer_config=scaled)
    except StrictDataclassError as err:  # the class's own checks of its sizes (a field derived from none here)
        raise UserError(f"transformers' {cls.__name__} refuses the tiny {model_type} target: {one_line(err)}") from None
    if sliding_window is not None and getattr(config, "sliding_window", None) is not None:
        config.sliding_window = sliding_window
    config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return config


def every_kind(fields: dict[str, Any], kinds: list[str], defaults: dict[str, Any], config_class) -> bool:
    """Set `fields`' layer_types so that the tiny depth has every attention kind of the family; whether it changed
    them. A kind its default has further down (Inkling's full attention, one layer in six) goes last, as in a period;
    a kind of the family's code its default has none of (a release turns it on: MiniMax-M3's sparse attention) goes on
    every other layer. Linear and compressed attention keep the class's layout (tests need linear layers only)."""
    own = [] if set(own_layer_kinds(config_class)) & set(kinds) else own_layer_kinds(config_class)
    default_kinds = dict.fromkeys(defaults.get("layer_types") or ())
    kept = {LINEAR, *COMPRESSED} & {*kinds, *default_kinds}
    further = [kind for kind in default_kinds if kind not in kinds and not kept]
    chosen = list(kinds)
    if own:
        chosen = [own[0] if i % 2 == 0 else kind for i, kind in enumerate(chosen)]
    if further and len(chosen) > len(further):
        chosen[-len(further) :] = further
    fields["layer_types"] = chosen
    return chosen != list(kinds)


def scaled_fields(defaults: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The sizes a family keeps apart from TINY's fields, at sizes derived from them so that the tiny
    model is consistent and small (`defaults`: the class's own config, whose fields say which apply;
    `fields`: the tiny sizes under TINY's and EXPERTS' names, and the vocabulary's)."""
    head, heads = fields["head_dim"], fields["num_attention_heads"]
    kv_heads, layers = fields["num_key_value_heads"], fields["num_hidden_layers"]
    out: dict[str, Any] = {}
    if defaults.get("num_key_value_heads") == 1:  # multi-query attention: one key-value head, shared by all
        out["num_key_value_heads"] = 1
    if "kv_lora_rank" in defaults:
        # Multi-head latent attention: keys and values are expanded from one latent per token into every
        # query head, so the heads are not grouped (a group would repeat already expanded heads). Its
        # head_dim is the rotary part's (what the rotary embedding reads): a head_dim given as a field
        # would replace the one the class derives, so it is given as that part. The latent and rotary
        # sizes stay the released models' (512 + 64): vLLM's CPU MLA kernel takes that latent only. A family whose
        # class has no rotary part (its sparse layers attend without positions: a NoPE default of 0) keeps none.
        rope = 0 if defaults.get("qk_rope_head_dim") == 0 else MLA_ROPE
        out.update(num_key_value_heads=heads, qk_nope_head_dim=head, qk_rope_head_dim=rope, v_head_dim=head)
        out.update(head_dim=rope, kv_lora_rank=MLA_LATENT)
    if defaults.get("q_lora_rank"):  # a query latent (None where queries are projected at full rank: kept)
        out["q_lora_rank"] = 3 * head  # not the key-value latent's 2 * head: a mix-up of the two fails on shape
    if defaults.get("o_lora_rank"):  # grouped low-rank output projection: groups of two query heads
        out.update(o_lora_rank=head, o_groups=largest_divisor(heads, defaults.get("o_groups") or 1, per_part=2))
    if "index_n_heads" in defaults:
        # A sparse-attention indexer: each head a rotary part as wide as the attention's (the latent's 64)
        # beside a plain part of `head`. At least INDEX_HEADS heads: a key's score sums the heads' ReLU'd
        # products, exactly 0 when every head's is negative, and top-k breaks such ties by position, not
        # alike in a one-token step and a many-token forward; with the released 64 heads (here 16) that
        # never happens, with 4 it did within 20 tokens.
        out.update(index_n_heads=max(heads, INDEX_HEADS), index_head_dim=head + out.get("qk_rope_head_dim", 0))
        out["index_topk"] = min(defaults.get("index_topk") or INDEX_TOPK, INDEX_TOPK)
    if "index_block_size" in defaults:
        # An indexer that picks blocks of keys (MiniMax-M3's): blocks of INDEX_BLOCK, as many as make INDEX_TOPK
        # keys; one indexer head per key-value head where the family ties them (its attention expands each head's
        # selection to the query heads of its group).
        out.update(index_block_size=INDEX_BLOCK, index_topk_blocks=INDEX_TOPK // INDEX_BLOCK)
        if defaults.get("index_n_heads") == defaults.get("num_key_value_heads"):
            out["index_n_heads"] = kv_heads
    if isinstance(defaults.get("rotary_dim"), int) and isinstance(defaults.get("head_dim"), int):
        out["rotary_dim"] = head * defaults["rotary_dim"] // defaults["head_dim"]  # the family's rotated share
    if "swa_head_dim" in defaults:  # sliding-window layers sized apart (Inkling's): as the others
        out.update(swa_head_dim=head, swa_num_attention_heads=heads, swa_num_key_value_heads=kv_heads)
    if defaults.get("unpadded_vocab_size"):  # the lm_head's rows a release pads to `vocab_size`: every row, unpadded
        out["unpadded_vocab_size"] = fields["vocab_size"]
    if "dense_intermediate_size" in defaults:  # the dense layers' MLP of a mixture-of-experts family: the tiny one
        out["dense_intermediate_size"] = fields["intermediate_size"]
    if "indexer_budget" in defaults:  # a block-sparse indexer (QSA: unset by the class, set by a release): blocks of
        # INDEX_BLOCK keys scored by one key head, INDEX_TOPK keys kept; heads as above (ties), as wide as attention's
        out.update(indexer_n_heads=max(heads, INDEX_HEADS), indexer_kv_heads=1, indexer_head_dim=head)
        out.update(indexer_compress_ratio=INDEX_BLOCK, indexer_budget=INDEX_TOPK)
    if "ple_layer_ids" in defaults:  # per-layer n-gram embeddings (none by default; a release's hold billions of rows):
        # on the first layer, each hashed table about the vocabulary's size, saved as one part
        out.update(ple_layer_ids=[1], ngram_vocab_size_base=fields["vocab_size"], split_ngram_parts=1)
    if defaults.get("hc_lowrank"):  # hyper-connections' low-rank stream mixer: a head's width (the release's ~hidden/6)
        out["hc_lowrank"] = head
    if defaults.get("n_group"):
        # Grouped routing: the experts split in groups (each scored by its top two experts), the tokens
        # routed within the best `topk_group` of them; as many groups as divide the experts in pairs, the
        # family's share of them kept (at least enough groups for the experts a token takes).
        experts = next(fields[key] for key in EXPERT_COUNTS if fields.get(key))
        groups = largest_divisor(experts, defaults["n_group"], per_part=2)
        share = round(groups * (defaults.get("topk_group") or 1) / defaults["n_group"])
        needed = -(-fields.get("num_experts_per_tok", 1) // (experts // groups))
        out.update(n_group=groups, topk_group=min(groups, max(1, share, needed)))
    if defaults.get("first_k_dense_replace"):  # dense layers first: one, so that 2 layers still meet both kinds
        out["first_k_dense_replace"] = 1
    if isinstance(defaults.get("mlp_layer_types"), list) and defaults["mlp_layer_types"]:
        # The family's first layer's kind, then its last layer's (dense or hash-routed first, then routed).
        kinds = defaults["mlp_layer_types"]
        out["mlp_layer_types"] = [kinds[0]] + [kinds[-1]] * (layers - 1)
    if "linear_key_head_dim" in defaults:  # linear attention (Gated DeltaNet): heads as the attention's
        out.update(linear_key_head_dim=head, linear_value_head_dim=head)
        out.update(linear_num_key_heads=kv_heads, linear_num_value_heads=heads)
    if "linear_head_dim" in defaults:  # linear attention with one head size for keys and values (GLM-5-Next's)
        out.update(linear_head_dim=head, linear_num_heads=heads)
    if defaults.get("vocab_size_per_layer_input"):  # per-layer input embeddings: of the vocabulary used
        out["vocab_size_per_layer_input"] = fields["vocab_size"]
    if defaults.get("hidden_size_per_layer_input"):
        out["hidden_size_per_layer_input"] = head
    if "num_kv_shared_layers" in defaults:  # layers reusing another's cache: none, each layer its own
        out["num_kv_shared_layers"] = 0
    return {key: value for key, value in out.items() if key in defaults}


def scaled_overrides(values: dict[str, Any], defaults: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """A layer's overrides of global sizes, each scaled by its field's tiny/default ratio; a latent-attention head that
    is its plain and rotary parts (Dots3-Note's sliding layers') stays their sum, which the family checks."""

    def scaled(key: str, value: Any) -> Any:
        if not (isinstance(value, int) and isinstance(defaults.get(key), int) and key in fields):
            return value
        return max(1, value * fields[key] // defaults[key])

    out = {key: scaled(key, value) for key, value in values.items()}
    # a part the layer does not override is the global one: the default's, and at the tiny shape the field's
    default_parts = [values.get(key, defaults.get(key)) for key in ("qk_nope_head_dim", "qk_rope_head_dim")]
    tiny_parts = [out.get(key, fields.get(key)) for key in ("qk_nope_head_dim", "qk_rope_head_dim")]
    if "head_dim" in values and all(isinstance(part, int) for part in (*default_parts, *tiny_parts)):
        if values["head_dim"] == sum(default_parts):
            out["head_dim"] = sum(tiny_parts)
    return out


def largest_divisor(n: int, cap: int, per_part: int = 1) -> int:
    """The largest divisor of `n` that is at most `cap` and leaves at least `per_part` in each part."""
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(cap, 1) and (n // d >= per_part or d == 1))


@torch.no_grad()
def build_model(
    config,
    std: float = 0.08,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype=torch.float32,
    seed_from: Optional[str | Path] = None,
):
    """The causal LM of `config` with random weights (every >= 2-D weight from N(0, std²); norms and
    biases as the family initialises them), in eval mode. `seed_from`: a checkpoint directory
    (model.safetensors) whose tensors replace the random ones wherever name and shape match, by name
    only, whatever the families: a trained model's weights make the target's text predictable, so a
    drafter learns something within seconds, while every part the family does differently (its norms,
    fused projections, experts, biases) stays its own."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    wrapper = wraps_a_text_model(config.to_dict())  # built whole, as draftsmith.target_loading reads one
    if not wrapper and not may_be_a_causal_lm(config.model_type):
        raise UserError(f"{no_causal_lm(config.model_type)}: a target of it cannot be built")  # not ~200 classes
    torch.manual_seed(seed)
    with torch.device(device):
        model = (AutoModelForImageTextToText if wrapper else AutoModelForCausalLM).from_config(config, dtype=dtype)
    for parameter in model.parameters():
        if parameter.dim() >= 2:
            parameter.normal_(0.0, std)
    if seed_from is not None:  # a wrapper's language model, under a causal LM's names as the checkpoint's are
        from draftsmith.wrapped_text import language_causal_lm

        seed_weights(language_causal_lm(model, config.model_type) if wrapper else model, Path(seed_from))
    return model.eval()


def seed_weights(model, directory: Path) -> float:
    """Copy the tensors of `directory`'s model.safetensors into `model` where name and shape match;
    returns the share of `model`'s parameters so copied."""
    from safetensors.torch import load_file

    source = load_file(str(directory / "model.safetensors"))
    own = model.state_dict()
    copied = 0
    for name, tensor in source.items():
        if name in own and own[name].shape == tensor.shape:
            own[name].copy_(tensor.to(own[name].dtype))
            copied += tensor.numel()
    return copied / sum(p.numel() for p in model.parameters())


def declare_as_released(config, model) -> None:
    """Add the config fields released checkpoints carry for what transformers' class always computes,
    which engines read instead (vLLM routes with a softmax and no bias, or fails on a missing field,
    without them): a router with a score-correction bias scores experts by a sigmoid and picks them
    with the bias (`noaux_tc` where the experts are grouped); the rotary embedding's width (`rotary_dim`,
    which the engines that read it take as transformers' head_dim × partial factor)."""
    if any(name.endswith("e_score_correction_bias") for name, _ in model.named_buffers()) or any(
        name.endswith("e_score_correction_bias") for name, _ in model.named_parameters()
    ):
        config.scoring_func, config.use_routing_bias = "sigmoid", True
        if getattr(config, "n_group", None):
            config.topk_method = "noaux_tc"
    fields = config.to_dict()  # global values: a field set per layer (Gemma-4's head_dim) raises as an attribute
    factor = (fields.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    head_dim = fields.get("head_dim")
    if isinstance(head_dim, int) and fields.get("rotary_dim") is None:
        config.rotary_dim = int(head_dim * factor)


def write_random_target(
    model_type: str,
    directory: str | Path,
    sliding_window: Optional[int] = 48,
    seed: int = 0,
    seed_from: Optional[str | Path] = None,
    **shape: Any,
) -> Path:
    """A tiny random target of `model_type` in `directory` (config.json, model.safetensors and the
    demo target's tokenizer and chat template): a local target like any other."""
    source = demo_tokenizer_dir()
    demo = json.loads((source / "config.json").read_text())
    special = {key: demo[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = build_config(model_type, demo["vocab_size"], special, sliding_window=sliding_window, **shape)
    config = tiny_wrapper_config(model_type, config) or config
    model = build_model(config, seed=seed, seed_from=seed_from)
    declare_as_released(text_config(model.config), model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    for name in RANDOM_TARGET_TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
    return directory


def tiny_wrapper_config(model_type: str, text):
    """The config of `model_type`'s wrapper around the language model `text` with a tiny vision tower, for a
    wrapper transformers has no causal LM class for (its text model's type has none either: the wrapper is the
    target); None for any other model type."""
    from transformers import AutoConfig

    wrapped = {"model_type": model_type, "text_config": text.to_dict()}
    if not wraps_a_text_model(wrapped) or text_has_causal_lm(wrapped):  # then its language model is written alone
        return None
    vision = {**TINY_VISION, "out_hidden_size": text.hidden_size}
    config = AutoConfig.for_model(model_type, text_config=text.to_dict(), vision_config=vision)
    return config


def main(argv: Optional[list[str]] = None) -> NoReturn:
    """`python -m draftsmith.random_target ...` from a process that has imported this module, under run_cli as every
    command: a refusal, a full disk or a stop is one line and its exit code (docs/faults.md). `python -m` itself runs
    `write_command` so before this module's imports (its `__main__` block at the top)."""
    run_cli(write_command, argv)


def write_command(argv: list[str]) -> None:
    """Write the target the arguments name into DIRECTORY, whole or not at all."""
    parser = argparse.ArgumentParser(prog="python -m draftsmith.random_target", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_type", help="a transformers model type: qwen3, gemma3_text, gpt_oss, ...")
    parser.add_argument("directory")
    parser.add_argument("--sliding-window", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seed-from-demo",
        action="store_true",
        help="copy the demo target's trained tensors wherever name and shape match (a predictable target)",
    )
    args = parser.parse_args(argv)
    directory = Path(args.directory)
    check_target_directory(directory)
    # Written beside it and renamed into place: a full disk or a stop leaves no half-written target (a config.json
    # without its weights would load as a target and fail later, far from the cause).
    with staging(directory) as staged:
        try:
            write_random_target(
                args.model_type,
                staged,
                args.sliding_window,
                args.seed,
                seed_from=demo_tokenizer_dir() if args.seed_from_demo else None,
            )
        except SafetensorError as err:  # a full disk under save_pretrained: the OSError it is (files.save_safetensors)
            number = re.search(r"\(os error (\d+)\)", str(err))
            if number is None:
                raise
            raise OSError(int(number[1]), os.strerror(int(number[1])), str(staged / "model.safetensors")) from err
        publish_folder(staged, directory)
    print(directory)


def check_target_directory(directory: Path) -> None:
    """Before the model is built: `directory` a folder that can be created, with a folder beside it (the target
    is written to `<directory>.tmp` first), and, if it exists, holding no file but a target's (it is replaced)."""
    named = f"DIRECTORY {str(directory)!r}"
    check_output_dir(directory, named=named)
    check_output_dir(directory.absolute().parent, named=f"the folder of {named}")
    others = (
        sorted(path.name for path in directory.iterdir() if path.name not in TARGET_FILES) if directory.is_dir() else []
    )
    if others:
        raise UserError(
            f"{named} holds files a target written here does not ({', '.join(others[:5])}): it would be replaced; "
            "give a new folder, or one that is empty"
        )
