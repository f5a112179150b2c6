"""The drafter contract. Every drafter architecture is one file in heads/ with two sides, and its Config beside it.

Training side, `Drafter` (an nn.Module) and its `Config` (a dataclass: the recipe's drafter section, in
heads/<kind>_config.py, which imports no torch: heads/config.py):
- `Config.check(target)`: one-line errors for bad settings, before any model or data is touched
  (`target` is the target's shape when it is known from its config.json alone, else None);
- `features(config, target)`: which target outputs it trains and drafts from (a FeatureRequest),
  answered from the config and the target's shape alone (capture asks it without building a model);
- `for_target(config, target, target_config)`: the config with what it leaves to the target's layer kinds
  resolved as `from_target` resolves it (a hybrid target's default taps), for a stage that builds no drafter;
- `max_chain(config)`: the longest chain it can propose (None: any), checked against eval settings;
- `from_target`: a fresh drafter for a loaded target; `attach_target`: re-attach frozen target
  modules it uses but does not own or save (EAGLE's embedding and lm_head);
- `prepare(dataset)`: fit what depends on the training data rather than on the target;
- `loss(batch, target_out)`: `(loss_sum, count, stats)`: the loss *summed* over the tokens it scores,
  its normaliser `count` (= `loss_tokens(batch)`) and per-sample (per-document) metric statistics, for
  padded and packed batches alike (heads/packing.py). See "The loss contract" below;
- `loss_tokens(batch)`: that normaliser from the batch alone (with its `host_fields`), computable on the host
  before the batch moves to the device (the trainer counts a whole optimizer step before its first forward);
- `host_fields(batch)`: what `loss` reads of the batch as host values, counted there before the batch
  moves to the device (none by default; DFlash's blocks per row), which every caller of `loss` adds;
- `param_groups()`: the trainable parameters with learning-rate scales.

Decoding side, `Proposer` (heads/proposer.py): built by `drafter.proposer(temperature)`, it holds one
sequence's drafting state (a KV cache, a random stream) and proposes a chain or a tree of tokens per decode
cycle. The eval loop (eval/loop.py) knows only this side.

The loss contract (split invariance). A drafter's loss is a sum over the batch's documents, never a
mean over the micro-batch: `loss_sum` = sum over every scored token of its weighted loss (a head's or a
TTT step's weight multiplies each of its token losses, as before), and `count` = `loss_tokens(batch)`,
by default the batch's supervised tokens, `loss_mask.sum()`. Both are sums over documents, so the
trainer's objective for an optimizer step, sum(loss_sum) / sum(count) over every micro-batch of every
rank, and its gradient do not depend on how the step's conversations are split into micro-batches,
accumulation steps, ranks or packed rows (tests/test_split_invariance.py). The normaliser is the
supervised tokens rather than the tokens each head or step scores: those are (nearly) the same
positions for the first head or step and a subset for later ones, so a per-token loss keeps the scale
of the earlier sum of per-head means (`max_grad_norm` and the learning rate keep their meaning), and a
count that depends on the drafter's outputs (EAGLE-3 leaves out positions whose target argmax is
outside its draft vocabulary) could not be known before the forward. A kind whose unit of training is
not a token overrides `loss_tokens` (DFlash counts its blocks: heads/dflash.py).

Files: `save_pretrained` writes config.json + model.safetensors; `load_drafter` reads them back and
refuses a checkpoint made for another target. What a drafter learned from data or training that
decoding uses (draft-vocabulary coverage) lives in one place, `learned`, saved under its own key in
config.json, never in the config schema. The eval split's measured accuracy joins `learned` in memory
only: the eval writes it to its own file and the eval and export read it from there (eval/accuracy.py).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from draftsmith.errors import UserError, one_line
from draftsmith.files import read_json, require_readable, write_text_atomic
from draftsmith.heads.config import DrafterConfig
from draftsmith.heads.proposer import Proposer
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DRAFTER_DIR = "drafter"  # a training checkpoint's drafter (the folder init_from or eval reads)
FORMAT_VERSION = 2  # 2: learned facts under "learned" (1 kept them in the drafter config)
# `learned` key (in memory, never in a checkpoint) for the trained drafter's eval-split metric means
# (`head2/top1`, `step1/top1`, ...), read from the eval's eval_accuracy.json (see eval/accuracy.py).
EVAL_SPLIT_METRICS = "eval_split_metrics"


@dataclass(frozen=True)
class FlopProfile:
    """How a training step runs a drafter's trainable parameters per token: `passes` forwards and
    backwards, but for the parameters whose names start with one of `once`, which run once per token
    whatever the passes (a layer fusing the target's states before an unrolled one)."""

    passes: int = 1
    once: tuple[str, ...] = ()


class Drafter(nn.Module):
    """The training side of a drafter."""

    type: ClassVar[str]  # registry key, the recipe's drafter.type
    Config: ClassVar[type]  # a DrafterConfig dataclass: the schema of the recipe's drafter section
    # The engines (export.engines values) that verify what the eval measures, per eval method (chain, tree;
    # none: draftsmith's eval only), where the export serves the drafter: the eval's report names those whose
    # export does not refuse its config and target (eval/methods.py), as the README's matrix says per kind.
    # vLLM 0.32 verifies chains only; SGLang EAGLE trees. A "tree" key says the kind proposes trees
    # (proposes_trees), with () where no engine verifies them. An engine named needs the kind's export format
    # (formats/<kind>.py), so a new kind starts as what it is until it has one: chains, draftsmith's eval only.
    SERVED_BY: ClassVar[dict[str, tuple[str, ...]]] = {"chain": ()}
    TITLE: ClassVar[str]  # how people name the kind (the model card's title: "EAGLE-3")
    # Whether its proposer samples each draft from q = softmax(logits / T) at temperature > 0 and the ratio test
    # reads that q (else it drafts its argmax, q one-hot): the export serves the same drafting (formats/repo.py).
    SAMPLES_DRAFTS: ClassVar[bool] = False
    # The name of its loss's statistic for the teacher-forced top-1 at draft depth `depth` (1 first),
    # which the held-out evaluation chains into tau_est and curve.json plots (trainer/curve.py).
    DEPTH_TOP1: ClassVar[str] = "step{depth}/top1"
    # Fragments of the names of its embeddings and output heads: train.optimizer=muon leaves a parameter whose name
    # holds one to AdamW, as every other parameter but a hidden layer's weight matrix (trainer/optim.py)
    NOT_HIDDEN: ClassVar[tuple[str, ...]] = ("lm_head", "embed")
    # Bytes of [rows, vocabulary] float32 logits a loss over a vocabulary holds at once (heads/vocab_loss.py);
    # the trainer sets it from train.vocab_chunk_mb.
    loss_chunk_bytes: int = 256 << 20
    # The attribute holding the blocks its forward runs again and again (an nn.ModuleList: the draft layer run once per
    # training-time-test step), which train.compile_drafter compiles one by one (draftsmith/compiled_layers.py);
    # None: the kind offers none, and the setting is refused at recipe validation.
    COMPILED_BLOCKS: ClassVar[Optional[str]] = None

    @classmethod
    def unshardable(cls, config) -> Optional[str]:
        """Why this kind cannot train against a target sharded over ranks (target.shard=fsdp), or None
        when it can (draftsmith/sharding.py asks)."""
        return None

    def untrainable_on(self, device: torch.device) -> Optional[str]:
        """Why this drafter cannot train on `device` (None: it can), asked before a run writes anything."""
        return None

    def __init__(self, config, target: TargetShape):
        super().__init__()
        config.check(target)
        self.config = config
        self.target = target
        self.learned: dict[str, Any] = {}  # facts learned from data or training that decoding uses
        # The optimizer step being trained, set by the trainer before each step: a schedule inside a loss
        # (Medusa-2's heads ramp) reads it, so it is the same however the step is split (micro-batches,
        # accumulation, ranks), and a resume continues it from the run's own step.
        self.optimizer_step = 0

    # -- what it needs and can do, from the config alone ---------------------------------------
    @classmethod
    def features(cls, config, target: TargetShape) -> FeatureRequest:
        raise NotImplementedError

    @classmethod
    def for_target(cls, config, target: TargetShape, target_config: Any):
        """`config` with what it leaves to the target's layer kinds resolved for this target (`target_config`: its
        HF config) as `from_target` resolves it (a default tap moved onto a hybrid target's attention layers), so
        `features` answers what a built drafter reads for a stage that builds none
        (data_prep/speculators_features.py). By default `config` itself: nothing depends on the layer kinds."""
        return config

    @classmethod
    def max_chain(cls, config) -> Optional[int]:
        """The longest chain it proposes (None: unlimited)."""
        return None

    @classmethod
    def proposes_trees(cls, config) -> bool:
        """Whether its proposer grows trees (eval.tree > 0), or proposes chains only: by default whether SERVED_BY
        has a "tree" key; a kind whose trees depend on its config overrides it. The recipe check refuses
        eval.tree > 0 for a drafter that proposes chains only, before any model loads (draftsmith/recipe.py)."""
        return "tree" in cls.SERVED_BY

    @classmethod
    def flop_profile(cls, config) -> FlopProfile:
        """How a training step runs its parameters per token, which the trainer's FLOP count behind MFU
        reads (trainer/observe.py): by default each once."""
        return FlopProfile()

    @property
    def request(self) -> FeatureRequest:
        return type(self).features(self.config, self.target)

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, config, target_model, name_or_path: str) -> Drafter:
        """A fresh drafter for this target, initialised from the target's weights where it helps."""
        raise NotImplementedError

    def attach_target(self, target_model) -> None:
        """Re-attach frozen target modules the drafter uses but does not own or save; `from_target`
        and `load_drafter(..., target_model=)` call it."""

    # -- training -------------------------------------------------------------------------------
    def prepare(self, dataset, vocab_from=None) -> None:
        """Called once on every rank before a fresh run trains (not a resumed or warm-started one) with the training
        set (rows holding at least `input_ids` and `loss_mask`) and data.draft_vocab's rows or None: fit what depends
        on the data rather than on the target (EAGLE-3's draft vocabulary). What it fits must live in the state dict
        (so a checkpoint and a resumed run carry it); what decoding reports about it goes to `learned` (a resumed run
        restores it from its checkpoint's config)."""

    @classmethod
    def picks_draft_vocab(cls, config, target: Optional[TargetShape]) -> bool:
        """Whether `prepare` picks a pruned draft vocabulary from the data (what data.draft_vocab is
        for); `target` None (not known yet) answers for any target."""
        return False

    @classmethod
    def learned_card_lines(cls, learned: dict[str, Any]) -> list[str]:
        """The model card's lines (export/card.py's training section, one Markdown list item each) for what
        `learned` records of a drafter of this kind; none by default."""
        return []

    def param_groups(self) -> list[tuple[list[nn.Parameter], float]]:
        """The trainable parameters as (parameters, learning-rate scale) groups; train.lr times the
        scale is each group's peak rate. Default: everything that requires grad, at train.lr."""
        return [([p for p in self.parameters() if p.requires_grad], 1.0)]

    def forward(
        self, batch: dict, target_out: TargetOutput
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        # Training calls the module (not .loss) so DDP/DeepSpeed wrappers see the forward.
        return self.loss(batch, target_out)

    def loss_tokens(self, batch: dict) -> torch.Tensor:
        """The normaliser of `loss`'s sum (module docstring, "The loss contract"): the batch's
        supervised tokens. A function of the batch alone, on whatever device it is (the trainer
        calls it on the host, before the transfer); a sum over documents."""
        return batch["loss_mask"].sum()

    def host_fields(self, batch: dict) -> dict[str, Any]:
        """Host values (Python numbers) `loss` reads of the batch, counted from the batch alone on the host
        before it moves to the device, where a shape read from a device tensor would wait for it (a host sync
        each micro-batch). Every caller of `loss` passes `batch | drafter.host_fields(batch)`: the trainer
        (trainer/loop.py `next_step`), the held-out evaluation (trainer/heldout.py) and the eval split's
        accuracy (eval/accuracy.py); a loss that needs a field raises when it is missing. Default: none."""
        return {}

    def loss(self, batch: dict, target_out: TargetOutput) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """`(loss_sum, count, stats)`: the scalar loss summed over the tokens it scores (weighted per
        head or step), its normaliser `count` = `loss_tokens(batch)` (so `loss_sum / count` is the
        per-token loss), and per-sample statistics `name -> [D, 2]` (sum, count) for any metric,
        one row per document (conversation) of the batch: D = len(batch["domain"]), the rows of an
        unpacked batch, more than the rows of a packed one (heads/packing.py).

        Returning sums and counts per sample lets the trainer average over tokens across ranks
        and break every metric down by the batch's `domain`. In a packed batch no label, input or
        attention may cross a document boundary: heads/packing.py has the helpers.
        """
        raise NotImplementedError

    # -- decoding -------------------------------------------------------------------------------
    def proposer(self, temperature: float = 0.0) -> Proposer:
        """A fresh decoding side for one sequence at a time. `temperature` is the eval's sampling
        temperature: deterministic drafters ignore it, a stochastic one samples its proposals from q
        at this temperature and returns q."""
        raise NotImplementedError

    # -- files ----------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike, state_dict: Optional[dict] = None) -> None:
        """Write config.json + model.safetensors. `state_dict` is given when it was gathered from
        shards (ZeRO-3/FSDP); otherwise the module's own is used."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state_dict = self.state_dict() if state_dict is None else state_dict
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in state_dict.items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        write_text_atomic(directory / CONFIG_NAME, json.dumps(self.checkpoint_config(), indent=2) + "\n")

    def checkpoint_config(self) -> dict[str, Any]:
        return {
            "draftsmith_format": FORMAT_VERSION,
            "drafter_type": self.type,
            "drafter": asdict(self.config),
            "target": asdict(self.target),
            "learned": self.learned,
        }


def pair_means(pairs: dict[str, torch.Tensor]) -> dict[str, float]:
    """Token-weighted means of (sum, count) pairs summed over samples, as `per_sample_stats` makes them:
    name -> sum / count (0 where nothing was counted). The held-out evaluation and the eval split's
    accuracy both read a drafter's statistics through it."""
    return {name: float(pair[0] / pair[1].clamp(min=1)) for name, pair in sorted(pairs.items())}


def per_sample_stats(
    values: dict[str, torch.Tensor], rows: torch.Tensor, batch_size: int, where: Optional[torch.Tensor] = None
) -> dict[str, torch.Tensor]:
    """Per-position metric values -> `name -> [D, 2]` (sum, count) per sample, the shape `loss`
    returns; `rows[i]` is the sample (document, heads/packing.py `documents`) position i belongs
    to, `batch_size` the number of samples (`num_documents`). `where` (the values' shape, bool): the
    positions that count, every one when None; a fixed-shape caller masks instead of gathering.
    Values (and `where`) may lead with dimensions rows lacks (one per draft step, say): each index of
    those is summed on its own, `[*leading, D, 2]`, in the operators of one."""
    shape = (where if where is not None else next(iter(values.values()))).shape
    leading = shape[: len(shape) - rows.dim()]
    size = math.prod(leading) * batch_size
    rows = rows.flatten()
    if leading:  # leading index j's samples at j * batch_size + sample
        rows = (torch.arange(0, size, batch_size, device=rows.device)[:, None] + rows).flatten()
    counted = torch.ones(rows.shape[0], device=rows.device) if where is None else where.flatten().float()
    counts = torch.zeros(size, device=rows.device).index_add_(0, rows, counted)

    def summed(value: torch.Tensor) -> torch.Tensor:
        value = value.flatten().float()
        value = value if where is None else torch.where(where.flatten(), value, 0.0)
        return torch.zeros(size, device=rows.device).index_add_(0, rows, value)

    table = {name: torch.stack([summed(value), counts], dim=-1) for name, value in values.items()}
    return {name: pairs.view(*leading, batch_size, 2) for name, pairs in table.items()}


def architecture(config: DrafterConfig) -> dict[str, Any]:
    """What a drafter config fixes about its weights' function: every key but its SETTINGS, what
    from_target resolves from the target (RESOLVED) and the released weights a fresh one starts from (STARTS)."""
    skipped = {*config.SETTINGS, *config.RESOLVED, *config.STARTS}
    return config.resolved({key: value for key, value in asdict(config).items() if key not in skipped})


def filled_from_target(key: str) -> UserError:
    """The line for a drafter built without a setting `from_target` reads from the target: a hand-edited
    checkpoint's config.json that lost it (load_drafter names the file)."""
    return UserError(f"drafter.{key} is missing: it is read from the target when the drafter is made (from_target)")


def config_from_dict(config_cls: type, values: dict):
    if not isinstance(values, dict):  # a hand-edited config.json's section (saved_drafter names the file)
        raise TypeError(f"the drafter section is a {type(values).__name__}, not a mapping of settings")
    known = {f.name for f in fields(config_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"drafter config has unknown key(s) {unknown} for type {values.get('type')!r}")
    return config_cls(**values)


def read_checkpoint_config(directory: Path) -> dict[str, Any]:
    """A draftsmith checkpoint's config.json; a one-line UserError for anything else."""
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    if not directory.exists():  # a run stopped before its end has no final/: its saved steps are under checkpoints/
        raise UserError(f"no drafter checkpoint at {directory}: train first, or pass checkpoint=<checkpoint dir>")
    if (directory / DRAFTER_DIR / CONFIG_NAME).is_file():  # a training checkpoint: its drafter/ folder is the drafter
        raise UserError(f"{directory} is a training checkpoint: its drafter is {directory / DRAFTER_DIR}")
    if not config_path.is_file() or not weights_path.is_file():
        raise UserError(f"{directory} is not a drafter checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    saved = read_json(config_path, "drafter config")
    if not isinstance(saved, dict) or "draftsmith_format" not in saved:
        engine = ": an engine folder (an export, or speculators'), served as it is; train.init_from trains on from it"
        said = engine if isinstance(saved, dict) and "architectures" in saved else ""
        raise UserError(f"{config_path} is not a draftsmith checkpoint config (no draftsmith_format){said}")
    if saved["draftsmith_format"] != FORMAT_VERSION:
        raise UserError(
            f"{config_path}: checkpoint format {saved['draftsmith_format']!r}, this draftsmith reads {FORMAT_VERSION}; "
            "retrain it"
        )
    return saved


def saved_drafter(directory: Path) -> tuple[type, DrafterConfig, TargetShape, dict[str, Any]]:
    """A draftsmith checkpoint's drafter class, its config (checked, as the recipe's is) and the target shape it
    was made for, with the whole saved config.json, read without its weights; a one-line UserError for a config
    that is not one (hand-edited values of the wrong type included)."""
    from draftsmith.heads import drafter_class

    saved = read_checkpoint_config(directory)
    try:
        try:
            cls = drafter_class(saved["drafter_type"])
        except UserError as err:  # a kind this draftsmith has not: its line named no file, read as a recipe key's
            raise UserError(f"{directory / CONFIG_NAME}: drafter_type: {err}") from None
        config = config_from_dict(cls.Config, saved["drafter"])
        saved_target = TargetShape(**saved["target"])
        sizes = {key: getattr(saved_target, key) for key in ("hidden_size", "vocab_size", "num_hidden_layers")}
        if odd := {key: value for key, value in sizes.items() if type(value) is not int}:  # a hand-edited "256"
            raise TypeError(f"the target's sizes must be integers: {odd}")
        config.check(saved_target)
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(
            f"{directory / CONFIG_NAME}: corrupt drafter config ({one_line(err, with_type=True)})"
        ) from None
    return cls, config, saved_target, saved


def load_drafter(directory: str | os.PathLike, target: Optional[TargetShape] = None, target_model=None) -> Drafter:
    """Load a checkpoint written by `save_pretrained`; refuse one made for a different target.
    With `target_model` the drafter gets the target modules it shares re-attached (`attach_target`)."""
    directory = Path(directory)
    cls, config, saved_target, saved = saved_drafter(directory)
    if target is not None:
        check_same_target(saved_target, target, str(directory))
    drafter = built_drafter(directory, cls, config, saved_target)
    if target_model is not None:  # before loading: a drafter may hold weights inside the target (Medusa-2's LoRA)
        drafter.attach_target(target_model)
    weights_path = directory / WEIGHTS_NAME
    require_readable(weights_path)  # safetensors calls a file it may not read missing
    try:
        state = load_file(str(weights_path))
    except (SafetensorError, OSError) as err:
        raise UserError(f"{weights_path}: corrupt weights file ({one_line(err)})") from None
    # training writes finite weights only (trainer/loop.py): a NaN or inf here is a damaged file, which an eval would
    # measure without a word and an export's read-back check would call a draftsmith bug (NaN is not NaN)
    if nonfinite := [
        name for name, tensor in state.items() if tensor.is_floating_point() and not tensor.isfinite().all()
    ]:
        raise UserError(f"{weights_path}: corrupt weights file (non-finite values in {', '.join(nonfinite[:3])})")
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(
            f"{weights_path}: weights do not match a {cls.type} drafter (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]})"
        )
    drafter.learned = dict(saved.get("learned") or {})
    return drafter


def built_drafter(directory: Path, cls: type, config: DrafterConfig, saved_target: TargetShape) -> Drafter:
    """The drafter a checkpoint's config.json builds (on the device in force), its weights unread: a config saved whole
    builds; a hand-edited one may not (a head count, an activation transformers lacks), which is one line."""
    try:
        return cls(config, saved_target)
    except UserError as err:
        raise UserError(f"{directory / CONFIG_NAME}: corrupt drafter config ({err})") from None
    except (KeyError, TypeError, ValueError, AttributeError, StrictDataclassError) as err:
        raise UserError(
            f"{directory / CONFIG_NAME}: corrupt drafter config ({one_line(err, with_type=True)})"
        ) from None


def check_same_target(made_for: TargetShape, target: TargetShape, what: str) -> None:
    """A drafter reads the target's hidden states and scores its vocabulary: both sizes must agree, the family
    (model_type) where both shapes know it, and the weights, where both shapes know them (a drafter of one target
    served on another of the same shape proposes what that one would not: tiny random targets of two families,
    seeded alike, have the same sizes and input embedding)."""
    for key in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(made_for, key), getattr(target, key)
        if mine != theirs:
            raise UserError(
                f"drafter {what} was made for target {made_for.name_or_path!r} with {key}={mine}, but the target "
                f"{target.name_or_path!r} has {key}={theirs}"
            )
    if made_for.model_type and target.model_type and made_for.model_type != target.model_type:
        raise UserError(
            f"drafter {what} was made for target {made_for.name_or_path!r}, a {made_for.model_type} model, but the "
            f"target {target.name_or_path!r} is a {target.model_type} model: give the target it was trained for"
        )
    if not made_for.same_weights(target):
        moved = made_for.revision and made_for.revision != target.revision  # the Hub commit it was made on: the fix
        raise UserError(
            f"drafter {what} was made for target {made_for.name_or_path!r}, and the target {target.name_or_path!r} "
            "has the same shape but other weights (its input embedding or last layer differs): give the target it was "
            "trained for" + (f" (target.revision={made_for.revision}, the commit it was made on)" if moved else "")
        )
