"""Where two greedy outputs of one prompt part, and whether rounding explains it.

A format with few significant bits (bfloat16 keeps 8) computes the same logits differently in a verify
forward over several tokens, a decode step over one, or a batch of another shape: they differ by a few of its
units at the logits' magnitude, and a greedy choice between two tokens that close can go either way. A
rollback or a misread state parts the outputs wherever it lands, mostly far from such ties (the tiny hybrid
targets' partings in bfloat16: docs/targets-matrix.md). float32 leaves no such excuse: there every parting fails.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

BF16_UNIT = 2.0**-8  # half of bfloat16's spacing at 1: its rounding unit
NEAR_TIE_UNITS = 8  # a gap within this many rounding units at the logits' magnitude is a near tie


def rounding_unit(dtype: torch.dtype) -> Optional[float]:
    """The rounding unit of a model computing in `dtype`, None for float32 and wider (every parting fails)."""
    return torch.finfo(dtype).eps / 2 if torch.finfo(dtype).bits < 32 else None


def parting(model, prompt: list[int], reference: list[int], tokens: list[int], unit: float) -> dict[str, Any]:
    """Where `tokens` part from `reference` (both greedy outputs of `prompt`): the position, the two tokens and
    their gap in `model`'s logits at the common prefix, absolute and in `unit`s at the largest logit's magnitude
    (`near_tie`: within NEAR_TIE_UNITS). Outputs of different lengths that agree where both run part at the
    shorter one's end, which no rounding of one choice explains: not a near tie."""
    position = next((k for k, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    row: dict[str, Any] = {"position": position, "near_tie": False}
    if position < min(len(tokens), len(reference)):
        device = next(model.parameters()).device
        with torch.no_grad():
            logits = model(torch.tensor([prompt + reference[:position]], device=device)).logits[0, -1].float()
        gap = abs(logits[tokens[position]] - logits[reference[position]]).item()
        units = gap / (unit * logits.abs().max().item())
        row |= {"tokens": [tokens[position], reference[position]], "gap": round(gap, 5), "units": round(units, 2),
                "near_tie": units <= NEAR_TIE_UNITS}  # fmt: skip
    return row
