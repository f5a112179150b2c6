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
from typing import Any, NamedTuple, Optional

import torch
from safetensors import SafetensorError

from draftsmith.causal_lm import may_be_a_causal_lm, no_causal_lm, register_misfiled_causal_lms, wraps_a_text_model
from draftsmith.declared_fields import declare_as_released
from draftsmith.errors import Preempted, PreemptedWhereItWas, UserError, one_line, run_cli
from draftsmith.families import text_config
from draftsmith.files import publish_folder, staging
from draftsmith.outputs import check_output_dir
from draftsmith.text_release import (
    RELEASE_WEIGHTS,
    is_a_text_release,
    release_architecture,
    release_config,
    write_release,
    write_release_form,
)
from draftsmith.tiny_config import build_config
from draftsmith.tiny_wrapper import tiny_wrapper_config

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

    from draftsmith.text_model_lm import built_text_model_lm

    wrapper, text_release = built_as(config)
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


def built_as(config) -> tuple[bool, bool]:
    """How build_model builds `config`'s model: (a wrapper, built whole as draftsmith.target_loading reads one; a
    wrapper module's text model and lm_head); a model type with neither and no causal LM class is refused."""
    register_misfiled_causal_lms()
    wrapper = wraps_a_text_model(config.to_dict())
    text_release = not wrapper and is_a_text_release(config.model_type)
    if not wrapper and not text_release and not may_be_a_causal_lm(config.model_type):
        raise UserError(f"{no_causal_lm(config.model_type)}: a target of it cannot be built")  # not ~200 classes
    return wrapper, text_release


def tiny_target_config(model_type: str, sliding_window: Optional[int] = 48, released: bool = False, **shape: Any):
    """The config write_random_target builds its target from (its arguments'), refused as build_model would refuse
    it, before any weight: a command that writes targets of many families checks them all first with it. A model type
    whose releases build weights its class's default leaves out is built with them (RELEASE_WEIGHTS; `shape` wins)."""
    demo = json.loads((demo_tokenizer_dir() / "config.json").read_text())
    special = {key: demo[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    built = release_config if is_a_text_release(model_type) else build_config
    shape = RELEASE_WEIGHTS.get(model_type, {}) | shape
    config = built(model_type, demo["vocab_size"], special, sliding_window=sliding_window, **shape)
    config = tiny_wrapper_config(model_type, config, released) or config
    built_as(config)
    return config


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
    model = build_model(
        tiny_target_config(model_type, sliding_window, released, **shape), seed=seed, seed_from=seed_from
    )
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
    source = demo_tokenizer_dir()
    for name in RANDOM_TARGET_TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
    return directory


def write_command(argv: list[str]) -> None:
    """Write the target the arguments name into DIRECTORY, whole or not at all (its path alone on stdout)."""
    from draftsmith.cli import OneLineArguments, configure_logging

    configure_logging()
    parser = OneLineArguments(prog="python -m draftsmith.random_target", description=__doc__.split("\n\n")[0])
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
    if not args.directory:  # `"$OUT"` with OUT unset: Path("") is the current folder
        raise UserError("DIRECTORY is empty: give the folder to write the target to")
    directory = Path(args.directory).absolute()  # `.` names the current folder: the staging folder goes beside it
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
        except PreemptedWhereItWas:  # its generic line said what was finished was kept, and to resume a training run
            raise Preempted(
                "stopped on SIGTERM; nothing was written (the target is written whole or not at all): run the same "
                "command again, which starts over"
            ) from None
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
