"""What the training loop (trainer/loop.py) logs: the train/ metrics of the interval between two log lines, summed
step by step (`Meters`) and reduced over ranks at the log line (`log_interval`), and each logged step's row, to
TensorBoard and log.jsonl (`log_step`)."""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from draftsmith.files import append_lines
from draftsmith.outputs import LOG_NAME
from draftsmith.trainer.heldout import reduce_means
from draftsmith.trainer.observe import FlopCounter, mfu, peak_memory_mb

if TYPE_CHECKING:  # annotations only: the loop imports this module
    from draftsmith.trainer.loop import StepResult
    from draftsmith.trainer.setup import Run


class Meters:
    """What the loop sums between two log lines: the drafter's (sum, count) statistics of the steps that
    were not skipped, this rank's tokens, positions (tokens plus padding) and rows, all ranks' tokens, and
    when the interval began; and the learning rate of its last step."""

    def __init__(self, device: torch.device):
        self.stats: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(2, device=device))
        self.lr = math.nan  # the last step's, kept across intervals
        self.reset()

    def reset(self) -> None:
        self.stats.clear()
        self.tokens, self.positions, self.global_tokens, self.rows = 0, 0, 0, 0
        self.start = time.perf_counter()

    def carried(self, accelerator) -> dict:
        """The open interval as a checkpoint keeps it (TrainerState.interval): the statistics summed over ranks (a
        collective: every rank calls it), and this process's counts, which the main process logs (its padding). The
        throughput is the resumed run's own: its clock starts again."""
        names = sorted(self.stats)
        totals = accelerator.reduce(torch.stack([self.stats[n] for n in names]), reduction="sum") if names else []
        stats = {name: total.tolist() for name, total in zip(names, totals)}
        return {"stats": stats, "tokens": self.tokens, "positions": self.positions, "rows": self.rows}

    def resume(self, interval: dict, main: bool) -> None:
        """Continue the interval a checkpoint kept (`carried`): its statistics on the main process alone, as the
        sum over ranks at the log line then holds them once."""
        if main:
            for name, values in interval["stats"].items():
                self.stats[name] += torch.tensor(values, dtype=self.stats[name].dtype, device=self.stats[name].device)
            self.tokens, self.positions, self.rows = interval["tokens"], interval["positions"], interval["rows"]

    def add(self, done: StepResult) -> None:
        if not done.agreed.nonfinite:
            for name, values in done.stats.items():
                self.stats[name] += values
        self.tokens += done.data.tokens
        self.positions += done.data.positions
        self.global_tokens += done.tokens
        self.rows += done.data.rows
        self.lr = done.lr


def log_interval(run: Run, meters: Meters, flops: FlopCounter, progress) -> dict[str, float]:
    """The log line's train/ metrics over the interval since the last one (statistics averaged over ranks,
    throughput, padding, MFU, peak memory); starts the next interval."""
    cfg, accelerator = run.cfg, run.accelerator
    elapsed = time.perf_counter() - meters.start
    metrics = reduce_means(accelerator, meters.stats)
    metrics["lr"] = meters.lr  # the logged step's
    metrics["tokens_per_s"] = meters.global_tokens / max(elapsed, 1e-9)
    metrics["padding_fraction"] = 1 - meters.tokens / max(meters.positions, 1)  # this rank's
    metrics["skipped_steps"] = run.state.skipped_steps
    per_token = flops.per_token(meters.positions / max(meters.rows, 1))["total"]
    metrics["model_tflops_per_s"] = per_token * metrics["tokens_per_s"] / 1e12  # all ranks together
    if cfg.train.peak_tflops:
        metrics["mfu"] = mfu(per_token, metrics["tokens_per_s"], cfg.train.peak_tflops, accelerator.num_processes)
    metrics["peak_memory_mb"] = peak_memory_mb(accelerator.device)  # this rank's
    if "loss" in metrics:
        progress.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)  # shown by the bar's next redraw
    meters.reset()
    return {f"train/{k}": v for k, v in metrics.items()}


def log_step(accelerator, output_dir: Path, step: int, metrics: dict[str, float]) -> None:
    """TensorBoard scalars plus one JSON line per logged step (log.jsonl), from the main process."""
    accelerator.log(metrics, step=step)
    if accelerator.is_main_process:
        line = json.dumps({"step": step, **{k: logged(v) for k, v in metrics.items()}}) + "\n"
        append_lines(output_dir / LOG_NAME, [line])


def logged(value: float) -> float:
    """A value as log.jsonl writes it: 9 significant figures, not decimals (at 6 decimals an lr of 5e-7 read 0.0,
    which TensorBoard has), more than a float32 holds; a whole number (train/tokens, parameter counts) as it is."""
    return value if float(value).is_integer() else float(f"{value:.9g}")
