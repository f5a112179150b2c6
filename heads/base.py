"""The drafter contract. Every drafter architecture is one file in heads/ implementing `Drafter`.

A drafter says
- which target outputs it needs (`features`, a FeatureRequest),
- how to build itself for a target (`from_target`, e.g. copying the target's lm_head),
- its training loss and metrics from a batch plus the target's outputs (`loss`),
- how to propose tokens at decode time (`propose`, a chain or a tree; `default_tree` says which tree),
- and it saves/loads as `config.json` + `model.safetensors` (`save_pretrained`, `load_drafter`);
  target modules it shares but does not save (EAGLE's embedding and lm_head) are re-attached on
  load (`attach_target`).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar, Optional, Sequence, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from draftsmith.errors import UserError
from draftsmith.target import FeatureRequest, TargetOutput

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TargetShape:
    """What a drafter must agree on with its target; stored in every checkpoint and checked on load."""

    name_or_path: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int

    @classmethod
    def of(cls, model, name_or_path: str) -> "TargetShape":
        config = model.config
        return cls(
            name_or_path=str(name_or_path),
            model_type=str(config.model_type),
            hidden_size=int(config.hidden_size),
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            num_hidden_layers=int(config.num_hidden_layers),
        )


@dataclass
class DraftState:
    """What the decode loop knows when it asks for a proposal.

    `tokens` are all committed tokens; the last one (the root) came from the target's own
    distribution and is verified by construction. `final`/`layers` are the target's hidden states
    at the position *before* the root, i.e. the position whose logits produced the root.

    Drafters with their own KV cache over the sequence (EAGLE) also need the target's hidden states
    at every committed position they have not seen yet: `new_final` / `new_layers` hold them for the
    last m positions before the root (positions len(tokens)-1-m .. len(tokens)-2; the last row is
    `final`), i.e. everything committed since this sequence's previous proposal, the whole prompt but
    its last token at the first one. `fresh` marks that first proposal of a new sequence: state kept
    from an earlier sequence must be dropped. A drafter that reads only `final` ignores all three.
    """

    tokens: torch.Tensor  # [n] long
    final: torch.Tensor  # [H]
    layers: dict[int, torch.Tensor]
    new_final: Optional[torch.Tensor] = None  # [m, H]
    new_layers: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [m, H]
    fresh: bool = True


@dataclass(frozen=True)
class DynamicTree:
    """A tree that the drafter grows per step from its own scores (EAGLE-2), as opposed to a static
    tree given as paths: up to `nodes` nodes, at most `depth` deep, expanding `topk` children of the
    `topk` best nodes per step. `default_tree` returns one from drafters that draft this way."""

    nodes: int
    depth: int
    topk: int

    def cut(self, max_depth: int) -> "DynamicTree":
        return replace(self, depth=min(self.depth, max_depth))


# A tree request: a static tree as paths of per-depth candidate ranks (parents first), or a DynamicTree.
Tree = Union[Sequence[tuple[int, ...]], DynamicTree]


@dataclass
class DraftTree:
    """A proposal: node i holds `tokens[i]` and hangs below `parents[i]` (-1 = the root token).

    A chain is the tree with parents [-1, 0, 1, ...]. Parents always precede their children.
    `probs[i]` is the draft distribution node i's token was sampled from; None means the drafter
    is deterministic (q is one-hot on the proposed token), which the exact sampling rule relies on.
    """

    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long
    probs: Optional[torch.Tensor] = None  # [N, V] float

    @classmethod
    def chain(cls, tokens: torch.Tensor, probs: Optional[torch.Tensor] = None) -> "DraftTree":
        parents = torch.arange(-1, len(tokens) - 1, device=tokens.device)
        return cls(tokens=tokens, parents=parents, probs=probs)

    def __len__(self) -> int:
        return int(self.tokens.numel())


class Drafter(nn.Module):
    """Base class of all trainable drafters."""

    type: ClassVar[str]  # registry key, the recipe's drafter.type
    Config: ClassVar[type]  # a dataclass: the schema of the recipe's drafter section

    def __init__(self, config, target: TargetShape):
        super().__init__()
        self.config = config
        self.target = target

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, config, target_model, name_or_path: str) -> "Drafter":
        """A fresh drafter for this target, initialised from the target's weights where it helps."""
        raise NotImplementedError

    # -- training -------------------------------------------------------------------------------
    @property
    def features(self) -> FeatureRequest:
        raise NotImplementedError

    def forward(self, batch: dict, target_out: TargetOutput) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # Training calls the module (not .loss) so DDP/DeepSpeed wrappers see the forward.
        return self.loss(batch, target_out)

    def loss(self, batch: dict, target_out: TargetOutput) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Scalar loss, and per-sample statistics `name -> [B, 2]` (sum, count) for any metric.

        Returning sums and counts per sample lets the trainer average over tokens across ranks
        and break every metric down by the batch's `domain`.
        """
        raise NotImplementedError

    # -- decoding -------------------------------------------------------------------------------
    max_chain: ClassVar[Optional[int]] = None  # longest chain it can propose (None: unlimited)

    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        """A chain of `num_tokens` tokens, or (if the drafter supports it) a tree: the `tree` its
        `default_tree` returned, possibly cut to a smaller depth by the decode loop."""
        raise NotImplementedError

    def set_sampling(self, temperature: float) -> None:
        """Told the eval's sampling temperature before decoding. Deterministic drafters ignore it;
        a stochastic drafter samples its proposals from q at this temperature and returns q."""

    def default_tree(self, size: int) -> Tree:
        """The drafter's tree of about `size` nodes (eval.tree): static paths or a DynamicTree."""
        raise UserError(f"drafter {self.type!r} does not propose trees; set eval.tree=0")

    def param_groups(self) -> list[tuple[list[nn.Parameter], float]]:
        """The trainable parameters as (parameters, learning-rate scale) groups; train.lr times the
        scale is each group's peak rate. Default: everything that requires grad, at train.lr."""
        return [([p for p in self.parameters() if p.requires_grad], 1.0)]

    def prepare(self, dataset) -> None:
        """Called once on every rank before training with the training set (rows holding at least
        `input_ids` and `loss_mask`): fit what depends on the data rather than on the target
        (EAGLE-3's draft vocabulary). What it fits must live in the state dict, so that a checkpoint
        (and a resumed run) carries it."""

    def verifier(self, target_model):
        """The model that verifies this drafter's proposals at decode time: the target itself, unless
        the drafter trained adapters into it (Medusa-2 verifies with its LoRA-adapted target)."""
        return target_model

    def attach_target(self, target_model) -> None:
        """Re-attach frozen target modules the drafter uses but does not own or save (EAGLE's token
        embedding and lm_head); `from_target` and `load_drafter(..., target_model=)` call it."""

    # -- files ----------------------------------------------------------------------------------
    def extra_config(self) -> dict:
        """Facts learned in training that decoding uses (e.g. per-head accuracy); saved in config.json."""
        return {}

    def load_extra_config(self, saved: dict) -> None:
        """Read back what `extra_config` wrote."""

    def calibrate(self, summary: dict[str, float]) -> None:
        """Given eval-split metric means after training, keep what decoding can use (default: nothing)."""

    def save_pretrained(self, directory: str | os.PathLike, state_dict: Optional[dict] = None) -> None:
        """Write config.json + model.safetensors. `state_dict` is given when it was gathered from
        shards (ZeRO-3/FSDP); otherwise the module's own is used."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state_dict = self.state_dict() if state_dict is None else state_dict
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in state_dict.items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        config = {
            "draftsmith_format": FORMAT_VERSION,
            "drafter_type": self.type,
            "drafter": asdict(self.config),
            "target": asdict(self.target),
            **self.extra_config(),
        }
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def per_sample_stats(values: dict[str, torch.Tensor], rows: torch.Tensor, batch_size: int) -> dict[str, torch.Tensor]:
    """Per-position metric values -> `name -> [B, 2]` (sum, count) per sample, the shape `loss`
    returns; `rows[i]` is the sample position i belongs to."""
    ones = torch.ones(rows.shape[0], device=rows.device)
    counts = torch.zeros(batch_size, device=rows.device).index_add_(0, rows, ones)
    return {
        name: torch.stack([torch.zeros(batch_size, device=rows.device).index_add_(0, rows, value.float()), counts], dim=-1)
        for name, value in values.items()
    }


def config_from_dict(config_cls: type, values: dict):
    known = {f.name for f in fields(config_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"drafter config has unknown key(s) {unknown} for type {values.get('type')!r}")
    return config_cls(**values)


def load_drafter(directory: str | os.PathLike, target: Optional[TargetShape] = None, target_model=None) -> Drafter:
    """Load a checkpoint written by `save_pretrained`; refuse one made for a different target.
    With `target_model` the drafter gets the target modules it shares re-attached (`attach_target`)."""
    from heads import drafter_class

    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    if not config_path.is_file() or not weights_path.is_file():
        raise UserError(f"{directory} is not a drafter checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    try:
        saved = json.loads(config_path.read_text())
        cls = drafter_class(saved["drafter_type"])
        config = config_from_dict(cls.Config, saved["drafter"])
        saved_target = TargetShape(**saved["target"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{config_path}: corrupt drafter config ({type(err).__name__}: {err})") from None
    if target is not None:
        for key in ("hidden_size", "vocab_size"):
            mine, theirs = getattr(saved_target, key), getattr(target, key)
            if mine != theirs:
                raise UserError(
                    f"drafter {directory} was trained for target {saved_target.name_or_path!r} with {key}={mine}, "
                    f"but the target {target.name_or_path!r} has {key}={theirs}"
                )
    drafter = cls(config, saved_target)
    if target_model is not None:  # before loading: a drafter may hold weights inside the target (Medusa-2's LoRA)
        drafter.attach_target(target_model)
    try:
        state = load_file(str(weights_path))
    except (SafetensorError, OSError) as err:
        raise UserError(f"{weights_path}: corrupt weights file ({' '.join(str(err).split())})") from None
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"{weights_path}: weights do not match a {cls.type} drafter (missing {missing[:3]}, unexpected {unexpected[:3]})")
    drafter.load_extra_config(saved)
    return drafter
