"""The per-domain eval: run plain decoding, the drafter (chain, and tree when eval.tree > 0) and the
free baselines (n-gram lookup; suffix decoding where arctic-inference is installed), each a method of
eval/methods.py, through the same loop on the same prompts, and write report.json, report.md and
acceptance.png to `<output_dir>/eval/`.

Definitions (the README's "Evaluating a drafter" section says the same for users):
- tau = new_tokens / target_forwards: tokens emitted per decode forward, bonus included. The prefill
  (prompt minus its last token) is not a forward here; every new token comes from a decode forward.
- draft_forwards_per_cycle = the drafter's forward passes / target forwards: what a cycle costs on the
  draft side (an EAGLE chain of γ costs γ, a Medusa or DFlash proposal 1; the free baselines 0).
- drafted = draft positions proposed per forward summed (a chain's length, a tree's depth);
  alpha = accepted / drafted.
- per_position[d] = accepted at draft position d+1 / cycles that tested position d+1, i.e. the
  acceptance of position d+1 given that positions 1..d were accepted (EAGLE's n-alpha). With a
  greedy target this is what a Medusa head's top-1 accuracy on the target's own text estimates.
- tokens_per_s = all new tokens / all wall time (prefill included); speedup = tokens_per_s / plain's
  tokens_per_s in the same domain and the same run; speedup_interval = its 95% interval over the timed
  batches (the prompts at batch size 1; a paired bootstrap, eval/counts.py), null under MIN_TIMED_BATCHES.
- lossless (greedy only): every prompt's token ids equal plain greedy decoding's of that prompt alone
  (batch size 1), whatever batch the prompt was decoded in.

Batches (eval.batch_size): consecutive prompts of a domain are decoded together, one target forward
per cycle for the batch (eval/loop.py); counters are per row, so tau and alpha keep their meaning and
tokens_per_s is the batch's throughput. eval.batch_sizes runs every method at each batch size and adds
`batch_sweep` to report.json (speedup over plain decoding at the same batch size) and batch_sweep.png.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.data_prep.dataset import no_room, require_context, target_context
from draftsmith.data_prep.overlap import PromptCount, prompts_in_train
from draftsmith.engines import SUFFIX, suffix_decoding_installed
from draftsmith.errors import NotLossless, UserError
from draftsmith.eval.counts import Counts, ratio, report_row, summed
from draftsmith.eval.loop import SHORTEST_PROMPT, generate
from draftsmith.eval.methods import Method, build_methods
from draftsmith.eval.partings import parting, rounding_unit
from draftsmith.eval.prompts import ALL, eos_ids_of, prompt_conversations, prompt_sources, render_prompts
from draftsmith.eval.render import keep_an_earlier_report, render_markdown, write_report
from draftsmith.eval.sampling import Sampling
from draftsmith.eval.suffix import INSTALL
from draftsmith.eval.target_checks import rollback
from draftsmith.families import check_eval_settings
from draftsmith.formats.folder import open_drafter, recorded_kind, require_recipes_kind, weights_digest
from draftsmith.outputs import EVAL_DIR, DirectoryLock
from draftsmith.progress import progress_bar
from draftsmith.recipe import checkpoint_to_read, save_recipe
from draftsmith.target import TargetShape, dtype_name, load_target, load_tokenizer, resolve_device, target_id
from draftsmith.target_loading import load_config

REPORT_VERSION = 1
WARMUP_TOKENS = 8


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "draftsmith", "arctic-inference"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed" if package == "arctic-inference" else "unknown"
    return found


def sampling_of(cfg: DictConfig) -> Sampling:
    e = cfg.eval
    return Sampling(temperature=float(e.temperature), top_p=float(e.top_p), top_k=int(e.top_k))


def evaluate_trained_run(cfg: DictConfig, prompt_count: Optional[PromptCount] = None) -> None:
    """What train.py does after training: eval-split accuracy of the run's final/ (trained vs untrained,
    written to <output_dir>/eval_accuracy.json, where decoding reads it) when data.eval is set, then the
    speculative-decoding report when eval.enabled, which reuses the run's start's count of its prompts in
    data.train (`prompt_count`); both printed."""
    from draftsmith.eval.accuracy import accuracy_table, split_accuracy

    if not (cfg.data.eval or cfg.eval.enabled):
        return
    target = load_target(cfg.target, resolve_device(cfg.eval.device))
    tokenizer = load_tokenizer(cfg.target)
    if cfg.data.eval:
        print(accuracy_table(split_accuracy(cfg, checkpoint_to_read(cfg), target, tokenizer)))
    if cfg.eval.enabled:
        report = run_eval(cfg, target=target, tokenizer=tokenizer, prompt_count=prompt_count)
        print(render_markdown(report))
        require_lossless(report)


def require_lossless(report: dict[str, Any]) -> None:
    """Exit 3 (`NotLossless`) when a greedy row of the report parted from plain decoding: the eval command's rule and
    the training run's eval stage's (whose report is written, the rows marked, and whose run has finished)."""
    if failed := failed_lossless(report):
        raise NotLossless(
            f"{', '.join(failed)}: tokens differ from plain greedy decoding (the WARNING lines above say where)"
        )


def run_eval(
    cfg: DictConfig,
    checkpoint: Optional[str | Path] = None,
    target=None,
    tokenizer=None,
    prompt_count: Optional[PromptCount] = None,
    served: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Evaluate a drafter per domain and write the report; returns report.json's content.

    `checkpoint`, a draftsmith checkpoint or a folder an export wrote, defaults to the recipe's
    (`checkpoint=`, else `<output_dir>/final`, what train.py writes). A caller that has the target and
    tokenizer loaded passes them; otherwise they are loaded from the recipe; a training run passes its start's
    count of the prompts in data.train (`prompt_count`: data_prep/overlap.py); `served`: the SERVED drafter
    settings the command line gave (formats/folder.py's served_settings). The report directory is held (locked)
    while the eval runs.
    """
    out_dir = Path(cfg.output_dir) / EVAL_DIR
    with DirectoryLock(out_dir, key="output_dir/eval: the eval report"):
        return _run_eval(cfg, out_dir, checkpoint, target, tokenizer, prompt_count, served)


def _run_eval(
    cfg: DictConfig, out_dir: Path, checkpoint: Optional[str | Path], target, tokenizer, prompt_count, served
) -> dict[str, Any]:
    sampling = sampling_of(cfg)
    sources, per_file = prompt_sources(cfg)
    if not sources:
        raise UserError("no eval data: set eval.data=[files] or data.eval in the recipe")
    given = bool(checkpoint or cfg.checkpoint)  # else <output_dir>/final, where train writes
    checkpoint = Path(checkpoint) if checkpoint else checkpoint_to_read(cfg)
    if not checkpoint.exists():  # checked before the (slow) target load
        advice = "" if given else ": train first, or pass checkpoint=<checkpoint dir>"
        raise UserError(f"no drafter checkpoint at {checkpoint}{advice}")
    # the rule of export and warm start: the recipe is for the drafter it reads
    require_recipes_kind(recorded_kind(checkpoint), cfg.drafter.type, f"checkpoint={checkpoint}", role="is for")
    require_context(cfg.target, int(cfg.data.max_length))  # prompts are cut to data.max_length
    prompt_length = prompt_room(cfg)
    name = cfg.target.name_or_path
    if target is None:
        target = load_target(cfg.target, resolve_device(cfg.eval.device))
    check_eval_settings(target.config, cfg.eval)
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.target)
    device = target.get_output_embeddings().weight.device
    drafter = open_drafter(checkpoint, TargetShape.of(target, name), target, served).to(device).eval()
    from draftsmith.eval.accuracy import measured_accuracy, with_measured_accuracy

    # What the eval split measured (Medusa's tree is built from it): the eval stage's own file, read
    # here explicitly and recorded in the report; the checkpoint is only read.
    measured, measured_from = measured_accuracy(checkpoint)
    with_measured_accuracy(drafter, measured)
    # The target, or the target with the drafter's adapters (Medusa-2): the model that verifies.
    verifier = drafter.proposer(sampling.temperature).verifier or target
    methods = build_methods(cfg, drafter, target, verifier, sampling.temperature)
    chosen = prompt_conversations(sources, int(cfg.eval.max_prompts), cfg.data.skip_invalid_utf8, per_file)
    prompts = render_prompts(chosen, tokenizer, prompt_length)
    # τ on prompts the drafter trained on an answer to is no forecast
    in_train = prompts_in_train(chosen, cfg, prompt_count)[0] if cfg.eval.prompts_in_train else None
    eos_ids = eos_ids_of(target, tokenizer)
    max_new_tokens, greedy = int(cfg.eval.max_new_tokens), sampling.temperature <= 0

    batch_size = int(cfg.eval.batch_size)
    swept = [m for m in methods if m.model is None]  # the drafting methods and their baselines
    # Warm-up, so lazy initialisation does not land in the first batch's timing: each batch size's path (a
    # batch pads, masks and gathers its cache as one prompt does not), on the first domain's first batch.
    first_domain = next(iter(prompts.values()))
    # batch size (no more than the first domain's prompts) -> the methods decoded at it: the sweep's, the report's
    warm_ups = {min(int(size), len(first_domain)): swept for size in cfg.eval.batch_sizes}
    warm_ups.update({1: methods, min(batch_size, len(first_domain)): methods})
    warm_up_tokens = min(WARMUP_TOKENS, max_new_tokens)
    for size, warmed in warm_ups.items():
        for method in warmed:
            method.run(verifier, first_domain[:size], warm_up_tokens, sampling, eos_ids, [cfg.eval.seed] * size)

    # Prompt i of the run (domains in order) is seeded eval.seed + i, at every batch size.
    numbered = [(domain, number) for domain, domain_prompts in prompts.items() for number in range(len(domain_prompts))]
    seeds = {key: int(cfg.eval.seed) + i for i, key in enumerate(numbered)}
    references: dict[tuple[str, int], list[int]] = {}  # greedy: plain decoding of each prompt alone
    tallies = decode_all(
        methods, verifier, prompts, batch_size, max_new_tokens, sampling, eos_ids, seeds, references if greedy else None
    )
    sweep = {}
    for size in cfg.eval.batch_sizes:
        per_domain = (
            tallies
            if size == batch_size
            else decode_all(
                swept, verifier, prompts, size, max_new_tokens, sampling, eos_ids, seeds, references if greedy else None
            )
        )
        sweep[int(size)] = {domain: {m.name: per_domain[domain][m.name] for m in swept} for domain in prompts}

    report = assemble(cfg, checkpoint, drafter, target, verifier, methods, tallies, sampling, greedy)
    report["drafter"]["learned"] = dict(drafter.learned)  # what decoding read: the export reads it from here
    report["drafter"]["eval_split_metrics_from"] = None if measured_from is None else str(measured_from)
    report["prompts_in_train"] = in_train
    if sweep:
        report["batch_sweep"] = sweep_rows(sweep, methods, greedy)
    keep_an_earlier_report(out_dir, report)
    save_recipe(cfg, out_dir)
    write_report(report, out_dir)  # report.json last
    print(
        f"eval report written to {out_dir}/report.json, report.md, acceptance.png"
        + (", batch_sweep.png" if sweep else ""),
        file=sys.stderr,
    )
    return report


def check_eval_stage(cfg) -> None:
    """What the eval stage after training refuses from the recipe and the target's config alone (its settings, its
    device, a prompt's room), refused before the run trains, not after it (trainer/setup.py asks)."""
    config = load_config(cfg.target)
    check_eval_settings(config, cfg.eval)
    resolve_device(cfg.eval.device)
    prompt_room(cfg, say=False, config=config)


def prompt_room(cfg, say: bool = True, config=None) -> int:
    """The most tokens of a prompt the eval keeps: data.max_length, or fewer where a prompt that long and
    eval.max_new_tokens new tokens would run the target past the context its config states (said in a line, where
    `say`); one line (UserError) where no prompt is left room. Read from the target's config alone (`config`: it
    loaded, else read here)."""
    context, stated = target_context(load_config(cfg.target) if config is None else config)
    length, new = int(cfg.data.max_length), int(cfg.eval.max_new_tokens)
    if context is None or length + new <= context:
        return length
    if new > context - SHORTEST_PROMPT:  # prompts of fewer tokens are refused by the loop, after the whole run
        raise no_room("eval.max_new_tokens", new, context, stated, SHORTEST_PROMPT)
    if say:
        print(
            f"note: eval prompts are cut to their last {context - new} tokens, not data.max_length={length}: with "
            f"eval.max_new_tokens={new} new ones they fill the target's context of {context} tokens ({stated})",
            file=sys.stderr,
        )
    return context - new


def decode_all(
    methods: list[Method],
    verifier,
    prompts: dict[str, list[list[int]]],
    batch_size: int,
    max_new_tokens: int,
    sampling: Sampling,
    eos_ids: frozenset[int],
    seeds: dict[tuple[str, int], int],
    references: Optional[dict[tuple[str, int], list[int]]],
) -> dict[str, dict[str, Counts]]:
    """Every method over every domain's prompts, `batch_size` consecutive prompts at a time; counters
    per domain and method. Greedy (`references` given): each prompt's tokens are compared with plain
    decoding of that prompt alone, run here when no earlier pass left it in `references`."""
    tallies: dict[str, dict[str, Counts]] = {domain: {m.name: Counts() for m in methods} for domain in prompts}
    for method in methods:
        if method.forget is not None:
            method.forget()
    progress = progress_bar(
        total=sum(map(len, prompts.values())), desc=f"eval (batch size {batch_size})", unit="prompt"
    )
    plain_alone = batch_size == 1 and methods[0].name == "plain"  # its tokens are the references
    unit = rounding_unit(verifier.dtype)
    for domain, domain_prompts in prompts.items():
        for start in range(0, len(domain_prompts), batch_size):
            group = domain_prompts[start : start + batch_size]
            keys = [(domain, start + i) for i in range(len(group))]
            group_seeds = [seeds[key] for key in keys]
            if references is not None and not plain_alone:
                for key, prompt, seed in zip(keys, group, group_seeds):
                    if key not in references:
                        references[key] = generate(
                            verifier, prompt, max_new_tokens, sampling=sampling, eos_ids=eos_ids, seed=seed
                        ).tokens
            for method in methods:
                runs = method.run(verifier, group, max_new_tokens, sampling, eos_ids, group_seeds)
                for key, prompt, run in zip(keys, group, runs):
                    mismatched = near_tie = False
                    if references is not None:
                        reference = references.setdefault(key, run.tokens)  # set by plain alone, which runs first
                        mismatched = run.tokens != reference
                        if mismatched and method.checks_lossless:
                            parted = None if unit is None else parting(verifier, prompt, reference, run.tokens, unit)
                            near_tie = parted is not None and parted["near_tie"]
                            mismatched = not near_tie
                            _warn_mismatch(method.name, domain, key[1], reference, run.tokens, batch_size, parted)
                    run.counts.mismatched, run.counts.near_ties = int(mismatched), int(near_tie)
                # one timed batch: its rows share its wall time, so the interval resamples batches, not rows
                tallies[domain][method.name].add(Counts.of_batch([run.counts for run in runs]))
            progress.update(len(group))
    progress.close()
    return tallies


def sweep_rows(sweep: dict[int, dict[str, dict[str, Counts]]], methods: list[Method], greedy: bool) -> dict[str, Any]:
    """report.json's `batch_sweep`: per batch size, domain (with `all`) and method, the report row;
    speedup is over plain decoding at the same batch size."""
    depth = {m.name: m.depth for m in methods}
    rows: dict[str, Any] = {}
    for size, per_domain in sweep.items():
        per_domain = {**per_domain, ALL: summed(per_domain)}
        rows[str(size)] = {
            domain: {
                name: report_row(counts, per_method["plain"], greedy, depth[name])
                for name, counts in per_method.items()
            }
            for domain, per_method in per_domain.items()
        }
    return {"batch_sizes": sorted(sweep), "rows": rows}


def _warn_mismatch(
    method: str,
    domain: str,
    number: int,
    reference: list[int],
    tokens: list[int],
    batch_size: int,
    parted: Optional[dict[str, Any]],
) -> None:
    """One line for a prompt whose output parts from plain decoding alone; `parted` (a target computing in
    fewer bits than float32: eval/partings.py) says whether rounding explains it."""
    at = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), min(len(reference), len(tokens)))
    where = (
        f"{method} at batch size {batch_size} differs from plain greedy decoding alone on {domain} prompt {number} "
        f"at new token {at} (plain {reference[at : at + 1]}, {method} {tokens[at : at + 1]})"
    )
    if parted is not None and parted["near_tie"]:
        print(
            f"note: {where}: a near tie the target's rounding decides (the two tokens' logits {parted['units']} "
            "rounding units apart), not a lossless failure; the rest of that prompt is not compared",
            file=sys.stderr,
        )
        return
    gap = f" (logits {parted['units']} rounding units apart: not a near tie)" if parted and "units" in parted else ""
    print(f"WARNING: lossless check FAILED: {where}{gap}", file=sys.stderr)


def assemble(
    cfg, checkpoint: Path, drafter, target, verifier, methods: list[Method], tallies, sampling: Sampling, greedy: bool
) -> dict[str, Any]:
    """report.json: `domains[domain][method]` for the drafter, `baselines[domain][method]` for plain
    and the free baselines, both with an `all` domain that sums the counters over the domains. A method that
    decodes with another model than the verifier (`original`) has no lossless verdict; at T=0 its
    `same_output` is the fraction of prompts on which it produced plain decoding's exact tokens."""
    tallies = {**tallies, ALL: summed(tallies)}
    groups: dict[str, dict[str, dict[str, Any]]] = {"domains": {}, "baselines": {}}
    for domain, per_method in tallies.items():
        for method in methods:
            key = "domains" if method.group == "drafter" else "baselines"
            counts = per_method[method.name]
            row = report_row(counts, per_method["plain"], greedy, method.depth)
            if not method.checks_lossless:
                row["lossless"] = None
                row["same_output"] = ratio(counts.prompts - counts.mismatched, counts.prompts) if greedy else None
            groups[key].setdefault(domain, {})[method.name] = row
    return {
        "report_version": REPORT_VERSION,
        "target": {
            "name_or_path": cfg.target.name_or_path,
            "id": target_id(cfg.target.name_or_path),
            "revision": cfg.target.revision,
            "rollback": rollback(target),  # states kept per position, or put back and tokens fed again
        },
        "drafter": {
            "path": str(checkpoint.resolve()),
            "sha256": weights_digest(checkpoint),  # which weights: the monitor refuses a baseline of others
            "type": drafter.type,
            "config": asdict(drafter.config),
        },
        "verifier": "target"
        if verifier is target
        else f"target with the {drafter.type} drafter's LoRA adapters (from its checkpoint)",
        "recipe": OmegaConf.to_container(cfg, resolve=True),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": int(cfg.eval.max_new_tokens),
        "device": str(target.get_output_embeddings().weight.device),
        "dtype": dtype_name(target.dtype),
        "batch_size": int(cfg.eval.batch_size),
        "cpu_threads": torch.get_num_threads(),
        "versions": versions(),
        "methods": {m.name: {"group": m.group, "depth": m.depth, **m.info} for m in methods},
        # a free baseline the recipe left to the environment, and why this one did not run it
        "not_measured": {SUFFIX: f"arctic-inference is not installed ({INSTALL})"}
        if cfg.eval.suffix_baseline is None and not suffix_decoding_installed()
        else {},
        "lossless_check": (
            "greedy: each method's token ids compared with plain greedy decoding of the prompt alone, prompt by prompt"
            if greedy
            else "not checked at temperature > 0 (outputs are random); "
            "the sampling rule's exactness is tested in tests/test_eval.py"
        ),
        **groups,
    }


def failed_lossless(report: dict[str, Any]) -> list[str]:
    """`method on domain` for every row of the report whose greedy lossless check failed, the batch-size
    sweep's rows included (`at batch size N`)."""
    failed = [
        f"{method} on {domain}"
        for group in ("domains", "baselines")
        for domain, rows in report[group].items()
        for method, row in rows.items()
        if row.get("lossless") is False and domain != ALL
    ]
    sweep = report.get("batch_sweep", {}).get("rows", {})
    swept = [
        f"{method} on {domain} at batch size {size}"
        for size, per_domain in sweep.items()
        if int(size) != report["batch_size"]  # that size's rows are the report's own, named above
        for domain, rows in per_domain.items()
        for method, row in rows.items()
        if row.get("lossless") is False and domain != ALL
    ]
    return failed + swept
