"""The model card (README.md) of an exported folder: YAML front matter the Hub reads, the serving
command, draftsmith's per-domain acceptance from the eval report, the engine-side numbers when the
folder was checked in the engine, what it was trained on, and the conventions converted on export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from huggingface_hub import ModelCard, ModelCardData
from omegaconf import OmegaConf

from draftsmith.engines import SERVING_ENGINES
from draftsmith.eval.partings import NEAR_TIE_UNITS
from draftsmith.eval.render import FREE_BASELINES, conclusion, per_position_cell, speedup_cell
from draftsmith.export.schedule import pays_line
from draftsmith.formats.repo import (
    TRUST_REMOTE_CODE_FLAG,
    VLLM_CPU_PYTHON,
    VLLM_CPU_SAMPLING_FAULT,
    EngineRepo,
    vllm_cpu_serve,
    vllm_serve_flags,
)
from draftsmith.formats.versions import CPU_BUILD
from draftsmith.heads import drafter_class
from draftsmith.heads.base import DRAFTER_DIR
from draftsmith.outputs import FINAL_DIR, RECIPE_NAME, RUN_SUMMARY_NAME
from draftsmith.trainer.checkpoint import STATE_NAME
from draftsmith.trainer.heldout import BEST_DIR, BEST_JSON


def write_card(
    folder: Path,
    repo: EngineRepo,
    info: dict[str, Any],
    report: Optional[dict[str, Any]],
    served_as: str,
    revision: Optional[str] = None,
) -> None:
    """`served_as`: the drafter's path or Hub repo; `revision`: the branch it is on when not main, which the
    command names (engines load main otherwise, which does not hold it)."""
    kind, engine = info["drafter_type"], repo.engine
    base_model = hub_id(info)
    data = ModelCardData(
        base_model=base_model,
        library_name=engine,
        pipeline_tag="text-generation",
        license=target_license(info),
        tags=["speculative-decoding", "draftsmith", kind, engine],
    )
    gamma = info["num_speculative_tokens"]
    model = f"{served_as}/{repo.weights_dir}" if repo.weights_dir else served_as
    method, *rest = info["speculative_config"].items()
    branch = [("revision", revision)] if revision else []  # vLLM's SpeculativeConfig.revision
    speculative_config = json.dumps(dict([method, ("model", model), *branch, *rest]))
    command = repo.serve.format(
        target=target_in_command(info),
        path=served_as,
        gamma=gamma,
        gamma_plus_one=gamma + 1,
        speculative_config=speculative_config,
        dtype=info["target_dtype"],
        engine_flags=vllm_serve_flags(
            {**(info.get("engine_arguments") or {}), **(info.get("verified") or {}).get("engine_arguments", {})},
            info.get("target_overrides"),
            info.get("compilation_config"),
        ),
        revision_flags=f" {repo.revision_flag} {revision}" if revision and repo.revision_flag else "",
        trust_flags=TRUST_REMOTE_CODE_FLAG if info.get("trust_remote_code") else "",
    )
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# {drafter_class(kind).TITLE} drafter for `{info['target']['id']}` ({engine})",
        "",
        f"A speculative-decoding drafter trained with draftsmith for `{info['verifier']}`"
        + ("" if base_model else " (a local folder: the card's metadata names no base_model, which must be a Hub id)")
        + f": {engine} proposes tokens with it and verifies them with the target in one forward pass, so the output "
        "is exactly the target's.",
        "",
        "## Serve it",
        "",
        "```bash",
        command,
        "```",
        "",
        *cpu_build_serving(command, info.get("verified")),
        served_note(engine, info.get("verified"), info["target_dtype"]),
        "",
        *([f"Engine releases: {info['vllm_releases']}.", ""] if info.get("vllm_releases") else []),
        *([f"Engine builds: {info['vllm_builds']}.", ""] if info.get("vllm_builds") else []),
        *([MONITOR_FLAG, ""] if engine == "vllm" else []),
        *gamma_note(engine, gamma, info.get("recommended_num_speculative_tokens")),
        *acceptance_section(report, SERVING_ENGINES[engine].name),
        *engine_section(info.get("verified")),
        *batch_section(info.get("batch_schedule")),
        *training_section(info),
        "## Conventions converted on export",
        "",
        *[f"- **{key}**: {describe(value)}" for key, value in info["conventions"].items()],
        "",
        "`draftsmith_export.json` records the source checkpoint (path and sha256), the drafter's settings and these "
        "conversions.",
        "",
    ]
    ModelCard("\n".join(lines)).save(folder / "README.md")


# what `draftsmith monitor` reads per request (docs/monitor.md): a newcomer serving the card's line had every domain
# replayed, minutes of eval each check, for want of the flag
MONITOR_FLAG = (
    "Watched by `draftsmith monitor`: add `--per-request-spec-decode-metrics summary` to the serving command (vLLM "
    "0.32 and later) and log each response's `metrics` with its request, and each domain's acceptance is read from "
    "the engine's own counts instead of replaying the requests (docs/monitor.md)."
)


def cpu_build_serving(command: str, verified: Optional[dict[str, Any]]) -> list[str]:
    """The serving command as vLLM's CPU build runs it, where the folder was checked in that build (the `vllm` command
    of its wheel stops at start)."""
    if (verified or {}).get("engine_build") != CPU_BUILD:
        return []
    version = verified["engine_version"]
    sampling = (
        [f"Send it greedy requests only (temperature 0): vLLM's CPU build {version} samples a speculative request at "
         "temperature > 0 from another distribution than the target's (vllm-project/vllm#55005, measured by "
         "draftsmith; with that build's kernel mended, this kind of folder samples exactly).", ""]
        if version in VLLM_CPU_SAMPLING_FAULT else []
    )  # fmt: skip
    return [
        f"With vLLM's CPU build (`{CPU_BUILD}`, which the check below ran), whose `vllm` command stops at start, the "
        "same server runs from its module (host memory for its cache, eager), by the Python of the environment "
        f"{CPU_BUILD} is installed in (`{VLLM_CPU_PYTHON}` below: the export's `export.vllm_python`; draftsmith's "
        "own has no vLLM):",
        "",
        "```bash",
        vllm_cpu_serve(command),
        "```",
        "",
        *sampling,
    ]


# what each engine's serving command calls γ, the draft tokens proposed a step
GAMMA_KNOBS = {"vllm": "`num_speculative_tokens`", "sglang": "`--speculative-num-steps`"}


def gamma_note(engine: str, gamma: int, recommended: Optional[dict[str, Any]]) -> list[str]:
    """The recommended γ (export/gamma.py) when the eval report allowed one."""
    if not recommended:
        return []
    tokens = ", ".join(f"γ={g}: {t}" for g, t in recommended["tokens_per_cycle"].items())
    knob = GAMMA_KNOBS.get(engine, "`num_speculative_tokens`")  # the engine's own name for γ in its command
    return [
        f"Recommended γ ({knob}): **{recommended[engine]}**, from the eval report: expected tokens "
        f"per cycle {tokens}; one draft forward costs {recommended['draft_forward_cost']} target forwards there. "
        + (
            f"The command above serves the γ this folder was exported with, {gamma}: export with "
            f"`export.num_speculative_tokens={recommended[engine]}` to serve the recommended one."
            if recommended[engine] != gamma
            else "The command above serves it."
        )
        + (
            f" By these figures no γ decodes faster than the target alone ({recommended['expected_speedup']} tokens "
            "per unit of cost at best): draftsmith's loop's costs are not the engine's, so measure the served speed "
            "(`draftsmith sweep`) before serving it."
            if recommended.get("expected_speedup", 1) < 1
            else ""
        ),
        "",
    ]


def served_note(engine: str, verified: Optional[dict[str, Any]], dtype: str) -> str:
    """What was checked, what the check found, and under which engine settings: the command's `--dtype` is the dtype
    draftsmith ran the target in (vLLM's default serves a float32 checkpoint in bfloat16, whose acceptance was not
    measured), and the command carries the check's settings that serving needs (`vllm_serve_flags`)."""
    if verified:
        arguments = verified["engine_arguments"]
        ties = verified.get("plain_partings")  # absent from checks before 2026-12-01, which did not compare them
        ours = (
            "vLLM's plain output equals draftsmith's plain decoding."
            if verified["equals_draftsmith_plain"]
            else f"vLLM's plain output parts from draftsmith's plain decoding in {arguments['dtype']} on {len(ties)} "
            f"of them, each at a near tie (up to {max(tie['units'] for tie in ties)} units)."
            if ties
            else f"draftsmith's plain decoding in {arguments['dtype']} differed from vLLM's (the two engines round "
            "differently): the acceptance was compared instead."
        )
        flags = vllm_serve_flags(arguments)
        said = {"--no-enable-prefix-caching": "with prefix caching off", "--language-model-only": "text only",
                "--disable-hybrid-kv-cache-manager": "with the hybrid KV cache manager off"}  # fmt: skip
        settings = " and ".join(what for flag, what in said.items() if flag in flags)
        served_so = f", and {settings}, as the command serves it (`{flags.strip()}`)" if settings else ""
        return (
            f"Tested: this folder was loaded in vLLM {verified['engine_version']} as the speculative model for the "
            f"target in {arguments['dtype']} (the command's `--dtype`) on {verified['prompts']} eval prompts (greedy, "
            f"{verified['max_new_tokens']} new tokens, γ={verified['num_speculative_tokens']}): "
            f"{found_identical(verified)} {ours} The check ran vLLM eager (`enforce_eager`) with max_model_len "
            f"{arguments['max_model_len']}, settings that change memory and speed, not the tokens{served_so}."
        )
    return (
        f"{SERVING_ENGINES[engine].unchecked} The command serves the target in {dtype}, the dtype draftsmith loaded "
        "it in (`target.dtype`), as its eval does."
    )


def found_identical(verified: dict[str, Any]) -> str:
    """What the check found of vLLM's outputs with the drafter against its outputs without it: identical, or
    identical but for prompts where they part at a near tie (the check fails any other parting: export/verify.py)."""
    if verified["lossless"]:
        return "outputs identical to vLLM without speculation."
    partings = verified.get("partings") or []
    largest = max(parting["units"] for parting in partings)
    return (
        f"outputs identical to vLLM without speculation on {verified['prompts'] - len(partings)} of them; on the "
        f"other {len(partings)} the outputs part at a near tie, two tokens the target's own logits put within its "
        f"rounding (up to {largest} units of bfloat16 at the logits' magnitude; the check allows {NEAR_TIE_UNITS}), "
        "which vLLM's verify and decode forwards can round either way."
    )


def acceptance_section(report: Optional[dict[str, Any]], engine_name: str) -> list[str]:
    if report is None:
        return [
            "## Acceptance",
            "",
            "No eval report was found for this checkpoint (run `python -m eval` and export again).",
            "",
        ]
    methods = report["methods"]
    lines = [
        "## Acceptance (draftsmith eval)",
        "",
        f"Temperature {report['temperature']}, {report['max_new_tokens']} new tokens, {report['device']} "
        f"({report['dtype']}); chain γ={methods['chain']['gamma']}"
        + (f", tree {methods['tree']['nodes']} nodes" if "tree" in methods else "")
        + ". "
        "τ: new tokens per target forward (bonus included); α: accepted / drafted; per position: acceptance at draft "
        "position k given the earlier ones were accepted; lossless: token-identical to plain greedy decoding; "
        f"speed-up: tokens/s over plain decoding in draftsmith's own loop on {report['device']}"
        + (f" with {report['cpu_threads']} thread(s)" if report["device"] == "cpu" and "cpu_threads" in report else "")
        + f" at batch size {report.get('batch_size', 1)} (95% interval), a guide to the drafter against the free "
        "methods, not an engine's speed: the engine's is the sweep's (`draftsmith sweep`). This loop drafts each "
        "prompt's first new token too, which an engine takes from its prefill without drafting: on short answers its "
        "τ reads above what the engine serves (4.5% in vLLM on answers of 19 tokens); an engine check compares the "
        "two on the engine's schedule.",
        "",
        "| domain | method | served by | τ | α | per position | speed-up | lossless |",
        "|---|---|---|---:|---:|---|---:|:---:|",
    ]
    for domain in report["domains"]:
        free = {k: v for k, v in report["baselines"][domain].items() if k in FREE_BASELINES}
        for method, row in {**report["domains"][domain], **free}.items():
            lossless = {True: "yes", False: "**no**", None: "n/a"}[row["lossless"]]
            tau = "–" if row["tau"] is None else f"{row['tau']:.2f}"
            alpha = "–" if row["alpha"] is None else f"{row['alpha']:.2f}"
            served_by = methods.get(method, {}).get("served_by", "–")  # reports before served_by: unknown
            cells = [domain, method, served_by, tau, alpha, per_position_cell(row), speedup_cell(row, method), lossless]
            lines.append(f"| {' | '.join(cells)} |")
    # the eval's own verdict on the drafter against the free methods, over the ways of drafting this engine serves
    return [*lines, "", *conclusion(report, engine_name)]


def engine_section(verified: Optional[dict[str, Any]]) -> list[str]:
    if not verified:
        return []
    at_least = " / ".join(f"{p:.2f}" for p in verified["at_least_engine"])
    ours = " / ".join(f"{p:.2f}" for p in verified["at_least_draftsmith"])
    ties = len(verified.get("partings") or [])
    lossless = "yes" if verified["lossless"] else f"yes but {ties} bfloat16 near-tie flip(s)" if ties else "**no**"
    return [
        f"## In vLLM {verified['engine_version']}",
        "",
        "| | τ | P(accepted ≥ k), k = 1.. | lossless |",
        "|---|---:|---|:---:|",
        f"| vLLM | {verified['tau_engine']:.3f} | {at_least} | {lossless} |",
        f"| draftsmith | {verified['tau_draftsmith']:.3f} | {ours} | yes |",
        "",
        f"Same prompts, greedy, chain γ={verified['num_speculative_tokens']}; τ differs by "
        f"{verified['relative_difference']:+.1%} (the check allows ±{verified['tolerance']:.0%}). vLLM counters: "
        f"{verified['counters']['num_drafts']} drafts, {verified['counters']['num_draft_tokens']} draft tokens, "
        f"{verified['counters']['num_accepted_tokens']} accepted.",
        "",
    ]


def batch_section(schedule: Optional[dict[str, Any]]) -> list[str]:
    """τ and speed-up at each measured batch size, beside the γ the served config uses there."""
    if not schedule:
        return []
    lines = [
        "## Speed-up by batch size",
        "",
        f"Measured in vLLM {', '.join(sorted({str(e.get('vllm_version')) for e in schedule['engine'] if e}))} "
        "by a load sweep "
        f"(`{schedule['sweep']}`, this drafter as `{schedule['method']}`): at each concurrency, requests in flight, "
        "the γ the schedule serves and what that γ measured. At γ 0 the drafter drafts nothing, but vLLM 0.32 still "
        "runs it: "
        + (
            "the sweep measured that cost (its speed-up below 1)."
            if schedule.get("gamma_0_measured")
            else "the sweep did not measure that cost, so the row shows plain decoding's."
        )
        + (
            f" The sweep's two runs of plain decoding differed by up to {schedule['noise']:.0%}: the schedule changes "
            f"γ only for a predicted gain of {schedule['margin']:.0%}."
            if schedule.get("noise") is not None
            else ""
        ),
        "",
        "| concurrency | γ served | τ (vLLM) | speed-up over plain |",
        "|---:|---:|---:|---:|",
    ]
    noise = schedule.get("noise")
    for concurrency, level in schedule["per_concurrency"].items():
        tau = "–" if level["tau"] is None else f"{level['tau']:.2f}"
        within = " (within the noise)" if noise is not None and abs(level["speedup"] - 1) <= noise else ""
        lines.append(f"| {concurrency} | {level['chosen']} | {tau} | {level['speedup']:.2f}×{within} |")
    slower = schedule.get("predicted_below_plain_at", [])
    if slower:
        ratios = ", ".join(f"{schedule['per_concurrency'][str(c)]['predicted_vs_plain']:.2f}×" for c in slower)
        lines += [
            "",
            f"**Predicted below plain decoding at concurrency {', '.join(map(str, slower))} ({ratios}, the γ served "
            f"there, the drafter's cost at γ 0 included): {pays_line(schedule)}.**",
        ]
    if schedule.get("below_plain_at"):
        lines += [
            "",
            f"**At concurrency {', '.join(map(str, schedule['below_plain_at']))} this drafter is predicted slower "
            "than plain decoding at any γ: at that load, serve the target without it.**",
        ]
    lines += [
        "",
        f"`num_speculative_tokens_per_batch_size` {schedule['num_speculative_tokens_per_batch_size']}: vLLM looks the "
        "γ up by the requests scheduled in a step (prefills included) and carries the last range's γ past its end. It "
        "ignores the schedule under data parallelism (`--data-parallel-size` > 1) and drafts the full γ on every rank.",
        "",
    ]
    return lines


def training_section(info: dict[str, Any]) -> list[str]:
    """What the drafter was trained on and how, from the run that saved the checkpoint (its recipe.yaml and the
    step the checkpoint holds), never from the eval's recipe, which names what the eval read."""
    served_keys = drafter_class(info["drafter_type"]).Config.SERVED  # an export's command line may set them
    trained = {key: value for key, value in info["drafter_config"].items() if key not in served_keys}
    served = {key: value for key, value in info["drafter_config"].items() if key in served_keys}
    lines = ["## Training", "", f"- drafter: `{info['drafter_type']}` with {compact(trained)}"]
    if decoding := compact(served):
        lines.append(f"- decoded with {decoding} (settings of decoding alone, which the export may have set)")
    checkpoint = Path(info["source"]["checkpoint"])
    run = next((folder for folder in checkpoint.parents[:3] if (folder / RECIPE_NAME).is_file()), None)
    if run is None:
        lines.append("- data and optimisation: not known (the checkpoint is not inside the run folder that trained it)")
    else:
        recipe = OmegaConf.to_container(OmegaConf.load(run / RECIPE_NAME))
        data, train = recipe.get("data", {}), recipe.get("train", {})
        steps = trained_steps(checkpoint, run)
        cut = data.get("max_conversations")  # the first N of each file: an operator reads how much it saw
        lines += [
            f"- data: {', '.join(f'`{Path(s).name}`' for s in data.get('train') or [])} (max_length "
            f"{data.get('max_length')}" + (f", the first {cut} conversations of each file" if cut else "") + ")",
            f"- optimisation: lr {train.get('lr')}, "
            + (f"{steps} steps" if steps is not None else f"up to {train.get('max_steps')} steps")
            + f", micro-batch {train.get('micro_batch_size')}, seed {train.get('seed')}",
        ]
    lines += drafter_class(info["drafter_type"]).learned_card_lines(info.get("learned") or {})
    return [*lines, ""]


def trained_steps(checkpoint: Path, run: Path) -> Optional[int]:
    """The optimizer steps behind a checkpoint of `run`: final/'s from run_summary.json, best/'s from its
    best.json, a step checkpoint's drafter/ from its trainer_state.json; None for another folder."""
    records = {
        run / FINAL_DIR: (run / RUN_SUMMARY_NAME, "steps"),
        run / BEST_DIR: (run / BEST_DIR / BEST_JSON, "step"),
        checkpoint.parent / DRAFTER_DIR: (checkpoint.parent / STATE_NAME, "step"),
    }
    path, key = records.get(checkpoint, (None, None))
    return json.loads(path.read_text()).get(key) if path is not None and path.is_file() else None


def describe(value: Any) -> str:
    if isinstance(value, dict):
        return "; ".join(f"{key}: {item}" for key, item in value.items())
    return str(value)


def compact(config: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in config.items() if key != "type" and value is not None)


def target_in_command(info: dict[str, Any]) -> str:
    """The target as the serving command names it: the verifier, pinned (`--revision`, both engines' flag for the
    target) to the Hub commit draftsmith read it at where it was read from the Hub by that name: the engine loads that
    commit, not whatever the repository's main holds by then."""
    revision = info["target"].get("revision")
    if revision and info["verifier"] == info["target"]["name_or_path"]:
        return f"{info['verifier']} --revision {revision}"
    return info["verifier"]


def hub_id(info: dict[str, Any]) -> Optional[str]:
    """The target's Hub id, for the card's base_model: the verifier the commands name when it is one (export.verifier
    may name the Hub copy of a target loaded from a folder), else the name the target was loaded by when it is one;
    None for a target known only by a local folder, which the Hub would refuse or link to a model of that name."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    for name in (info["verifier"], info["target"]["name_or_path"]):
        if Path(name).exists():  # a folder here, though named as an id could be ("models", "org/name")
            continue
        try:
            validate_repo_id(name)
        except HFValidationError:
            continue
        return name
    return None


def target_license(info: dict[str, Any]) -> Optional[str]:
    """The target's license, from the front matter of its local README; None when unknown."""
    readme = Path(info["target"]["name_or_path"]) / "README.md"
    if not readme.is_file() or not readme.read_text(errors="replace").startswith("---"):
        return None  # no front matter (huggingface_hub would log that it found none, once per engine folder)
    try:
        return ModelCard.load(readme).data.license
    except Exception:  # noqa: BLE001 - a README without front matter has no license to read
        return None
