"""Random-weight targets of any family transformers implements, built from its config class alone.

Two uses, neither of which may download anything: proving a target family end to end on a CPU (a
few-MB model of the family's real architecture: its layers, norms, attention kinds and chat-template
conventions are what the stages meet), and measuring training throughput at a real model's shape on
a GPU (throughput does not depend on the weights' values).

The config is draftsmith.tiny_config's (any decoder-only model type of the installed transformers, no code per
family). Every weight of two or more dimensions is drawn from N(0, std²) (std 0.08 makes greedy decoding
decisive on a tiny model: the top logit wins by a clear margin, so engines agree token for token). Seeded from
the demo target (its trained tensors wherever name and shape match), the target's text is predictable where the
family computes as a Llama does; a family whose own layers the demo has no tensors for (latent attention,
experts) is then trained a few minutes on the demo's conversations (`train_steps`), or it repeats one or two
tokens, which any drafter predicts and no lossless check tests.

`python -m draftsmith.random_target MODEL_TYPE DIRECTORY [--seed-from-demo] [--train-steps N] [--released]` writes one
such target with the demo target's tokenizer, ready for `target.name_or_path=DIRECTORY`.
"""

from __future__ import annotations

if __name__ == "__main__":  # run before the imports below (torch's: a second), which the command makes under run_cli
    import importlib

    from draftsmith.errors import run_cli

    # the command is this module by its installed name: nothing below runs in this copy
    run_cli(lambda argv: importlib.import_module("draftsmith.random_target").write_command(argv))

import argparse
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, Optional

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError

from draftsmith.causal_lm import may_be_a_causal_lm, no_causal_lm, register_misfiled_causal_lms, wraps_a_text_model
from draftsmith.errors import UserError, one_line, run_cli
from draftsmith.families import text_config
from draftsmith.files import publish_folder, staging
from draftsmith.outputs import check_output_dir
from draftsmith.text_release import (
    is_a_text_release,
    release_architecture,
    release_config,
    write_release,
    write_release_form,
)
from draftsmith.tiny_config import build_config, tiny_wrapper_config

# The demo target's tokenizer files a random target is given (formats/repo.py's TOKENIZER_FILES: any target's).
RANDOM_TARGET_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)
# what write_random_target writes
TARGET_FILES = frozenset({"config.json", "model.safetensors", *RANDOM_TARGET_TOKENIZER_FILES})
DEMO_CONVERSATIONS = "demo/data/train.jsonl.gz"  # train_on_demo's


class DemoTraining(NamedTuple):
    """train_on_demo's batches and schedule: steps of `rows` conversations' first `tokens` tokens, AdamW's peak
    learning rate `lr` reached after `warmup` steps. Tests train on shorter rows at a higher rate
    (tests/test_gemma4_assistant.py), or on fewer, shorter rows (tests/test_target_matrix.py)."""

    rows: int = 16
    tokens: int = 256
    lr: float = 3e-3
    warmup: int = 20


def demo_tokenizer_dir() -> Path:
    from draftsmith.resources import bundled

    return Path(bundled("demo/target"))


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

    register_misfiled_causal_lms()

    from draftsmith.text_model_lm import built_text_model_lm

    wrapper = wraps_a_text_model(config.to_dict())  # built whole, as draftsmith.target_loading reads one
    text_release = not wrapper and is_a_text_release(config.model_type)  # a wrapper module's text model and lm_head
    if not wrapper and not text_release and not may_be_a_causal_lm(config.model_type):
        raise UserError(f"{no_causal_lm(config.model_type)}: a target of it cannot be built")  # not ~200 classes
    torch.manual_seed(seed)
    with torch.device(device):
        if text_release:
            config.architectures = [release_architecture(config.model_type)]
            model = built_text_model_lm(config, dtype=dtype)
        else:
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


def train_on_demo(model, steps: int, training: DemoTraining = DemoTraining()) -> None:
    """Train every weight of `model` for `steps` steps on the demo's conversations (chat template applied, next-token
    loss on every token; AdamW, a linear warm-up then a linear decay to 0, gradients clipped to norm 1; `training`'s
    batches and rates), as it runs as a target (eval mode: no dropout, routers as at inference): deterministic on one
    machine and thread count."""
    import gzip

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from draftsmith.resources import bundled

    tokenizer = AutoTokenizer.from_pretrained(demo_tokenizer_dir())
    with gzip.open(bundled(DEMO_CONVERSATIONS), "rt") as lines:
        conversations = [json.loads(line)["messages"] for _, line in zip(range(steps * training.rows), lines)]
    rows = [
        tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
        for messages in conversations
    ]
    rows = [row[: training.tokens] for row in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.lr, weight_decay=0.0)
    for step in tqdm(range(steps), desc="training the target on the demo's conversations", unit="step"):
        batch = [rows[(step * training.rows + i) % len(rows)] for i in range(training.rows)]
        width = max(map(len, batch))
        ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in batch])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in batch])
        for group in optimizer.param_groups:
            group["lr"] = training.lr * min(1.0, (step + 1) / training.warmup) * (1 - step / steps)
        model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


def declare_as_released(config, model) -> None:
    """Add the config fields released checkpoints carry for what transformers' class always computes,
    which engines read instead (vLLM routes with a softmax and no bias, or fails on a missing field,
    without them): a router with a score-correction bias scores experts by a sigmoid and picks them
    with the bias (`noaux_tc` where the experts are grouped); the rotary embedding's width (`rotary_dim`,
    which the engines that read it take as transformers' head_dim × partial factor); an embedding normed before the
    layers and scales learned on the MLPs and routers (`use_embed_norm`, `use_global_scale`: vLLM's Inkling builds
    neither without them, transformers' always does); and `release_fields`' (a field the class already has is kept)."""
    if any(name.endswith("e_score_correction_bias") for name, _ in model.named_buffers()) or any(
        name.endswith("e_score_correction_bias") for name, _ in model.named_parameters()
    ):
        config.scoring_func, config.use_routing_bias = "sigmoid", True
        if getattr(config, "n_group", None):
            config.topk_method = "noaux_tc"
    if hasattr(model.get_input_embeddings(), "embed_norm"):
        config.use_embed_norm = True
    if any(name.endswith("global_scale") for name, _ in model.named_parameters()):
        config.use_global_scale = True
    fields = config.to_dict()  # global values: a field set per layer (Gemma-4's head_dim) raises as an attribute
    factor = rotary_share(fields.get("rope_parameters") or {})
    head_dim = fields.get("head_dim")
    if isinstance(head_dim, int) and factor is not None and fields.get("rotary_dim") is None:
        config.rotary_dim = int(head_dim * factor)
    for name, value in release_fields(config, model).items():
        setattr(config, name, value)


def rotary_share(rope: dict[str, Any]) -> Optional[float]:
    """The share of each head the rotary embedding turns (`partial_rotary_factor`, 1 where unset): of the parameters
    themselves, or the one all layer kinds' parameters agree on where they are set per layer kind (MiMo-V2's); None
    where those differ (no one width describes the model)."""
    kinds = [value for value in rope.values() if isinstance(value, dict)]
    shares = {kind.get("partial_rotary_factor", 1.0) for kind in kinds} or {rope.get("partial_rotary_factor", 1.0)}
    return shares.pop() if len(shares) == 1 else None


# Release fields that are another name of a transformers field (MiMo-V2's `layernorm_epsilon`, HY-V3's
# `expert_hidden_dim`; vLLM's HY-V3 and AFMoE read `route_norm` where transformers says `norm_topk_prob`)
RELEASE_NAMES = {
    "layernorm_epsilon": "rms_norm_eps",
    "expert_hidden_dim": "moe_intermediate_size",
    "route_norm": "norm_topk_prob",
}
# Release fields whose value a transformers class fixes in its code, with no field for it, keyed by the field that
# marks such classes: a router scaled by `router_scaling_factor` without a `norm_topk_prob` switch always
# renormalises the chosen experts' weights (HY-V3's, Step-3.7's), which vLLM's HY-V3 reads as `route_norm`
FIXED_IN_CODE = {"router_scaling_factor": {"route_norm": True}}


def release_fields(config, model) -> dict[str, Any]:
    """The fields a release carries in place of transformers' own, derived from what the config and `model` compute,
    each kept only where transformers reading it back builds the same config (`reads_back_alike`): RELEASE_NAMES and
    FIXED_IN_CODE; query-key norms in every attention (`qk_norm`, which transformers' layers always compute); the
    dense layers before the first with experts (`first_k_dense_replace`, of `mlp_layer_types`); the window under the
    name the class reads it from (`sliding_window_size`, by the class's own conversion); and where sliding layers are
    built apart from full ones (`sliding_layers_apart`), the release's per-layer form of them."""
    fields = config.to_dict()
    out: dict[str, Any] = {name: fields[field] for name, field in RELEASE_NAMES.items() if field in fields}
    for field, values in FIXED_IN_CODE.items():
        out |= {name: value for name, value in values.items() if field in fields and name not in out}
    attentions = [module for name, module in model.named_modules() if name.endswith("self_attn")]
    if attentions and all(hasattr(attention, "q_norm") and hasattr(attention, "k_norm") for attention in attentions):
        out["qk_norm"] = True
    kinds = fields.get("mlp_layer_types")
    if isinstance(kinds, list) and "dense" in kinds:
        dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
        if "dense" not in kinds[dense:]:  # dense layers first, then none: what the one number says
            out["first_k_dense_replace"] = dense
    window = fields.get("sliding_window")
    if isinstance(window, int):
        # the class's own name for the window, where it derives `sliding_window` from one (MiMo-V2's: one more)
        read = [size for size in (window, window - 1) if reads_window_as(config, size) == window]
        out |= {"sliding_window_size": read[0]} if read else {}
    out |= sliding_layers_apart(fields, model)
    new = {name: value for name, value in out.items() if name not in fields and not hasattr(config, name)}
    return {name: value for name, value in new.items() if reads_back_alike(config, {name: value})}


def reads_window_as(config, size: int) -> Any:
    """The `sliding_window` transformers' class sets when a release gives `sliding_window_size` = `size` (and some
    other `sliding_window`, which it is then derived from `size` or not at all)."""
    back = read_back(config, {"sliding_window": -1, "sliding_window_size": size})
    return None if back is None else back.sliding_window


def reads_back_alike(config, added: dict[str, Any]) -> bool:
    """Whether transformers reading `config` back with the fields `added` builds the same config (a field it reads
    as another of its own, a legacy `rope_theta` into the rotary parameters, would change the target it runs)."""
    back = read_back(config, added)
    fields = config.to_dict()
    return back is not None and {name: v for name, v in back.to_dict().items() if name not in added} == fields


def read_back(config, changed: dict[str, Any]):
    """`config` as transformers reads it from a config.json with the fields `changed`; None where its class refuses
    them (its own checks of a field's type or range)."""
    try:
        return type(config).from_dict({**config.to_dict(), **changed})
    except (StrictDataclassError, TypeError, ValueError):
        return None


def sliding_layers_apart(fields: dict[str, Any], model) -> dict[str, Any]:
    """Where a family builds its sliding-window layers apart from its full-attention ones (other heads, or attention
    sinks on one kind only: MiMo-V2's twice the key-value heads and sinks), the fields its release describes them by
    (vLLM's MiMo-V2 reads them): each layer's kind (`hybrid_layer_pattern`, 1 for sliding) and MLP (`moe_layer_freq`,
    1 for experts), the sliding layers' heads and sinks (`swa_*`, `add_*_attention_sink_bias`), as the model's
    modules are; the norms' epsilon; and the rotary parameters set per layer kind as fields (`rope_theta`,
    `swa_rope_theta`, their shared `partial_rotary_factor`). Nothing for any other family."""
    kinds, layers = fields.get("layer_types"), getattr(model.base_model, "layers", None)
    if not (isinstance(kinds, list) and {"sliding_attention", "full_attention"} <= set(kinds) and layers is not None):
        return {}
    built = {
        kind: attention_sizes(layers[kinds.index(kind)].self_attn) for kind in ("sliding_attention", "full_attention")
    }
    sliding, full = built["sliding_attention"], built["full_attention"]
    if sliding is None or full is None or sliding == full:
        return {}
    out = {"hybrid_layer_pattern": [int(kind == "sliding_attention") for kind in kinds]}
    if isinstance(fields.get("mlp_layer_types"), list):
        out["moe_layer_freq"] = [int(kind != "dense") for kind in fields["mlp_layer_types"]]
    heads, kv_heads, head_dim, value_dim, sinks = sliding
    out |= {"swa_num_attention_heads": heads, "swa_num_key_value_heads": kv_heads, "swa_head_dim": head_dim}
    out |= {"swa_v_head_dim": value_dim, "add_swa_attention_sink_bias": sinks, "add_full_attention_sink_bias": full[-1]}
    rope = fields.get("rope_parameters") or {}
    if isinstance(rope.get("full_attention"), dict) and isinstance(rope.get("sliding_attention"), dict):
        out |= {
            "rope_theta": rope["full_attention"]["rope_theta"],
            "swa_rope_theta": rope["sliding_attention"]["rope_theta"],
        }
        share = rotary_share(rope)
        out |= {"partial_rotary_factor": share} if share is not None else {}
    return out


def attention_sizes(attention) -> Optional[tuple[int, int, int, int, bool]]:
    """An attention module's query heads, key-value heads, key and value widths and whether it has sinks, as its
    projections are built; None for one without separate query, key and value projections."""
    projections = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    head_dim = getattr(attention, "head_dim", None)
    if not isinstance(head_dim, int) or not all(isinstance(p, torch.nn.Linear) for p in projections):
        return None
    query, key, value = (p.out_features for p in projections)
    kv_heads = key // head_dim
    sinks = any(name.split(".")[-1] in ("sinks", "attention_sink_bias") for name, _ in attention.named_parameters())
    return query // head_dim, kv_heads, head_dim, value // kv_heads, sinks


def write_random_target(
    model_type: str,
    directory: str | Path,
    sliding_window: Optional[int] = 48,
    seed: int = 0,
    seed_from: Optional[str | Path] = None,
    train_steps: int = 0,
    training: DemoTraining = DemoTraining(),
    released: bool = False,
    **shape: Any,
) -> Path:
    """A tiny random target of `model_type` in `directory` (config.json, model.safetensors and the
    demo target's tokenizer and chat template): a local target like any other; trained `train_steps` steps on the
    demo's conversations (train_on_demo, `training`'s batches and rates) before it is written. `released`: a
    vision-language wrapper's model type is written as its releases ship it, the wrapper whole, even where its language
    model alone is a causal LM (tiny_wrapper_config). A text-only release read as a wrapper's text model (Step-3.5's
    step3p5) is always written as its release ships it (draftsmith.text_release)."""
    source = demo_tokenizer_dir()
    demo = json.loads((source / "config.json").read_text())
    special = {key: demo[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    built = release_config if is_a_text_release(model_type) else build_config
    config = built(model_type, demo["vocab_size"], special, sliding_window=sliding_window, **shape)
    config = tiny_wrapper_config(model_type, config, released) or config
    model = build_model(config, seed=seed, seed_from=seed_from)
    if train_steps:
        train_on_demo(model, train_steps, training)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if is_a_text_release(model_type):  # its release's own fields (not the other families' names declared below)
        write_release(model, directory)
    else:
        declare_as_released(text_config(model.config), model)
        model.save_pretrained(directory)
        write_release_form(model.config, directory)  # a release naming another architecture than transformers'
    for name in RANDOM_TARGET_TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
    return directory


def main(argv: Optional[list[str]] = None) -> NoReturn:
    """`python -m draftsmith.random_target ...` from a process that has imported this module, under run_cli as every
    command: a refusal, a full disk or a stop is one line and its exit code (docs/faults.md). `python -m` itself runs
    `write_command` so before this module's imports (its `__main__` block at the top)."""
    run_cli(write_command, argv)


def write_command(argv: list[str]) -> None:
    """Write the target the arguments name into DIRECTORY, whole or not at all (its path alone on stdout)."""
    from draftsmith.cli import configure_logging

    configure_logging()
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
    parser.add_argument(
        "--train-steps",
        type=steps_count,
        default=0,
        help="then train the target this many steps on the demo's conversations (about 100 steps: a family whose "
        "own layers the demo has no tensors for writes varied text, not one repeated token)",
    )
    parser.add_argument(
        "--released",
        action="store_true",
        help="a vision-language wrapper's model type written as its releases ship it, the wrapper whole and its "
        "language model under the release's names",
    )
    args = parser.parse_args(argv)
    directory = Path(args.directory)
    check_target_directory(directory)
    if directory.is_dir() and any(directory.iterdir()):  # what was written there since (an MTP layer) goes with it
        logging.getLogger(__name__).warning("%s held a target: it is replaced by the one written now", directory)
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
                train_steps=args.train_steps,
                released=args.released,
            )
        except SafetensorError as err:  # a full disk under save_pretrained: the OSError it is (files.save_safetensors)
            number = re.search(r"\(os error (\d+)\)", str(err))
            if number is None:
                raise
            raise OSError(int(number[1]), os.strerror(int(number[1])), str(staged / "model.safetensors")) from err
        except (AttributeError, TypeError, ValueError, IndexError, KeyError, StopIteration) as err:
            # the family's own code at a tiny shape (a sub-config it reads a field of that the tiny one lacks)
            raise UserError(f"cannot build a tiny {args.model_type} target: {one_line(err, with_type=True)}") from None
        publish_folder(staged, directory)
    print(directory)


def steps_count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of steps (0 or more)")
    return int(text)


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
