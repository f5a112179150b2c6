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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from draftsmith.errors import UserError

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


def load_tokenizer(name_or_path: str, revision: Optional[str] = None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load the tokenizer of {name_or_path!r}: {' '.join(str(err).split())[:300]}") from None
    if tokenizer.pad_token_id is None:
        # Padding positions are masked out everywhere; any id works, EOS is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_target(
    name_or_path: str,
    revision: Optional[str] = None,
    dtype: str = "auto",
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
):
    """Load the target causal LM frozen: eval mode, no parameter requires grad."""
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, revision=revision, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load target {name_or_path!r}: {' '.join(str(err).split())[:300]}") from None
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
