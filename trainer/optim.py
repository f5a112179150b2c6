"""The drafter's optimizer (`train.optimizer`): AdamW, or Muon on the hidden layers' weight matrices
with AdamW on everything else.

Muon (torch.optim.Muon) orthogonalises each 2-D weight's momentum update by a Newton-Schulz
iteration. As its authors and speculators (whose default it is for drafters) use it, it takes the
matrices of hidden layers only: norms, biases, embeddings and output heads (any parameter whose name
holds one of the kind's `Drafter.NOT_HIDDEN`, `lm_head` and `embed` by default) stay with AdamW.
`adjust_lr_fn="match_rms_adamw"` scales its update to AdamW's RMS, so one `train.lr` serves both. Measured
for #38 on the demo target (docs/comparing.md, own eval on MT-bench at the same token budget): draftsmith's
EAGLE-3.1 at one conversation per step (2,000 steps) τ 1.287 with Muon against 1.241 with AdamW,
speculators' own trainer 1.241 against 1.213; at 8 conversations per step (250 steps) Muon cost 4.5%.
Not the default: it pays with many small steps.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.errors import UserError

FUSED_ADAMW_DEVICES = ("cuda", "cpu")  # where torch.optim.AdamW(fused=True) runs floating-point parameters


def is_hidden_matrix(name: str, parameter: nn.Parameter, not_hidden: tuple[str, ...]) -> bool:
    """Whether Muon takes `parameter`: a 2-D weight of a hidden layer (no [1, N] or [N, 1] vector), not an embedding
    or output head (a name holding a fragment of `not_hidden`, the kind's Drafter.NOT_HIDDEN)."""
    return parameter.ndim == 2 and min(parameter.shape) > 1 and not any(part in name for part in not_hidden)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on `muon_groups`, AdamW on `adamw_groups`, as one optimizer: `param_groups` are the two
    optimizers' own group dicts (a learning-rate schedule sets both), `state_dict` holds both."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], lr: float, betas, weight_decay: float):
        self.muon = torch.optim.Muon(muon_groups, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        # none where every trainable parameter is a hidden matrix (torch refuses an optimizer of no parameters)
        self.adamw = (
            torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, weight_decay=weight_decay) if adamw_groups else None
        )
        super().__init__([dict(group) for group in self.muon.param_groups + self.adamw_groups()], {"lr": lr})
        self.share_groups()

    def adamw_groups(self) -> list[dict]:
        return self.adamw.param_groups if self.adamw is not None else []

    def share_groups(self) -> None:
        """`param_groups` := the two optimizers' own group dicts, which a schedule then sets."""
        self.param_groups = self.muon.param_groups + self.adamw_groups()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonWithAdamW.step takes no closure")
        self.muon.step()
        if self.adamw is not None:
            self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict() if self.adamw is not None else None}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state_dict["adamw"])
        # torch's load_state_dict gives each optimizer new group dicts (accelerate loads one when it
        # places the state on the device): point at those, or the schedule would set stale ones
        self.share_groups()


def build_optimizer(train, drafter: nn.Module, deepspeed: bool) -> torch.optim.Optimizer:
    """`train.optimizer` over the drafter's parameter groups (`param_groups`: each group's lr is
    train.lr times its scale)."""
    groups = [{"params": params, "lr": train.lr * scale} for params, scale in drafter.param_groups()]
    betas = tuple(train.adam_betas)
    if train.optimizer == "adamw":
        # One fused kernel for every parameter instead of a few per tensor, on CUDA and on a CPU (torch's fused
        # CPU AdamW: Medusa's 9 tensors step in a fifth of the time); DeepSpeed wraps its own.
        fused = not deepspeed and all(
            p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for group in groups for p in group["params"]
        )
        return torch.optim.AdamW(groups, lr=train.lr, betas=betas, weight_decay=train.weight_decay, fused=fused)
    if deepspeed:
        raise UserError(
            "train.optimizer=muon runs under DDP or one process; DeepSpeed builds its own optimizer (use adamw)"
        )
    names = {id(parameter): name for name, parameter in drafter.named_parameters()}
    split = {True: [], False: []}
    for group in groups:
        for muon in (True, False):
            params = [p for p in group["params"] if is_hidden_matrix(names[id(p)], p, drafter.NOT_HIDDEN) == muon]
            if params:
                split[muon].append({**group, "params": params})
    if not split[True]:
        raise UserError("train.optimizer=muon: this drafter has no hidden weight matrix for Muon (use adamw)")
    return MuonWithAdamW(split[True], split[False], train.lr, betas, train.weight_decay)
