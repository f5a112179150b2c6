"""An eval report as people read it: report.md (the per-domain tables), acceptance.png and
batch_sweep.png, written beside report.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

from draftsmith.engines import EVAL_ONLY, NGRAM, SUFFIX
from draftsmith.eval.counts import MIN_TIMED_BATCHES
from draftsmith.eval.prompts import ALL
from draftsmith.files import save_figure_atomic, write_text_atomic
from draftsmith.outputs import RECIPE_NAME, REPORT_NAME, move_aside

REPORT_FILES = (REPORT_NAME, "report.md", "acceptance.png", "batch_sweep.png")  # what write_report writes


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    """report.json last: the file export and the monitor read is there only once the rest is (a full disk during a
    plot left a report.json of an eval that had failed, exit 74)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_name, markdown_name, acceptance_name, sweep_name = REPORT_FILES
    write_text_atomic(out_dir / markdown_name, render_markdown(report))
    plot_acceptance(report, out_dir / acceptance_name)
    if "batch_sweep" in report:
        plot_batch_sweep(report, out_dir / sweep_name)
    write_text_atomic(out_dir / json_name, json.dumps(report, indent=2) + "\n")


def keep_an_earlier_report(out_dir: Path, report: dict[str, Any]) -> None:
    """A report in `out_dir` is moved to `out_dir/replaced/<time>/`, not overwritten, when it is of another
    checkpoint (a run's `final/`, when this eval reads its `best/`: the export of that checkpoint reads it,
    `export.report`) or of this one measured otherwise than `report`, the one about to be written (`measured_as`: a
    quick eval.max_prompts=2 replaced the training run's report, which the export's card and the monitor's baseline
    then read). The same checkpoint measured the same way again is replaced."""
    earlier = out_dir / REPORT_NAME
    if not earlier.is_file():
        return
    try:
        saved = json.loads(earlier.read_text())
        evaluated, theirs = saved["drafter"]["path"], measured_as(saved)
    except (ValueError, KeyError, TypeError, AttributeError):  # cut short or edited: kept aside too
        evaluated, theirs = None, {}
    ours = measured_as(report)
    changed = [key for key in ours if key in theirs and ours[key] != theirs[key]]  # an older report lacks newer keys
    if evaluated == report["drafter"]["path"] and not changed:
        return
    moved = move_aside(out_dir, [*REPORT_FILES, RECIPE_NAME])  # save_recipe's
    if evaluated is None:
        held = "an unreadable report"
    elif evaluated != report["drafter"]["path"]:
        held = f"the report of {evaluated}"
    else:
        held = (
            "a report of this checkpoint measured otherwise ("
            + ", ".join(f"{key} {theirs[key]} -> {ours[key]}" for key in changed)
            + ")"
        )
    print(f"{out_dir} held {held}: moved to {moved}/ (export.report={moved / REPORT_NAME} reads it)", file=sys.stderr)


def measured_as(report: dict[str, Any]) -> dict[str, Any]:
    """What decides what an eval measures, from its report: the eval settings that do (not whether train runs the
    eval, nor whether it counts its prompts in data.train; a greedy one's sampling settings neither), the prompts'
    files, the target as loaded and the drafter's settings (a served one given on the eval's line included)."""
    recipe = report.get("recipe") or {}
    settings = {f"eval.{key}": value for key, value in (recipe.get("eval") or {}).items()}
    for key in ("enabled", "prompts_in_train", *(("seed", "top_p", "top_k") if not report.get("temperature") else ())):
        settings.pop(f"eval.{key}", None)
    if not settings.get("eval.data"):  # read from data.eval, under data.max_conversations
        data = recipe.get("data") or {}
        settings |= {"data.eval": data.get("eval"), "data.max_conversations": data.get("max_conversations")}
    target = report.get("target") or {}
    settings |= {f"target.{key}": target.get(key) for key in ("name_or_path", "revision") if key in target}
    settings |= {"dtype": report.get("dtype")} if "dtype" in report else {}
    drafter = (report.get("drafter") or {}).get("config") or {}
    return settings | {f"drafter.{key}": value for key, value in drafter.items()}


def report_gaps(report: Any) -> list[str]:
    """The sections of an eval report that `report` (a report.json read) lacks, of those an export's card and the
    monitor's baseline read; a hand-made or cut file was exit 70 once the export had converted the drafter."""
    if not isinstance(report, dict):
        return ["drafter"]
    gaps = [] if isinstance(report.get("drafter"), dict) else ["drafter"]
    gaps += [key for key in ("temperature", "methods", "baselines") if key not in report]
    chain = ((report.get("domains") or {}).get("all") or {}).get("chain") or {}
    return gaps + (["domains.all.chain.tau"] if "tau" not in chain else [])


def _fmt(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.2f}"


def per_position_cell(row: dict[str, Any]) -> str:
    """A row's acceptance per draft position, its first 8 (suffix decoding's 24 would crowd a table)."""
    rates = row["per_position"]
    return " / ".join(_fmt(p) for p in rates[:8]) + (" / …" if len(rates) > 8 else "") if rates else "–"


def fewer_prompts(report: dict[str, Any]) -> str:
    """Where no domain held batch_size prompts, the most decoded together (a domain's prompts form its batches)."""
    counts = [row["prompts"] for domain, rows in report["domains"].items() if domain != "all" for row in rows.values()]
    largest = min(report["batch_size"], max(counts, default=report["batch_size"]))
    return f" (at most {largest} decoded together: the prompts a domain has)" if largest < report["batch_size"] else ""


def render_markdown(report: dict[str, Any]) -> str:
    methods = report["methods"]
    settings = [
        f"temperature {report['temperature']}",
        f"max_new_tokens {report['max_new_tokens']}",
        f"batch size {report['batch_size']}" + fewer_prompts(report),
        f"device {report['device']} ({report['dtype']}, {report['cpu_threads']} CPU thread"
        + ("s)" if report["cpu_threads"] != 1 else ")"),
    ]
    settings.append(f"chain γ={methods['chain']['gamma']}")
    if "tree" in methods:
        settings.append(f"tree {methods['tree']['nodes']} nodes, depth {methods['tree']['depth']}")
    lines = [
        f"# Eval: {report['drafter']['type']} drafter for {report['target']['id']}",
        "",
        f"drafter `{report['drafter']['path']}`; verified by the {report.get('verifier', 'target')}; "
        + ", ".join(settings)
        + ".",
        "",
        "| domain | method | served by | prompts | τ | α | per position | draft fwd/cycle | tok/s | speedup | "
        "lossless |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|:---:|",
    ]
    for domain in report["baselines"]:
        rows = {**report["baselines"][domain], **report["domains"][domain]}
        for name in methods:
            row = rows[name]
            lossless = {True: "yes", False: "**NO**", None: "n/a"}[row["lossless"]]
            if row.get("near_ties"):  # partings the target's rounding decides (eval/partings.py)
                lossless += f" ({row['near_ties']} near tie{'s' if row['near_ties'] > 1 else ''})"
            if row.get("same_output") is not None:  # another model than the verifier: how often it agrees
                lossless = f"{row['same_output']:.0%} same"
            served_by = methods[name].get("served_by", "–")
            lines.append(
                f"| {cell(domain)} | {name} | {served_by} | {row['prompts']} | {_fmt(row['tau'])} "
                f"| {_fmt(row['alpha'])} | {per_position_cell(row)} | {_fmt(row['draft_forwards_per_cycle'])} "
                f"| {row['tokens_per_s']:.1f} | {speedup_cell(row, name)} | {lossless} |"
            )
    lines += [
        "",
        "τ: new tokens per target forward (bonus included, prefill not counted). α: accepted / drafted positions. "
        "Per position: acceptance at draft position k given positions < k were accepted. "
        "Draft fwd/cycle: the drafter's forward passes per target forward. "
        "Speedup: tokens/s over plain decoding in the same run (in brackets its 95% interval over the prompts, or "
        f"the batches at batch size > 1; none from fewer than {MIN_TIMED_BATCHES}, or from timings that do not "
        "pair with plain decoding's). "
        "Served by: the engines that can serve the method as measured, for this drafter and target (vLLM 0.32 "
        "verifies chains only; an engine that serves no drafter of this kind is not named (the README's table); "
        "report.json's not_served_by, where present, says why an engine serving the kind does not serve this one: "
        "its export refuses the drafter, or at temperature > 0 it drafts greedily where the drafter samples its "
        "drafts, or its build samples speculative requests wrongly). "
        f"Lossless: {report['lossless_check']}.",
        "",
    ]
    lines += prompts_in_train_lines(report.get("prompts_in_train"))  # absent from an older report
    if "batch_sweep" in report:
        lines += render_batch_sweep(report["batch_sweep"])
    return "\n".join([*lines, *conclusion(report)])


def prompts_in_train_lines(counted: Optional[dict[str, Any]]) -> list[str]:
    """Where the report's prompts are prompts data.train answers (data_prep/overlap.py), or that nothing could
    count them: its τ on those prompts is of answers the drafter trained on."""
    if not counted or counted["prompts"] == 0:
        return []
    if counted["prompts"] is None:
        return [f"Prompts in data.train: not counted ({counted['not_counted']}).", ""]
    domains = ", ".join(f"{domain} {n}" for domain, n in counted["per_domain"].items() if n)
    return [
        f"**{counted['prompts']} of these {counted['of']} prompts are prompts data.train answers** ({domains}): the "
        "drafter trained on an answer to each, so τ on them is higher than on prompts it has not seen.",
        "",
    ]


FREE_BASELINES = {NGRAM: "n-gram lookup", SUFFIX: "suffix decoding"}
FREE_FASTER = "on this traffic a free method is faster"  # the report's words, and a monitor check's
# Plain decoding of one target runs at about one rate whatever the domain: rates this far apart say other work shared
# the cores while some domains were timed (seen on a shared 2-core machine: 11.9 tokens/s on one domain, 476 on the
# others, and a pooled "win" of 1.90x from chains at 0.80-2.07x)
DISTURBED_SPREAD = 4.0
MIN_TIMED_S = 0.2  # a domain's plain decoding timed for less than this says little about its rate


def disturbed_timing(report: dict[str, Any]) -> Optional[str]:
    """What says the timings were disturbed (plain decoding's domains' rates DISTURBED_SPREAD apart), or None."""
    rates = {
        domain: rows["plain"]["tokens_per_s"]
        for domain, rows in report["baselines"].items()
        if domain != "all" and "plain" in rows and (rows["plain"].get("wall_s") or 0) >= MIN_TIMED_S
    }
    if len(rates) < 2 or not min(rates.values()):
        return None
    slow, fast = min(rates, key=rates.get), max(rates, key=rates.get)
    if rates[fast] < DISTURBED_SPREAD * rates[slow]:
        return None
    return f"plain decoding ran at {rates[slow]:.1f} tokens/s on {slow} and {rates[fast]:.1f} on {fast}"


def conclusion(report: dict[str, Any], engine: Optional[str] = None) -> list[str]:
    """The report's last lines: over all domains, whether the trained drafter beat plain decoding and the
    strongest free baseline (n-gram lookup, suffix decoding: no training, no draft forward) in wall-clock
    time here, and, when it did not, what in this report accounts for it. With `engine` (its name, as a method's
    served_by names it: an export's card) only the ways of drafting that engine serves are weighed; without, the best
    of all, named as no engine's where none serves it (a DDTree)."""
    rows, methods = {**report["baselines"]["all"], **report["domains"]["all"]}, report["methods"]
    drafted = {name: rows[name] for name, method in methods.items() if method.get("group") == "drafter"
               and (engine is None or engine in method.get("served_by", ""))}  # fmt: skip
    if not drafted or any(row["speedup"] is None for row in drafted.values()):
        return []
    name, best = max(drafted.items(), key=lambda item: item[1]["speedup"])
    name += f" ({EVAL_ONLY})" if methods[name].get("served_by") == EVAL_ONLY else ""
    free = {key: rows[key] for key in FREE_BASELINES if key in rows and rows[key]["speedup"] is not None}
    strongest = max(free, key=lambda key: free[key]["speedup"], default=None)
    versus = "".join(
        f" and {FREE_BASELINES[key]}'s {row['speedup']:.2f}× (τ {_fmt(row['tau'])})" for key, row in free.items()
    )
    measured = (
        f"the drafter's best, {name}, runs at {best['speedup']:.2f}× plain decoding (τ {_fmt(best['tau'])}), "
        f"against plain's 1.00×{versus}"
    )
    unmeasured = "".join(f" ({key} not measured: {why})" for key, why in report.get("not_measured", {}).items())
    if disturbed := disturbed_timing(report):  # no speed-up of it says anything of the drafter
        return [
            f"**Result:** {measured}: the timings were disturbed, not a measure of the drafter: {disturbed}, where one "
            f"target decodes at about one rate (other work on the cores; run again on idle ones){unmeasured}.",
            "",
        ]
    if best["speedup"] > 1.0 and best["tau"] is not None and best["tau"] <= 1.0:  # no target forward saved
        return [
            f"**Result:** {measured}: no wall-clock win on {report['device']}: at τ ≤ 1 it saved no target forward, "
            f"so its speed-up is the timing's noise (decode more: eval.max_prompts, eval.max_new_tokens){unmeasured}.",
            "",
        ]
    to_beat = max(1.0, free[strongest]["speedup"] if strongest else 0.0)
    interval = best.get("speedup_interval")  # absent from an older report
    if best["speedup"] > to_beat and "speedup_interval" in best and interval is None:
        if timed_batches(report, best) < MIN_TIMED_BATCHES:
            fewer = ", or fewer together: eval.batch_size" if report["batch_size"] > 1 else ""
            why = (
                f"too few (under {MIN_TIMED_BATCHES}) to tell a win from the timing's noise (decode more: "
                f"eval.max_prompts{fewer})"
            )
        else:  # eval/counts.py's other reasons for no interval
            why = (
                "but their timings gave no interval to tell a win from the timing's noise: they do not pair batch "
                "for batch with plain decoding's, or most of them took no measurable time"
            )
        return [
            f"**Result:** {measured}: no clear wall-clock win on {report['device']}: {timed(report, best)}, "
            f"{why}{unmeasured}.",
            "",
        ]
    if best["speedup"] > to_beat and interval and interval[0] <= to_beat:  # a few prompts' timings carry it
        beaten = "plain's 1.00×" if to_beat == 1.0 else f"{FREE_BASELINES[strongest]}'s {to_beat:.2f}×"
        resampled = "batches" if report["batch_size"] > 1 else "prompts"
        return [
            f"**Result:** {measured}: no clear wall-clock win on {report['device']}: its 95% interval over the "
            f"{resampled}, {interval[0]:.2f}–{interval[1]:.2f}×, reaches {beaten} (decode more: eval.max_prompts, "
            f"eval.max_new_tokens){unmeasured}.",
            "",
        ]
    if best["speedup"] > to_beat:
        return [
            f"**Result:** {measured}: the trained drafter wins in wall-clock time on {report['device']}{unmeasured}.",
            "",
        ]
    if best["speedup"] > 1.0:  # behind a free method, which drafts without a forward
        row = free[strongest]
        if beyond_noise(row, best["speedup"]):
            why = f"{FREE_FASTER}: {FREE_BASELINES[strongest]}, which drafts with no forward of its own, beats it"
        elif "speedup_interval" in row and row["speedup_interval"] is None:  # too few timings: no noise was measured
            why = (
                f"{FREE_BASELINES[strongest]}'s {row['speedup']:.2f}× is ahead of it, but its timings gave no "
                "interval to tell that from the timing's noise (decode more: eval.max_prompts, eval.max_new_tokens)"
            )
        else:
            why = (
                f"{FREE_BASELINES[strongest]}'s {row['speedup']:.2f}× is within the timing's noise of it (decode "
                "more: eval.max_prompts, eval.max_new_tokens)"
            )
    elif best["tau"] is not None and best["tau"] <= 1.0:  # nothing saved, so nothing to weigh a cost against
        why = "at τ ≤ 1 it saved no target forward" + (
            ", and it proposed no draft (decode more: eval.max_new_tokens)"
            if not best["draft_forwards_per_cycle"]
            else f", and each took {_fmt(best['draft_forwards_per_cycle'])} of the drafter's forwards"
        )
    else:
        why = (
            f"each target forward gave {_fmt(best['tau'])} tokens, and each also took "
            f"{_fmt(best['draft_forwards_per_cycle'])} of the drafter's forwards, which with the loop's bookkeeping "
            'cost more here than the target forwards they saved (docs/eval.md, "τ and speed-up")'
        )
        if strongest and beyond_noise(free[strongest], best["speedup"]):  # where the drafter does not win
            row = free[strongest]
            high = (row.get("speedup_interval") or [row["speedup"]] * 2)[1]  # below plain beyond the noise: said so
            why += (
                f"; {FREE_FASTER}: {FREE_BASELINES[strongest]}"
                if beyond_noise(row, 1.0)
                else f"; {FREE_BASELINES[strongest]} is faster than the drafter, though "
                + ("within plain decoding's noise" if high >= 1.0 else "slower than plain decoding too")
            )
    return [f"**Result:** {measured}: no wall-clock win on {report['device']}: {why}{unmeasured}.", ""]


def cell(text: str) -> str:
    """A name (a data set's domain) as a markdown table's cell: a `|` in it would end the cell."""
    return text.replace("|", "\\|")


def beyond_noise(row: dict[str, Any], than: float) -> bool:
    """Whether a free method's speed-up is above `than` beyond the timing's noise, as a drafter's win must be: the
    low end of its 95% interval above it (no interval: not); a report from before the interval by its estimate."""
    if "speedup_interval" not in row:
        return row["speedup"] > than
    interval = row["speedup_interval"]
    return interval is not None and interval[0] > than


def timed_batches(report: dict[str, Any], row: dict[str, Any]) -> int:
    """The batches the row's interval resamples: its prompts, or at batch size > 1 the batches they were timed in
    (a domain's prompts form its batches)."""
    size = report["batch_size"]
    if size == 1:
        return row["prompts"]
    return sum(-(-rows["plain"]["prompts"] // size) for domain, rows in report["baselines"].items() if domain != ALL)


def timed(report: dict[str, Any], row: dict[str, Any]) -> str:
    if report["batch_size"] == 1:
        return f"{row['prompts']} prompts timed"
    return f"{row['prompts']} prompts timed in {timed_batches(report, row)} batches"


def speedup_cell(row: dict[str, Any], name: str) -> str:
    """A row's speed-up over plain decoding with its 95% interval (none for plain itself), or – where it has none
    (a report from before speed-ups); the report's table and an export's card show it so."""
    if row.get("speedup") is None:
        return "–"
    interval = row.get("speedup_interval")
    spread = "" if name == "plain" or not interval else f" ({interval[0]:.2f}–{interval[1]:.2f})"
    return f"{row['speedup']:.2f}×{spread}"


def render_batch_sweep(sweep: dict[str, Any]) -> list[str]:
    lines = [
        "## Batch sizes",
        "",
        "Prompts decoded together, one target forward per cycle for the batch; speedup is over plain decoding at the "
        "same batch size.",
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
            lines.append(f"| {cell(domain)} | {name} | " + " | ".join(cells) + " |")
    for size in sweep["batch_sizes"]:  # as the report's own rates are weighed (its conclusion)
        if disturbed := disturbed_timing({"baselines": sweep["rows"][str(size)]}):
            lines += [
                "",
                f"The timings at batch size {size} were disturbed, not a measure of any method: {disturbed}, "
                "where one target decodes at about one rate (other work on the cores; run again on idle ones).",
            ]
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
                right.plot(
                    range(1, len(rates) + 1), values, style, color=f"C{color}", marker="o", label=f"{domain} {name}"
                )
    right.set_xticks(range(1, depth + 1))
    right.set_ylim(0, 1)
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance given earlier positions accepted")
    right.set_title("per-position acceptance")
    right.legend(fontsize="small")
    fig.tight_layout()
    save_figure_atomic(fig, path)


def plot_batch_sweep(report: dict[str, Any], path: Path) -> None:
    """Speed-up over plain decoding at each batch size: a panel per domain (all first), a line per method."""
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
    save_figure_atomic(fig, path)
