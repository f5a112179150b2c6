"""The load sweep's rows once measured: the fields export/schedule.py reads, reading sweep.jsonl back
(export.batch_sweep), and the summary and plot over the rows. Apart from the measurement (export/sweep.py,
which serves the export in vLLM to take them): the export and the benchmarks read rows without serving."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from draftsmith.engines import NGRAM, SUFFIX
from draftsmith.errors import UserError, one_line

log = logging.getLogger("draftsmith.export")
# A free method drafts with no forward of its own, so a step verifying its γ drafts costs at most about γ + 1 plain
# steps, and its rate is at least about τ / (γ + 1) of plain's; a level below this share of that bound was slowed by
# other work on the cores (a journey, 2026-12-08: n-gram at 0.06× plain, τ about 1.3, beside another job)
DISTURBED_SHARE = 0.5
ROWS = "sweep.jsonl"  # the rows a sweep writes (export/sweep.py), one JSON object a line
PLAIN = "plain"
PLAIN_AGAIN = "plain-rerun"  # plain measured a second time in the same sweep: its noise
# What export/schedule.py reads from a row; the rest is for the reader of the sweep.
FIELDS = (
    "method",
    "gamma",
    "concurrency",
    "seconds",
    "tokens",
    "steps",
    "mean_batch",
    "drafts",
    "accepted_per_position",
)


def unreadable_why(text: str, number: int, count: int) -> str:
    """What a line that is not JSON says of the file: another file than the sweep's rows (its summary.json, one JSON
    document), or a last row cut short as it was written (the sweep stopped mid-write)."""
    try:
        json.loads(text)
        return f": one JSON document, not a sweep's JSON lines; give the sweep's {ROWS}"
    except json.JSONDecodeError:
        pass
    if number == count and not text.endswith("\n"):
        return ": the last row, cut short as it was written; delete that line and run the sweep again to measure it"
    return ""


def read_sweep(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a load sweep's JSONL; UserError naming the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"export.batch_sweep={str(path)!r} does not exist")
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text, so no load-sweep rows ({one_line(err)})") from None
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(
                f"{path}:{number}: not JSON ({one_line(err)}){unreadable_why(text, number, len(lines))}"
            ) from None
        missing = [key for key in FIELDS if key not in row] if isinstance(row, dict) else list(FIELDS)
        if missing:
            raise UserError(f"{path}:{number}: not a load-sweep row (missing {', '.join(missing)})")
        if bad := next((key for key, (fits, _) in FITS.items() if key in row and not fits(row[key])), None):
            raise UserError(f"{path}:{number}: not a load-sweep row ({bad}={json.dumps(row[bad])}: {FITS[bad][1]})")
        rows.append(row)
    return rows


def _count(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _measure(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


# what a row's value must be, and how its line says so; hand-edited ones were exit 70 (a division by 0 seconds) or
# exported (negative rates, NaN written into draftsmith_export.json)
FITS = {
    "method": (lambda v: isinstance(v, str), "a name"),
    **{key: (_count, "a count >= 0") for key in ("gamma", "tokens", "steps", "drafts")},
    "concurrency": (lambda v: _count(v, 1), "a count >= 1"),
    "seconds": (lambda v: _measure(v) and v > 0, "a finite time > 0"),
    "mean_batch": (_measure, "a finite number >= 0"),
    "accepted_per_position": (lambda v: isinstance(v, list) and all(map(_measure, v)), "a list of finite counts >= 0"),
    "source_sha256": (lambda v: v is None or isinstance(v, str), "a sha256 or null"),
    **{key: (lambda v: isinstance(v, dict), "a mapping") for key in ("engine", "load")},
}


def at_one_gamma(row: dict[str, Any]) -> bool:
    """Whether a sweep row measured one γ at every batch size: served without a schedule, or at γ 0 with
    one that drafts nowhere (export/sweep.py's `served_at`: how vLLM 0.32 takes γ 0). A row served with
    any other schedule (benchmarks/load_sweep.py's `<name>+schedule`) measured that schedule, not a γ a
    schedule is chosen from."""
    schedule = (row.get("engine") or {}).get("num_speculative_tokens_per_batch_size")
    return not schedule or all(k == 0 for _, _, k in schedule)


def rerun_noise(first: dict[int, float], again: dict[int, float]) -> float | None:
    """How far plain's second run (`again`: rates by concurrency) strays from its first, at worst over the
    concurrencies both measured (|ratio - 1|); None without a second run."""
    both = [c for c in first if c in again]
    return max(abs(again[c] / first[c] - 1) for c in both) if both else None


def crossover_of(best: dict[int, dict[str, Any]], levels: list[int]) -> int | None:
    """The concurrency from which on the best γ never beats plain (measured there and at every level above), None
    where it beats plain at the largest: "the first that loses" named a crossover below a level it won at."""
    losing = None
    for c in reversed(levels):
        if best.get(c, {}).get("beats_plain") is not False:
            break
        losing = c
    return losing


def summarize(
    rows: list[dict[str, Any]], methods: Sequence[str], swept: Optional[dict[str, Sequence[int]]] = None
) -> dict[str, Any]:
    """Per method the γs it has rows at and, of those `swept` (method -> γs) says it was served at, those it has
    none at (a free baseline the engine failed to serve); the best γ > 0 at each concurrency, whether it beats plain
    (`beats_plain`: false, serve plain there) and whether that speed-up is within the sweep's `noise` of 1
    (`within_noise`: then neither reading holds), and the crossover (the concurrency from which on even the best γ
    never beats plain: a curve that dips and recovers has none); the drafter loaded at γ 0 over plain; plain's
    second run over its first, whether every row was lossless, and the free methods' rows slower than drafting with
    no forward can be (`disturbed`: DISTURBED_SHARE, said in a warning). γ 0 is never a best γ: it is the drafter loaded
    drafting nothing, plain serving at the drafter's engine settings, not a speculation setting to serve."""
    levels = sorted({r["concurrency"] for r in rows})
    first = {r["concurrency"]: r["tok_s"] for r in rows if r["method"] == PLAIN}
    again = {r["concurrency"]: r["tok_s"] for r in rows if r["method"] == PLAIN_AGAIN}
    noise = rerun_noise(first, again)  # export/schedule.py's margin
    gammas = {}
    for method in methods:
        measured = sorted({r["gamma"] for r in rows if r["method"] == method})
        missing = sorted(set((swept or {}).get(method, ())) - set(measured))
        gammas[method] = {"measured": measured, "not_measured": missing}
    best: dict[str, dict[int, dict[str, Any]]] = {}
    for method in methods:
        best[method] = {}
        for c in levels:
            candidates = [r for r in rows if r["method"] == method and r["concurrency"] == c and r["gamma"] > 0]
            if candidates:
                top = max(candidates, key=lambda r: r["tok_s"])
                # requests: how many prompts τ is over (max(min_requests, requests_per_slot x c)), so τ at two levels
                # differs by the prompts as well as by the load
                best[method][c] = {key: top[key] for key in ("gamma", "speedup", "tok_s", "tau", "requests")}
                best[method][c]["beats_plain"] = None if top["speedup"] is None else top["speedup"] > 1.0
                best[method][c]["within_noise"] = (
                    None if top["speedup"] is None or noise is None else abs(top["speedup"] - 1) <= noise
                )
    crossover = {method: crossover_of(best[method], levels) for method in methods}
    loaded_at_gamma_0 = {
        method: {r["concurrency"]: r["speedup"] for r in rows if r["method"] == method and r["gamma"] == 0}
        for method in methods
        if any(r["method"] == method and r["gamma"] == 0 for r in rows)
    }
    disturbed = [
        f"{r['method']} at γ {r['gamma']}, c={r['concurrency']} ({r['speedup']:.2f}× plain at τ {r['tau']:.2f})"
        for r in rows
        if r["method"] in (NGRAM, SUFFIX) and r.get("speedup") and r.get("tau")
        and r["speedup"] < DISTURBED_SHARE * r["tau"] / (r["gamma"] + 1)
    ]  # fmt: skip
    if disturbed:
        log.warning(
            "load sweep: %s ran far slower than a method drafting with no forward can (τ / (γ + 1) of plain at "
            "least): timings disturbed by other work on the cores; measure again on idle ones", "; ".join(disturbed)
        )  # fmt: skip
    lossless = {
        m: all(r["lossless"] for r in rows if r["method"] == m and r["lossless"] is not None)
        for m in {r["method"] for r in rows}
    }
    return {
        "gammas": gammas,
        "best_per_concurrency": best,
        "crossover": crossover,
        "noise": None if noise is None else round(noise, 4),
        "disturbed": disturbed,
        "loaded_at_gamma_0": loaded_at_gamma_0,
        "lossless": lossless,
        "plain_rerun_over_plain": {c: round(again[c] / first[c], 4) for c in levels if c in again and c in first},
        "engine": rows[0]["engine"]["vllm_version"] if rows else None,
    }


def best_label(method: str, gammas: Optional[dict[str, list[int]]]) -> str:
    """The legend's name for `method` at its best γ, saying which γs that best is of when some were not measured
    (`gammas`: the method's entry of `summarize`'s "gammas")."""
    if not gammas or not gammas["not_measured"]:
        return f"{method} (best fixed γ)"
    drafting = [gamma for gamma in gammas["measured"] if gamma > 0]  # γ 0 is never a best γ (`summarize`)
    if not drafting:
        return f"{method} (not measured)"
    ran, missing = (", ".join(map(str, listed)) for listed in (drafting, gammas["not_measured"]))
    return f"{method} (best of γ {ran}; γ {missing} not measured)"


def plot(
    best: dict[str, dict[int, dict[str, Any]]],
    dashed: dict[str, dict[int, float]],
    path: Path,
    gammas: Optional[dict[str, dict[str, list[int]]]] = None,
) -> None:
    """Speed-up over plain against concurrency: each method at its best γ (named with the γs it was measured
    at where `gammas`, `summarize`'s, says some were not), and `dashed` (label -> concurrency -> speed-up)
    such as a schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({c for per_level in [*best.values(), *dashed.values()] for c in per_level})
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for method, per_level in best.items():
        xs = [c for c in levels if c in per_level]
        axes.plot(
            xs, [per_level[c]["speedup"] for c in xs], marker="o", label=best_label(method, (gammas or {}).get(method))
        )
    for label, per_level in dashed.items():
        xs = sorted(per_level)
        axes.plot(xs, [per_level[c] for c in xs], marker="s", linestyle="--", label=label)
    axes.axhline(1.0, color="grey", linewidth=1)
    axes.set_xscale("log", base=2)
    axes.set_xticks(levels, [str(c) for c in levels])
    axes.set_xlabel("concurrency (requests in flight)")
    axes.set_ylabel("output tokens/s over plain decoding")
    axes.set_title("Speed-up against load, vLLM")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def findings_line(summary: dict[str, Any], method: str) -> str:
    """What a sweep found, for its log line (not only its files): the drafter's best speed-up over plain at each
    concurrency, and the γ per batch size it gives (or none)."""
    best = summary["best_per_concurrency"].get(method, {})
    measured = ", ".join(f"c={c} {at['speedup']:.2f}× at γ {at['gamma']}" for c, at in best.items() if at["speedup"])
    schedule = summary["schedule"].get("num_speculative_tokens_per_batch_size")
    return f"{method} {measured or 'not measured'} over plain; γ per batch size {schedule or 'none'}"
