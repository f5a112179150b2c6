"""Random-weight targets of any family transformers implements, built from its config class alone.

Two uses, neither of which may download anything: proving a target family end to end on a CPU (a
few-MB model of the family's real architecture: its layers, norms, attention kinds and chat-template
conventions are what the stages meet), and measuring training throughput at a real model's shape on
a GPU (throughput does not depend on the weights' values).

`build_config(model_type, ...)` goes through `transformers.AutoConfig.for_model`, so any decoder-only
model type of the installed transformers works with no code here; the only per-family knowledge is
the generic spelling of mixture-of-experts sizes, set where the config class has the field.
Every weight of two or more dimensions is drawn from N(0, std²) (std 0.08 makes greedy decoding
decisive on a tiny model: the top logit wins by a clear margin, so engines agree token for token).

`python -m draftsmith.random_target MODEL_TYPE DIRECTORY [--seed-from-demo]` writes one such target
with the demo target's tokenizer, ready for `target.name_or_path=DIRECTORY`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from draftsmith.errors import UserError, one_line

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
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


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
    limited to `sliding_window` positions so that short tests cross the window."""
    from transformers import AutoConfig

    fields = {**TINY, **shape, "vocab_size": vocab_size, **(special or {})}
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except ValueError as err:
        raise UserError(f"transformers has no model type {model_type!r}: {one_line(err)}") from None
    config = getattr(config, "text_config", None) or config  # a multimodal family: its language model
    for key, value in EXPERTS.items():
        if hasattr(config, key) and key not in shape:
            setattr(config, key, value)
    for key in EXPERTS.keys() & shape.keys():  # again: a field may be an alias of another (num_experts)
        setattr(config, key, shape[key])
    if sliding_window is not None and getattr(config, "sliding_window", None) is not None:
        config.sliding_window = sliding_window
    config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return config


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
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for parameter in model.parameters():
        if parameter.dim() >= 2:
            parameter.normal_(0.0, std)
    if seed_from is not None:
        seed_weights(model, Path(seed_from))
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
    model = build_model(config, seed=seed, seed_from=seed_from)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
    return directory


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    try:
        path = write_random_target(
            args.model_type,
            args.directory,
            args.sliding_window,
            args.seed,
            seed_from=demo_tokenizer_dir() if args.seed_from_demo else None,
        )
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
