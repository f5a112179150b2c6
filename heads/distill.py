"""Knowledge-distillation losses between a teacher distribution p (the target) and a student q (a
draft model), as pure functions of logits [N, V] -> per-row values [N].

Both sides are softened by the same `temperature` (p = softmax(teacher / T), q = softmax(student / T));
no T^2 factor is applied, so each value is the divergence of the tempered distributions themselves.
Every term is computed from log_softmax, so rows where p or q underflow to 0 stay finite
(0 * log 0 is taken as 0).

- forward KL(p || q) = sum p (log p - log q): mass-covering, the usual KD loss;
- reverse KL(q || p) = sum q (log q - log p): mode-seeking;
- total variation TV(p, q) = 1/2 sum |p - q|: speculative sampling accepts a token drawn from q with
  probability exactly 1 - TV(p, q) (Leviathan et al., 2023), so minimising TV maximises acceptance.

Teacher logits captured as top-k (data_prep.capture logits=topk) are -inf outside the top k, so p = 0
there: forward KL and TV stay finite, reverse KL is infinite wherever q puts mass outside the top k
(capture logits=full for rkl).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

KINDS = ("fkl", "rkl", "tvd")
LOSSES = KINDS + ("mix",)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row; terms where a = 0 contribute 0 even if log a or log b is -inf there (the
    log-ratio is zeroed before the product, so neither the value nor its gradient becomes nan)."""
    a = log_a.exp()
    return (a * torch.where(a > 0, log_a - log_b, torch.zeros_like(a))).sum(-1)


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return _kl(
        F.log_softmax(teacher_logits.float() / temperature, -1), F.log_softmax(student_logits.float() / temperature, -1)
    )


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return _kl(
        F.log_softmax(student_logits.float() / temperature, -1), F.log_softmax(teacher_logits.float() / temperature, -1)
    )


def total_variation(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    p = F.softmax(teacher_logits.float() / temperature, -1)
    q = F.softmax(student_logits.float() / temperature, -1)
    return 0.5 * (p - q).abs().sum(-1)


TERMS = {"fkl": forward_kl, "rkl": reverse_kl, "tvd": total_variation}


def divergences(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, names: Sequence[str] = KINDS
) -> dict[str, torch.Tensor]:
    """The terms `names` per row (all three unless told): {"fkl", "rkl", "tvd"} -> [N]."""
    return {name: TERMS[name](student_logits, teacher_logits, temperature) for name in names}


def loss_terms(kind: str, mix_weights: Sequence[float] = (1.0, 0.0, 0.0)) -> tuple[str, ...]:
    """The terms `distill_loss` reads for `kind`."""
    if kind == "mix":
        return tuple(name for name, weight in zip(KINDS, mix_weights) if weight != 0)
    return (kind,)


def distill_loss(
    terms: dict[str, torch.Tensor], kind: str, mix_weights: Sequence[float] = (1.0, 0.0, 0.0)
) -> torch.Tensor:
    """The per-row loss of `kind` from `divergences`' output; `mix` weighs fkl, rkl, tvd in that order."""
    if kind == "mix":  # zero-weight terms are left out: 0 * inf (rkl on top-k teachers) would be nan
        return sum(weight * terms[name] for name, weight in zip(KINDS, mix_weights) if weight != 0)
    return terms[kind]
