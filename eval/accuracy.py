"""Teacher-forced accuracy of a trained drafter on the eval split, per domain, next to the same
drafter untrained: `eval_accuracy.json` in the run's output directory (beside `final/`), naming the
checkpoint it measured. The eval stage writes only its own files, never the checkpoint: the
consumers of the measurement (Medusa builds its tree from the measured per-head accuracy) read it
from there explicitly (`measured_accuracy`: the speculative-decoding eval, which records what it used
in its report; the export takes it from the report it is given).

The untrained drafter is the drafter type's fresh initialisation for the same target, prepared on the
same training data or data.draft_vocab (EAGLE-3 picks the same draft vocabulary), so the comparison is
about the weights.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from draftsmith.data_prep.collate import Collator
from draftsmith.data_prep.dataset import load_tokenized, split_heldout_rows
from draftsmith.data_prep.features import open_features
from draftsmith.data_prep.overlap import eval_in_train
from draftsmith.eval.render import cell
from draftsmith.files import write_text_atomic
from draftsmith.formats.folder import load_warm_start
from draftsmith.heads import drafter_class
from draftsmith.heads.base import EVAL_SPLIT_METRICS, Drafter, load_drafter, pair_means
from draftsmith.outputs import ACCURACY_NAME
from draftsmith.progress import progress_bar
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape, run_target


def split_accuracy(cfg: DictConfig, checkpoint: Path, target, tokenizer) -> dict:
    """Measure and write `<output_dir>/eval_accuracy.json` (the checkpoint is only read); returns
    {"checkpoint": path, "trained": {domain: {metric: mean}}, "untrained": ...}."""
    digests: dict[str, str] = {}  # each data file hashed once, whichever settings name it (load_tokenized)
    data = load_tokenized(cfg, cfg.data.eval, tokenizer, "data.eval", digests)
    # the rows the run trained on: the untrained drafter prepares on them, and the eval split's conversations among
    # them are counted, for the table to say
    train = trained_rows(cfg, tokenizer, digests)
    device = target.get_output_embeddings().weight.device
    trained = load_drafter(checkpoint, TargetShape.of(target, cfg.target.name_or_path), target).to(device)
    settings = OmegaConf.to_object(cfg.drafter)
    untrained = drafter_class(trained.type).from_target(settings, target, cfg.target.name_or_path)
    if cfg.train.init_from:  # a warm start's baseline is where the run began, not a drafter no run trained
        load_warm_start(cfg.train.init_from, untrained, target)
    elif cfg.data.draft_vocab:  # the rows the trainer prepared on (trainer/setup.py)
        untrained.prepare(load_tokenized(cfg, cfg.data.draft_vocab, tokenizer, "data.draft_vocab", digests))
    elif cfg.data.features:
        untrained.prepare(open_features(cfg.data.features))
    else:  # data.train empty: load_tokenized refuses it in one line
        untrained.prepare(
            train if train is not None else load_tokenized(cfg, cfg.data.train, tokenizer, "data.train", digests)
        )
    untrained.to(device)
    collate = Collator(tokenizer.pad_token_id, draw_seed=cfg.train.seed)  # DFlash's anchors: the held-out ones'
    trained_means, untrained_means = metric_means(
        [trained, untrained], target, data, collate, cfg.train.micro_batch_size
    )
    table = {
        "checkpoint": str(checkpoint.resolve()),
        "trained": trained_means,
        "untrained": untrained_means,  # the drafter the run began from: built from the target, released or init_from
        "start": cfg.train.init_from,  # where the run began from, if not from the target
        # the released weights it began from otherwise (`drafter.released_assistant=DIR`): from_target loaded them
        "released_start": None if cfg.train.init_from else settings.released_start(),
        # {"conversations": in data.train too, "of": distinct ones measured}; null where not counted (data.features)
        "eval_in_train": None if train is None else eval_in_train(train, data, cfg, warn=False),
    }
    write_text_atomic(Path(cfg.output_dir) / ACCURACY_NAME, json.dumps(table, indent=2) + "\n")
    return table


def trained_rows(cfg: DictConfig, tokenizer, digests: dict[str, str]):
    """data.train's tokenized rows the run trained on: its last train.heldout ones left out, as the trainer held them
    out (data_prep/dataset.py `split_heldout_rows`); None where it trained on a capture's (data.features) or
    data.train is empty. `digests`: the files read already (load_tokenized)."""
    if not cfg.data.train or cfg.data.features:
        return None
    train = load_tokenized(cfg, cfg.data.train, tokenizer, "data.train", digests)
    return split_heldout_rows(train, cfg.train.heldout)[0] if cfg.train.heldout else train


def measured_accuracy(checkpoint: Path) -> tuple[Optional[dict[str, float]], Optional[Path]]:
    """The eval split's overall metric means of `checkpoint` (`{"head1/top1": ..., ...}`, what
    decoding reads as `learned[EVAL_SPLIT_METRICS]`) and the file they came from: `eval_accuracy.json` beside
    the checkpoint's folder (`<output_dir>/eval_accuracy.json` for `<output_dir>/final`, where
    train.py's eval writes it), when it measured this checkpoint; (None, None) otherwise."""
    path = Path(checkpoint).resolve().parent / ACCURACY_NAME
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(table, dict) or table.get("checkpoint") != str(Path(checkpoint).resolve()):
        return None, None  # another checkpoint's, or written before the file named its checkpoint
    return dict(table["trained"]["all"]), path


def with_measured_accuracy(drafter: Drafter, measured: Optional[dict[str, float]]) -> Drafter:
    """`drafter` (in memory) with the eval split's measurement among what decoding reads (`learned`)."""
    if measured:
        drafter.learned = {**drafter.learned, EVAL_SPLIT_METRICS: dict(measured)}
    return drafter


@torch.no_grad()
def metric_means(
    drafters: Sequence[Drafter], target, dataset, collate, batch_size: int
) -> list[dict[str, dict[str, float]]]:
    """Per drafter, per-domain (and `all`) token-weighted means of every metric its loss reports. The target runs
    once a batch for every drafter that asks it for the same features (the trained and the untrained drafter,
    whose loss is the cheap part): its outputs for one batch are held at a time."""
    for drafter in drafters:
        drafter.eval()
    device = target.get_output_embeddings().weight.device
    sums = [defaultdict(lambda: defaultdict(lambda: torch.zeros(2))) for _ in drafters]
    batches = [list(range(i, min(i + batch_size, len(dataset)))) for i in range(0, len(dataset), batch_size)]
    # minutes on a target whose kernels run in Python on a CPU (linear attention's reference code): said as it goes
    progress = progress_bar(total=len(dataset), desc="eval-split accuracy", unit="row")
    for batch in DataLoader(dataset, batch_sampler=batches, collate_fn=collate):
        outputs: list[tuple[FeatureRequest, TargetOutput]] = []  # this batch's target outputs, by request
        on_device = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}  # once, for every drafter
        for drafter, drafter_sums in zip(drafters, sums):
            fields = on_device | drafter.host_fields(batch)  # Python numbers, counted on the host (heads/base.py)
            target_out = next((out for request, out in outputs if request == drafter.request), None)
            if target_out is None:
                target_out = run_target(target, fields["input_ids"], fields["attention_mask"], drafter.request)
                outputs.append((drafter.request, target_out))
            _, _, stats = drafter(fields, target_out)
            for name, values in stats.items():
                for row, domain in enumerate(fields["domain"]):
                    drafter_sums[domain][name] += values[row].float().cpu()
                    drafter_sums["all"][name] += values[row].float().cpu()
        progress.update(len(fields["domain"]))
    progress.close()
    return [{domain: pair_means(pairs) for domain, pairs in sorted(each.items())} for each in sums]


def accuracy_table(table: dict) -> str:
    """Markdown: per domain, every top-1 metric (`head2/top1`, `step1/top1`, ...) of the drafter on
    the eval split, untrained vs trained."""
    trained, untrained = table["trained"], table["untrained"]

    def natural(name: str) -> list:  # head2 before head10
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]

    names = sorted((n for n in trained["all"] if n.endswith("/top1")), key=natural)
    began = "warm start" if table.get("start") else "released start" if table.get("released_start") else "untrained"
    columns = [f"{n.removesuffix('/top1')} top-1 ({began} → trained)" for n in names]
    header = "| domain | " + " | ".join(columns) + " |"
    lines = [header, "|" + "---|" * (len(names) + 1)]
    for domain in trained:
        cells = [f"{untrained[domain][n]:.3f} → {trained[domain][n]:.3f}" for n in names]
        lines.append(f"| {cell(domain)} | " + " | ".join(cells) + " |")
    shared = table.get("eval_in_train") or {}
    if shared.get("conversations"):  # the warning at the run's start said which files
        lines += [
            "",
            f"{shared['conversations']} of these {shared['of']} conversations are in data.train too: on them the "
            "trained drafter's figures are of text it trained on",
        ]
    return "\n".join(lines)
