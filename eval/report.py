"""The per-domain eval: run plain decoding, the drafter (chain, and tree when eval.tree > 0) and the
n-gram baseline through the same loop on the same prompts, and write report.json, report.md and
acceptance.png to `<output_dir>/eval/`.

Definitions (the README's "Evaluating a drafter" section says the same for users):
- tau = new_tokens / target_forwards: tokens emitted per decode forward, bonus included. The prefill
  (prompt minus its last token) is not a forward here; every new token comes from a decode forward.
- draft_forwards_per_cycle = the drafter's forward passes / target forwards: what a cycle costs on the
  draft side (an EAGLE chain of γ costs γ, a Medusa or DFlash proposal 1; the n-gram baseline 0).
- drafted = draft positions proposed per forward summed (a chain's length, a tree's depth);
  alpha = accepted / drafted.
- per_position[d] = accepted at draft position d+1 / cycles that tested position d+1, i.e. the
  acceptance of position d+1 given that positions 1..d were accepted (EAGLE's n-alpha). With a
  greedy target this is what a Medusa head's top-1 accuracy on the target's own text estimates.
- tokens_per_s = all new tokens / all wall time (prefill included); speedup = tokens_per_s / plain's
  tokens_per_s in the same domain and the same run.
- lossless (greedy only): every prompt's token ids equal plain greedy decoding's of that prompt alone
  (batch size 1), whatever batch the prompt was decoded in.

Batches (eval.batch_size): consecutive prompts of a domain are decoded together, one target forward
per cycle for the batch (eval/loop.py); counters are per row, so tau and alpha keep their meaning and
tokens_per_s is the batch's throughput. eval.batch_sizes runs every method at each batch size and adds
`batch_sweep` to report.json (speedup over plain decoding at the same batch size) and batch_sweep.png.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from draftsmith.errors import UserError
from draftsmith.eval.loop import Counts, Generation, Sampling, generate, generate_batch, tree_depth
from draftsmith.eval.ngram import NGramDrafter
from draftsmith.files import write_text_atomic
from draftsmith.heads.base import DynamicTree, Proposer, Tree
from draftsmith.outputs import DirectoryLock
from draftsmith.recipe import save_recipe
from draftsmith.target import TargetShape, load_target, load_tokenizer, resolve_device, target_id

REPORT_VERSION = 1
WARMUP_TOKENS = 8
ALL = "all"  # the aggregate "domain": counters summed over every domain


@dataclass
class Method:
    """One way of decoding: `group` is "drafter" (rows under `domains`) or "baseline" (`baselines`).
    `new_proposer` makes one sequence's proposer (None: plain decoding); a batch of n prompts decodes
    with n of them, made once and reused (each resets itself on a new sequence)."""

    name: str
    group: str
    new_proposer: Optional[Callable[[], Proposer]] = None
    gamma: int = 0
    tree: Optional[Tree] = None
    info: dict = field(default_factory=dict)
    model: Any = None  # decode with this model instead of the verifier (the original target, for Medusa-2)
    proposers: list[Proposer] = field(default_factory=list)

    @property
    def checks_lossless(self) -> bool:
        """Only methods decoding with the verifier must reproduce plain decoding's tokens."""
        return self.model is None

    @property
    def depth(self) -> int:
        """Draft positions per forward at most: γ for a chain, the longest path for a tree."""
        if self.new_proposer is None:
            return 0
        return tree_depth(self.tree) if self.tree is not None else self.gamma

    def run(self, model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, eos_ids: frozenset[int], seeds: list[int]) -> list[Generation]:
        """Decode `prompts` as one batch, row b seeded with seeds[b]."""
        drafters = None
        if self.new_proposer is not None:
            self.proposers += [self.new_proposer() for _ in range(len(prompts) - len(self.proposers))]
            drafters = self.proposers[: len(prompts)]
        model = self.model if self.model is not None else model
        return generate_batch(model, prompts, max_new_tokens, drafters, self.gamma, self.tree, sampling, eos_ids, seeds)


def report_row(counts: Counts, plain: Counts, greedy: bool, positions: int) -> dict[str, Any]:
    """A report row. `positions`: the method's draft depth; per-position lists always have that length."""
    reached = (counts.reached + [0] * positions)[:positions]
    accepted_at = (counts.accepted_at + [0] * positions)[:positions]
    return {
        "prompts": counts.prompts,
        "new_tokens": counts.new_tokens,
        "target_forwards": counts.target_forwards,
        "drafted": counts.drafted,
        "accepted": counts.accepted,
        "alpha": _ratio(counts.accepted, counts.drafted),
        "tau": _ratio(counts.new_tokens, counts.target_forwards),
        "draft_forwards_per_cycle": _ratio(counts.draft_forwards, counts.target_forwards),
        "per_position": [_ratio(a, r) for a, r in zip(accepted_at, reached)],
        "per_position_counts": {"reached": reached, "accepted": accepted_at},
        "tokens_per_s": round(counts.tokens_per_s, 3),
        "wall_s": round(counts.wall_s, 4),
        "speedup": _ratio(counts.tokens_per_s, plain.tokens_per_s),
        "lossless": (counts.mismatched == 0) if greedy else None,
    }


def _ratio(num: float, den: float) -> Optional[float]:
    return round(num / den, 4) if den else None


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "draftsmith"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "unknown"
    return found


def load_prompts(sources: list[str], tokenizer, max_prompts: int, max_length: int) -> dict[str, list[list[int]]]:
    """The first `max_prompts` conversations of each domain, rendered up to their last assistant turn
    with the generation prompt; prompts longer than `max_length` keep their last tokens."""
    from draftsmith.data_prep import load_conversations, render_prompt

    conversations = load_conversations(sources, prompts_only=True)
    picked: dict[str, list[int]] = {}
    for index, domain in enumerate(conversations["domain"]):
        rows = picked.setdefault(domain, [])
        if len(rows) < max_prompts:
            rows.append(index)
    if ALL in picked:
        raise UserError(f"domain name {ALL!r} is reserved for the report's aggregate row; rename it in the eval data")
    prompts: dict[str, list[list[int]]] = {}
    for domain in sorted(picked):
        for row in conversations.select(picked[domain]):
            ids, _ = render_prompt(tokenizer, row["messages"])
            prompts.setdefault(domain, []).append(ids[-max_length:])
    if not prompts:
        raise UserError(f"no conversations in the eval data {sources}")
    return prompts


def eos_ids_of(model, tokenizer) -> frozenset[int]:
    """Generation stops at any EOS the model's generation config or the tokenizer names."""
    generation_config = getattr(model, "generation_config", None)
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


def sampling_of(cfg: DictConfig) -> Sampling:
    e = cfg.eval
    return Sampling(temperature=float(e.temperature), top_p=float(e.top_p), top_k=int(e.top_k))


def build_methods(cfg: DictConfig, drafter, target, verifier, temperature: float) -> list[Method]:
    """Plain first: the others' speedup and lossless check are measured against it. Each drafting
    method gets its own proposer (its own decoding state). A drafter that verifies with an adapted
    target (Medusa-2) also gets `original`: plain decoding with the target as it was, to show how
    far the adapters moved the output."""
    gamma, nodes = int(cfg.eval.num_speculative_tokens), int(cfg.eval.tree)
    longest = type(drafter).max_chain(drafter.config)
    if longest is not None and gamma > longest:
        raise UserError(f"eval.num_speculative_tokens={gamma} but this {drafter.type} checkpoint proposes at most {longest} tokens")
    new_proposer = partial(drafter.proposer, temperature)
    served_by = type(drafter).SERVED_BY
    methods = [
        Method("plain", "baseline", info={"served_by": "any engine"}),
        Method("chain", "drafter", new_proposer, gamma, info={"gamma": gamma, "served_by": served_by["chain"]}),
    ]
    if nodes > 0:
        tree = new_proposer().default_tree(nodes)
        methods.append(Method("tree", "drafter", new_proposer, gamma, tree, {**tree_info(tree), "served_by": served_by.get("tree", "draftsmith eval only")}))
    ngram_max = int(cfg.eval.ngram_max)
    info = {"gamma": gamma, "ngram_max": ngram_max, "served_by": "vLLM (method ngram: prompt lookup)"}
    methods.append(Method("ngram", "baseline", partial(NGramDrafter, ngram_max), gamma, info=info))
    if verifier is not target:
        methods.append(Method("original", "baseline", model=target, info={"model": "the target without the drafter's adapters", "served_by": "any engine"}))
    return methods


def tree_info(tree: Tree) -> dict:
    """The report's description of the drafter's tree: its paths if static, its budget if dynamic."""
    if isinstance(tree, DynamicTree):
        return {"nodes": tree.nodes, "dynamic": {"depth": tree.depth, "topk": tree.topk}}
    return {"nodes": len(tree), "paths": [list(p) for p in tree]}


def evaluate_trained_run(cfg: DictConfig, final_dir: Path) -> None:
    """What train.py does after training: eval-split accuracy (trained vs untrained, recorded in the
    checkpoint for decoding) when data.eval is set, then the speculative-decoding report when
    eval.enabled; both printed."""
    from draftsmith.eval.accuracy import accuracy_table, split_accuracy

    if not (cfg.data.eval or cfg.eval.enabled):
        return
    target = load_target(cfg.target, resolve_device(cfg.eval.device))
    tokenizer = load_tokenizer(cfg.target)
    if cfg.data.eval:
        print(accuracy_table(split_accuracy(cfg, final_dir, target, tokenizer)))
    if cfg.eval.enabled:
        print(render_markdown(run_eval(cfg, final_dir, target, tokenizer)))


def run_eval(cfg: DictConfig, drafter_path: Optional[str] = None, target=None, tokenizer=None) -> dict[str, Any]:
    """Evaluate a drafter checkpoint per domain and write the report; returns report.json's content.

    `drafter_path` defaults to `<output_dir>/final` (what train.py writes). A caller that has the
    target and tokenizer loaded passes them; otherwise they are loaded from the recipe. The report
    directory is held (locked) while the eval runs.
    """
    out_dir = Path(cfg.output_dir) / "eval"
    with DirectoryLock(out_dir):
        return _run_eval(cfg, out_dir, drafter_path, target, tokenizer)


def _run_eval(cfg: DictConfig, out_dir: Path, drafter_path: Optional[str], target, tokenizer) -> dict[str, Any]:
    sampling = sampling_of(cfg)
    sources = list(cfg.eval.data) or list(cfg.data.eval)
    if not sources:
        raise UserError("no eval data: set eval.data=[files] or data.eval in the recipe")
    checkpoint = Path(drafter_path) if drafter_path else Path(cfg.output_dir) / "final"
    if not checkpoint.exists():  # checked before the (slow) target load
        raise UserError(f"no drafter checkpoint at {checkpoint}: pass drafter.path=<checkpoint dir>")
    name = cfg.target.name_or_path
    if target is None:
        target = load_target(cfg.target, resolve_device(cfg.eval.device))
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.target)
    device = target.get_output_embeddings().weight.device
    from draftsmith.export import open_drafter  # a draftsmith checkpoint, or a folder an export wrote

    drafter = open_drafter(checkpoint, TargetShape.of(target, name), target).to(device).eval()
    # The target, or the target with the drafter's adapters (Medusa-2): the model that verifies.
    verifier = drafter.proposer(sampling.temperature).verifier or target
    methods = build_methods(cfg, drafter, target, verifier, sampling.temperature)
    prompts = load_prompts(sources, tokenizer, int(cfg.eval.max_prompts), int(cfg.data.max_length))
    eos_ids = eos_ids_of(target, tokenizer)
    max_new_tokens, greedy = int(cfg.eval.max_new_tokens), sampling.temperature <= 0

    first = next(iter(prompts.values()))[0]
    for method in methods:  # warm-up, so lazy initialisation does not land in the first prompt's timing
        method.run(verifier, [first], min(WARMUP_TOKENS, max_new_tokens), sampling, eos_ids, [cfg.eval.seed])

    # Prompt i of the run (domains in order) is seeded eval.seed + i, at every batch size.
    numbered = [(domain, number) for domain, domain_prompts in prompts.items() for number in range(len(domain_prompts))]
    seeds = {key: int(cfg.eval.seed) + i for i, key in enumerate(numbered)}
    references: dict[tuple[str, int], list[int]] = {}  # greedy: plain decoding of each prompt alone
    batch_size = int(cfg.eval.batch_size)
    tallies = decode_all(methods, verifier, prompts, batch_size, max_new_tokens, sampling, eos_ids, seeds, references if greedy else None)
    sweep = {}
    swept = [m for m in methods if m.model is None]  # the drafting methods and their baselines
    for size in cfg.eval.batch_sizes:
        per_domain = (
            tallies
            if size == batch_size
            else decode_all(swept, verifier, prompts, size, max_new_tokens, sampling, eos_ids, seeds, references if greedy else None)
        )
        sweep[int(size)] = {domain: {m.name: per_domain[domain][m.name] for m in swept} for domain in prompts}

    report = assemble(cfg, checkpoint, drafter, target, verifier, methods, tallies, sampling, greedy)
    if sweep:
        report["batch_sweep"] = sweep_rows(sweep, methods, greedy)
    write_report(report, out_dir)
    save_recipe(cfg, out_dir)
    print(f"eval report written to {out_dir}/report.json, report.md, acceptance.png" + (", batch_sweep.png" if sweep else ""), file=sys.stderr)
    return report


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
    progress = tqdm(total=sum(map(len, prompts.values())), desc=f"eval (batch size {batch_size})", unit="prompt", file=sys.stderr)
    plain_alone = batch_size == 1 and methods[0].name == "plain"  # its tokens are the references
    for domain, domain_prompts in prompts.items():
        for start in range(0, len(domain_prompts), batch_size):
            group = domain_prompts[start : start + batch_size]
            keys = [(domain, start + i) for i in range(len(group))]
            group_seeds = [seeds[key] for key in keys]
            if references is not None and not plain_alone:
                for key, prompt, seed in zip(keys, group, group_seeds):
                    if key not in references:
                        references[key] = generate(verifier, prompt, max_new_tokens, sampling=sampling, eos_ids=eos_ids, seed=seed).tokens
            for method in methods:
                for key, run in zip(keys, method.run(verifier, group, max_new_tokens, sampling, eos_ids, group_seeds)):
                    mismatched = False
                    if references is not None:
                        reference = references.setdefault(key, run.tokens)  # set by plain alone, which runs first
                        mismatched = run.tokens != reference
                        if mismatched and method.checks_lossless:
                            _warn_mismatch(method.name, domain, key[1], reference, run.tokens, batch_size)
                    run.counts.mismatched = int(mismatched)
                    tallies[domain][method.name].add(run.counts)
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
            domain: {name: report_row(counts, per_method["plain"], greedy, depth[name]) for name, counts in per_method.items()}
            for domain, per_method in per_domain.items()
        }
    return {"batch_sizes": sorted(sweep), "rows": rows}


def summed(per_domain: dict[str, dict[str, Counts]]) -> dict[str, Counts]:
    """Counters of every domain added up, per method: the `all` row."""
    total: dict[str, Counts] = {}
    for per_method in per_domain.values():
        for name, counts in per_method.items():
            total.setdefault(name, Counts()).add(counts)
    return total


def _warn_mismatch(method: str, domain: str, number: int, reference: list[int], tokens: list[int], batch_size: int) -> None:
    at = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), min(len(reference), len(tokens)))
    print(
        f"WARNING: lossless check FAILED: {method} at batch size {batch_size} differs from plain greedy decoding alone on {domain} prompt {number} "
        f"at new token {at} (plain {reference[at : at + 1]}, {method} {tokens[at : at + 1]})",
        file=sys.stderr,
    )


def assemble(cfg, checkpoint: Path, drafter, target, verifier, methods: list[Method], tallies, sampling: Sampling, greedy: bool) -> dict[str, Any]:
    """report.json: `domains[domain][method]` for the drafter, `baselines[domain][method]` for plain
    and n-gram, both with an `all` domain that sums the counters over the domains. A method that
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
                row["same_output"] = _ratio(counts.prompts - counts.mismatched, counts.prompts) if greedy else None
            groups[key].setdefault(domain, {})[method.name] = row
    return {
        "report_version": REPORT_VERSION,
        "target": {"name_or_path": cfg.target.name_or_path, "id": target_id(cfg.target.name_or_path), "revision": cfg.target.revision},
        "drafter": {"path": str(checkpoint.resolve()), "type": drafter.type, "config": asdict(drafter.config)},
        "verifier": "target" if verifier is target else f"target with the {drafter.type} drafter's LoRA adapters (from its checkpoint)",
        "recipe": OmegaConf.to_container(cfg, resolve=True),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": int(cfg.eval.max_new_tokens),
        "device": str(target.get_output_embeddings().weight.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "batch_size": int(cfg.eval.batch_size),
        "cpu_threads": torch.get_num_threads(),
        "versions": versions(),
        "methods": {m.name: {"group": m.group, "depth": m.depth, **m.info} for m in methods},
        "lossless_check": (
            "greedy: each method's token ids compared with plain greedy decoding of the prompt alone, prompt by prompt"
            if greedy
            else "not checked at temperature > 0 (outputs are random); the sampling rule's exactness is tested in tests/test_eval.py"
        ),
        **groups,
    }


def failed_lossless(report: dict[str, Any]) -> list[str]:
    """`method on domain` for every row of the report whose greedy lossless check failed."""
    return [
        f"{method} on {domain}"
        for group in ("domains", "baselines")
        for domain, rows in report[group].items()
        for method, row in rows.items()
        if row.get("lossless") is False and domain != ALL
    ]


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "report.json", json.dumps(report, indent=2) + "\n")
    write_text_atomic(out_dir / "report.md", render_markdown(report))
    plot_acceptance(report, out_dir / "acceptance.png")
    if "batch_sweep" in report:
        plot_batch_sweep(report, out_dir / "batch_sweep.png")


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def render_markdown(report: dict[str, Any]) -> str:
    methods = report["methods"]
    settings = [
        f"temperature {report['temperature']}",
        f"max_new_tokens {report['max_new_tokens']}",
        f"batch size {report['batch_size']}",
        f"device {report['device']} ({report['dtype']}, {report['cpu_threads']} CPU threads)",
    ]
    settings.append(f"chain γ={methods['chain']['gamma']}")
    if "tree" in methods:
        settings.append(f"tree {methods['tree']['nodes']} nodes, depth {methods['tree']['depth']}")
    lines = [
        f"# Eval: {report['drafter']['type']} drafter for {report['target']['id']}",
        "",
        f"drafter `{report['drafter']['path']}`; verified by the {report.get('verifier', 'target')}; " + ", ".join(settings) + ".",
        "",
        "| domain | method | served by | prompts | τ | α | per position | draft fwd/cycle | tok/s | speedup | lossless |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|:---:|",
    ]
    for domain in report["baselines"]:
        rows = {**report["baselines"][domain], **report["domains"][domain]}
        for name in methods:
            row = rows[name]
            lossless = {True: "yes", False: "**NO**", None: "n/a"}[row["lossless"]]
            if row.get("same_output") is not None:  # another model than the verifier: how often it agrees
                lossless = f"{row['same_output']:.0%} same"
            per_position = " / ".join(_fmt(p) for p in row["per_position"]) or "–"
            lines.append(
                f"| {domain} | {name} | {methods[name].get('served_by', '–')} | {row['prompts']} | {_fmt(row['tau'])} | {_fmt(row['alpha'])} | {per_position} "
                f"| {_fmt(row['draft_forwards_per_cycle'])} | {row['tokens_per_s']:.1f} | {_fmt(row['speedup'])}× | {lossless} |"
            )
    lines += [
        "",
        "τ: new tokens per target forward (bonus included, prefill not counted). α: accepted / drafted positions. "
        "Per position: acceptance at draft position k given positions < k were accepted. "
        "Draft fwd/cycle: the drafter's forward passes per target forward. "
        "Speedup: tokens/s over plain decoding in the same run. "
        "Served by: the engines that can serve the method as measured (vLLM 0.32 verifies chains only). "
        f"Lossless: {report['lossless_check']}.",
        "",
    ]
    if "batch_sweep" in report:
        lines += render_batch_sweep(report["batch_sweep"])
    return "\n".join(lines)


def render_batch_sweep(sweep: dict[str, Any]) -> list[str]:
    lines = [
        "## Batch sizes",
        "",
        "Prompts decoded together, one target forward per cycle for the batch; speedup is over plain decoding at the same batch size.",
        "",
        "| domain | method | " + " | ".join(f"bs {size}: τ / tok/s / speedup" for size in sweep["batch_sizes"]) + " |",
        "|---|---|" + "---:|" * len(sweep["batch_sizes"]),
    ]
    first = sweep["rows"][str(sweep["batch_sizes"][0])]
    for domain in first:
        for name in first[domain]:
            cells = []
            for size in sweep["batch_sizes"]:
                row = sweep["rows"][str(size)][domain][name]
                flag = " **NOT LOSSLESS**" if row["lossless"] is False else ""
                cells.append(f"{_fmt(row['tau'])} / {row['tokens_per_s']:.1f} / {_fmt(row['speedup'])}×{flag}")
            lines.append(f"| {domain} | {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def plot_acceptance(report: dict[str, Any], path: Path) -> None:
    """Left: alpha per domain for each drafting method; right: per-position acceptance per domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(report["domains"])
    drafting = [name for name in report["methods"] if name != "plain"]
    rows = {d: {**report["baselines"][d], **report["domains"][d]} for d in domains}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(drafting)
    for i, name in enumerate(drafting):
        values = [rows[d][name]["alpha"] or 0.0 for d in domains]
        left.bar([x + i * width for x in range(len(domains))], values, width, label=name)
    left.set_xticks([x + 0.4 - width / 2 for x in range(len(domains))], domains)
    left.set_ylim(0, 1)
    left.set_ylabel("α (accepted / drafted)")
    left.set_title("acceptance per domain")
    left.legend()
    styles = {"chain": "-", "tree": "--"}
    depth = 1
    for color, domain in enumerate(domains):
        for name, style in styles.items():
            if name in report["domains"][domain]:
                rates = report["domains"][domain][name]["per_position"]
                depth = max(depth, len(rates))
                values = [float("nan") if r is None else r for r in rates]  # untested positions: a gap
                right.plot(range(1, len(rates) + 1), values, style, color=f"C{color}", marker="o", label=f"{domain} {name}")
    right.set_xticks(range(1, depth + 1))
    right.set_ylim(0, 1)
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance given earlier positions accepted")
    right.set_title("per-position acceptance")
    right.legend(fontsize="small")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def plot_batch_sweep(report: dict[str, Any], path: Path) -> None:
    """Speedup over plain decoding at the same batch size against the batch size, one panel per
    domain (the aggregate first), one line per drafting method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = report["batch_sweep"]
    sizes = sweep["batch_sizes"]
    first = sweep["rows"][str(sizes[0])]
    domains = [ALL] + [d for d in first if d != ALL]
    methods = [name for name in first[ALL] if name != "plain"]
    fig, axes = plt.subplots(1, len(domains), figsize=(3.2 * len(domains), 3.4), sharey=True, squeeze=False)
    for ax, domain in zip(axes[0], domains):
        for name in methods:
            values = [sweep["rows"][str(size)][domain][name]["speedup"] or float("nan") for size in sizes]
            ax.plot(sizes, values, marker="o", label=name)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(size) for size in sizes])
        ax.set_xlabel("batch size")
        ax.set_title(domain)
    axes[0][0].set_ylabel("speedup vs plain, same batch size")
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
