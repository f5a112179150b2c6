"""The frozen target: load any HF causal LM (local path or Hub id) and run it for the features a
drafter asks for.

Layer index convention (used by every drafter and, later, by feature shards): layer `i` means the
*output* of decoder layer i (0-based), i.e. `hidden_states[i + 1]` of transformers'
`output_hidden_states`; `-1` means the embeddings (`hidden_states[0]`). The `final` feature is the
last hidden state after the final norm, the input of the lm_head. Caveat: transformers returns the
*normed* state as `hidden_states[L]`, so layer L-1 is the same tensor as `final`, not the raw output
of the last decoder layer (EAGLE-3's default layers 1, L//2-1, L-4 never touch it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

from draftsmith.errors import UserError, one_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`auto` is float32 on CPU (bf16 matmuls are slow there) and bfloat16 on a GPU."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"target.dtype={name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} asked for but no CUDA device is available")
    return device


def target_section(target: Any) -> Any:
    """The recipe's `target` section, or a plain path / Hub id standing for one with the defaults."""
    if isinstance(target, (str, os.PathLike)):
        return SimpleNamespace(name_or_path=str(target), revision=None, dtype="auto", trust_remote_code=False)
    return target


def load_tokenizer(section):
    """The target's tokenizer, from the recipe's `target` section (or a path)."""
    from transformers import AutoTokenizer

    section = target_section(section)
    try:
        tokenizer = AutoTokenizer.from_pretrained(section.name_or_path, revision=section.revision, trust_remote_code=section.trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load the tokenizer of {section.name_or_path!r}: {one_line(err)}") from None
    if tokenizer.pad_token_id is None:
        # Padding positions are masked out everywhere; any id works, EOS is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_target(section, device: torch.device | str = "cpu"):
    """The target causal LM from the recipe's `target` section (or a path), frozen: eval mode, no
    parameter requires grad."""
    from transformers import AutoModelForCausalLM

    section = target_section(section)
    torch_dtype = resolve_dtype(section.dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            section.name_or_path, revision=section.revision, dtype=torch_dtype, trust_remote_code=section.trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load target {section.name_or_path!r}: {one_line(err)}") from None
    model.to(device)
    return freeze(model)


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def target_id(name_or_path: str) -> str:
    """A stable name for the target: the Hub id, or the directory's name for a local path."""
    path = Path(name_or_path)
    return path.resolve().name if path.exists() else name_or_path


@dataclass(frozen=True)
class TargetShape:
    """What a drafter must agree on with its target; stored in every checkpoint, feature capture
    and export, and checked wherever two of them meet."""

    name_or_path: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int

    @classmethod
    def of(cls, model, name_or_path: str) -> TargetShape:
        """A loaded target's shape (the vocabulary is the lm_head's rows, which may be padded)."""
        shape = cls.from_config(model.config, name_or_path)
        vocab = int(model.get_output_embeddings().weight.shape[0])
        return cls(**{**shape.__dict__, "vocab_size": vocab})

    @classmethod
    def from_config(cls, config: Any, name_or_path: str) -> TargetShape:
        """From an HF config object or its dict form (a target's config.json)."""
        get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
        text = get("text_config")  # multimodal wrappers keep the language model's shape here
        if text is not None and get("hidden_size") is None:
            return cls.from_config(text, name_or_path)
        return cls(
            name_or_path=str(name_or_path),
            model_type=str(get("model_type")),
            hidden_size=int(get("hidden_size")),
            vocab_size=int(get("vocab_size")),
            num_hidden_layers=int(get("num_hidden_layers")),
        )

    @property
    def id(self) -> str:
        return target_id(self.name_or_path)


def local_target_shape(name_or_path: str) -> Optional[TargetShape]:
    """The shape of a target in a local directory, read from its config.json alone (no weights, no
    network); None for a Hub id or a directory without a readable config."""
    path = Path(name_or_path) / "config.json"
    if not path.is_file():
        return None
    try:
        return TargetShape.from_config(json.loads(path.read_text()), name_or_path)
    except (ValueError, TypeError, KeyError):
        return None


@dataclass
class FeatureRequest:
    """What a drafter needs from the target's forward pass."""

    final: bool = True  # last hidden state after the final norm (lm_head input)
    layers: tuple[int, ...] = ()  # outputs of these decoder layers (see the module docstring)
    logits: bool = False  # the target's next-token distribution (soft targets for distillation)


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T, V]
    final: torch.Tensor  # [B, T, H], post-norm last hidden state
    layers: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [B, T, H]
    past_key_values: object = None


def num_layers(model) -> int:
    return int(model.config.num_hidden_layers)


def check_layers(model, layers: Sequence[int]) -> None:
    count = num_layers(model)
    for layer in layers:
        if not -1 <= layer < count:
            raise UserError(f"layer id {layer} is out of range for a target with {count} layers (valid: -1..{count - 1})")


def run_target(
    model,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    request: FeatureRequest = FeatureRequest(),
    position_ids: Optional[torch.Tensor] = None,
    past_key_values=None,
    use_cache: bool = False,
) -> TargetOutput:
    """One forward of the target returning logits, the final hidden state and requested layers."""
    want_layers = bool(request.layers)
    outputs = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        output_hidden_states=True,
        return_dict=True,
    )
    hidden_states = outputs.hidden_states
    layers = {layer: hidden_states[layer + 1] for layer in request.layers} if want_layers else {}
    return TargetOutput(
        logits=outputs.logits,
        final=hidden_states[-1],
        layers=layers,
        past_key_values=outputs.past_key_values if use_cache else None,
    )
