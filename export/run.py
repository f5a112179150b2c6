"""The export job: checkpoint in, one checked engine folder per engine out (see export/__init__.py).

Order, so that a bad combination never leaves a folder behind: every engine's folder is built and
checked (names and shapes the engine loads, conventions converted) before anything is written; each
is staged under `<engine>.tmp`, read back into a drafter whose re-export must give the same tensors,
loaded in vLLM when `export.vllm_python` names a Python that has it, given its model card and
`draftsmith_export.json`, and only then renamed into place (a failure on the way removes the staged
folder). Pushing comes last.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from draftsmith.engines import SERVING_ENGINES
from draftsmith.errors import InternalError, UserError
from draftsmith.eval.render import report_gaps
from draftsmith.export.gamma import chain_engines, recommended_gamma
from draftsmith.export.schedule import batch_schedule_of
from draftsmith.files import (
    checkpoint_digest,
    file_sha256,
    publish_folder,
    read_json,
    save_safetensors,
    staging,
    write_json,
)
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.folder import (
    require_outside_published,
    require_recipes_kind,
    require_same_serving,
    served_values,
    with_served,
)
from draftsmith.formats.repo import (
    EXPORT_INFO,
    EngineRepo,
    TargetInfo,
    check_tensors,
    copy_tokenizer,
    require_report_served,
    served_dtype,
    vllm_pinned,
)
from draftsmith.formats.versions import (
    VLLM_PYTHON_KEY,
    cpu_build_limit,
    require_build_serves,
    require_draft_config_read_as_written,
    require_engine_imports,
    require_vllm_serves,
    served_builds,
    served_by,
    served_target_limit,
)
from draftsmith.heads.base import EVAL_SPLIT_METRICS, WEIGHTS_NAME, load_drafter, read_checkpoint_config, saved_drafter
from draftsmith.outputs import EVAL_DIR, REPORT_NAME, DirectoryLock, move_aside
from draftsmith.target import (
    TargetShape,
    config_json,
    dtype_name,
    load_target,
    loaded_config,
    resolve_device,
    resolve_dtype,
)
from draftsmith.target_loading import load_config

EXPORT_FORMAT = 1


def export_checkpoint(cfg: DictConfig, checkpoint: Path, target=None, engines=None, served=None) -> dict[str, Path]:
    """Export `checkpoint` for every engine in export.engines; returns engine -> folder. `engines`: an
    export.verify.EngineSession to ask vLLM and run its check in (one of its own, closed at the end, if None); `served`:
    the SERVED drafter settings the command line gave (formats/folder.py's served_settings)."""
    output = Path(cfg.export.output or Path(cfg.output_dir) / "export")
    from draftsmith.export.push import require_push_allowed

    require_push_allowed(cfg)
    named = f"export.output={str(output)!r}"
    require_outside_published(output, checkpoint, named, "the eval report and the monitor identify it by")
    from draftsmith.export.verify import EngineSession, verify_in_vllm

    # one session for every question put to vLLM and the check: vLLM imported once (its own, closed at the end)
    opened = nullcontext(engines) if engines is not None else EngineSession()
    with DirectoryLock(output, key="export.output"), opened as session:
        saved = read_checkpoint_config(checkpoint)
        kind = saved["drafter_type"]
        # the rule a warm start follows: the recipe is for the drafter it reads
        require_recipes_kind(kind, cfg.drafter.type, f"checkpoint={checkpoint}", role="is for")
        exporter_for(kind).check_engines(kind, list(cfg.export.engines), cfg.export.vllm_format)  # before the target
        from draftsmith.export.push import require_served_names

        require_served_names(cfg, kind)
        if "vllm" in cfg.export.engines and cfg.export.vllm_python:  # a release without the method: refused now
            exporter = exporter_for(kind)
            releases = exporter.releases(saved["drafter"], cfg.export.num_speculative_tokens)
            require_vllm_serves(exporter.vllm_method, releases, cfg.export.vllm_python)
            # a dtype the build cannot serve the target in, before the report's dtype is compared (a float16 export was
            # told to evaluate the drafter in float16, then refused so once the target had loaded); other limits are
            # said once it is loaded, the drafter's first
            dtype, config = None if cfg.target.dtype == "auto" else cfg.target.dtype, load_config(cfg.target).to_dict()
            if cpu_build_limit(config) is None:
                require_build_serves(config, cfg.export.vllm_python, dtype=dtype)
        source_digest = checkpoint_digest(checkpoint)  # its config.json as well as its weights
        serving = served_values(saved_drafter(checkpoint)[1], served)  # what the sweep and report must have served
        schedule = batch_schedule_of(cfg, source_digest, serving)  # before the target loads: a bad sweep stops here
        report = find_report(cfg, checkpoint, source_digest, target, serving)  # and a report of other weights
        require_report_served(report if "vllm" in cfg.export.engines else None, cfg.export.vllm_python, VLLM_PYTHON_KEY)
        keep_checked_export(cfg, output, source_digest)
        if cfg.export.push.repo_id:  # before claim_export_dir moves anything aside
            from draftsmith.export.push import claim_hub_repos

            claim_hub_repos(cfg, source_digest)
        claim_export_dir(output, source_digest, cfg.export.overwrite)
        target = target if target is not None else load_target(cfg.target, resolve_device(cfg.eval.device))
        source = load_source(cfg, checkpoint, target, served)
        gamma = serving_gamma(cfg, source, schedule)
        exporter = exporter_for(source.drafter.type)
        repos = {engine: exporter.build(engine, source, gamma, output / engine) for engine in cfg.export.engines}
        if "vllm" in cfg.export.engines and cfg.export.vllm_python:  # a build that cannot serve the target
            require_build_serves(
                source.target.config,
                cfg.export.vllm_python,
                drafter_limit=repos["vllm"].cpu_build_limit,
                dtype=served_dtype(source.target_model),  # the check serves it as loaded
                target_limit=served_target_limit(
                    source.target.config, source.target_model, repos["vllm"].method, exporter.vllm_shares_embedding
                ),
            )
            require_engine_imports(source.target.config, cfg.export.vllm_python)
            if exporter.vllm_writes_family_config:
                config, python = repos["vllm"].config, cfg.export.vllm_python
                require_draft_config_read_as_written(config, repos["vllm"].method, session.served_as(python, config))
        for repo in repos.values():
            check_tensors(repo, f"{source.drafter.type} checkpoint {checkpoint}")
        with_reported_accuracy(source, report)
        folders = {}
        for engine, repo in repos.items():
            with staging(output / engine) as staged:  # removed unless published: a failed check leaves nothing
                stage_repo(repo, staged, source.target)
                info = export_info(source, repo, gamma, source_digest, report, schedule)
                write_json(staged / EXPORT_INFO, info, sort_keys=True)
                check_round_trip(exporter, source, repo, staged, target, gamma, output / engine)
                if checked_in_engine(cfg, engine):
                    info["verified"] = verify_in_vllm(cfg, source, repo, staged, info["speculative_config"], session)
                    info["engine_settings"] = info["verified"].pop("engine_settings")  # recorded once, at the top
                    write_json(staged / EXPORT_INFO, info, sort_keys=True)
                from draftsmith.export.card import write_card
                from draftsmith.export.push import served_revision

                write_card(staged, repo, info, report, serving_name(cfg, engine, output / engine), served_revision(cfg))
                publish_folder(staged, output / engine)
            folders[engine] = output / engine
    if cfg.export.push.repo_id:
        from draftsmith.export.push import push_folders

        push_folders(cfg, folders, report)
    return folders


def load_source(cfg: DictConfig, checkpoint: Path, target, served=None) -> Source:
    name = cfg.target.name_or_path
    shape = TargetShape.of(target, name)
    drafter = with_served(load_drafter(checkpoint, shape, target), served).eval()
    directory = Path(name) if Path(name).is_dir() else None
    # a local folder by its absolute path: a relative one names the target only where the export ran
    verifier = cfg.export.verifier or (str(directory.resolve()) if directory is not None else name)
    info = TargetInfo(
        shape=shape,
        config=loaded_config(target),
        verifier=verifier,
        config_json=config_json(target),
        directory=directory,
        trust_remote_code=bool(cfg.target.trust_remote_code),
    )
    return Source(
        drafter=drafter, checkpoint=checkpoint, target_model=target, target=info, vllm_format=cfg.export.vllm_format
    )


def serving_gamma(cfg: DictConfig, source: Source, schedule: Optional[dict[str, Any]] = None) -> int:
    """The γ the served config names: the schedule's largest K when there is one (vLLM caps every
    batch size's K at it), else export.num_speculative_tokens or the eval's."""
    gamma = int(cfg.export.num_speculative_tokens or cfg.eval.num_speculative_tokens)
    if schedule is not None:
        if (
            cfg.export.num_speculative_tokens
            and int(cfg.export.num_speculative_tokens) != schedule["num_speculative_tokens"]
        ):
            raise UserError(
                f"export.num_speculative_tokens={cfg.export.num_speculative_tokens} but export.batch_sweep's schedule "
                f"needs {schedule['num_speculative_tokens']} (its largest γ); leave export.num_speculative_tokens unset"
            )
        gamma = schedule["num_speculative_tokens"]
    longest = type(source.drafter).max_chain(source.drafter.config)
    if longest is not None and gamma > longest:
        raise UserError(
            f"num_speculative_tokens={gamma} but this {source.drafter.type} drafter proposes at most {longest}; "
            "set export.num_speculative_tokens"
        )
    return gamma


def claim_export_dir(output: Path, digest: str, overwrite: bool) -> None:
    """An engine folder made from another checkpoint is never replaced implicitly; one made from this
    checkpoint is re-exported in place (the same inputs give the same bytes). Every engine's folder counts, not
    only those exported now: another checkpoint's left beside this one's would read as one export of two drafters."""
    others, foreign = [], []  # engine folders of another checkpoint's export; folders no export wrote
    for engine in SERVING_ENGINES:
        info_path = output / engine / EXPORT_INFO
        if (output / engine).exists():
            if not info_path.is_file():
                foreign.append(engine)
            elif json.loads(info_path.read_text()).get("source", {}).get("sha256") != digest:
                others.append(engine)
    if not others and not foreign:
        return
    if not overwrite:
        held = [f"{', '.join(others)} export(s) of another checkpoint"] if others else []
        if foreign:
            held.append(f"{', '.join(f'{engine}/' for engine in foreign)} no export wrote (no {EXPORT_INFO})")
        raise UserError(
            f"{output} holds {' and '.join(held)}; use another export.output, "
            f"or export.overwrite=true to move them to {output}/replaced/<time>/"
        )
    move_aside(output, others + foreign)


def checked_in_engine(cfg: DictConfig, engine: str) -> bool:
    """Whether this run loads its `engine` folder in the engine (export.vllm_python names the Python that runs it)."""
    return SERVING_ENGINES[engine].checked_at_export and bool(cfg.export.vllm_python)


def keep_checked_export(cfg: DictConfig, output: Path, digest: str) -> None:
    """An engine folder of this checkpoint that was checked in its engine is not replaced by one this run writes
    unchecked."""
    for engine in cfg.export.engines:
        info_path = output / engine / EXPORT_INFO
        if SERVING_ENGINES[engine].checked_at_export and info_path.is_file():
            record = read_json(info_path, "export record")
            refuse_unchecked_replacement(cfg, record, digest, str(output / engine), engine)


def made_from(info: Any) -> Optional[str]:
    """The sha256 of the checkpoint an export record (draftsmith_export.json) was made from; None where it names
    none."""
    source = info.get("source") if isinstance(info, dict) else None
    return source.get("sha256") if isinstance(source, dict) else None


def refuse_unchecked_replacement(cfg: DictConfig, info: Any, digest: str, where: str, engine: str) -> None:
    """`where` (a folder or a Hub branch) holds `info`, this checkpoint's (`digest`) `engine` export checked in vLLM:
    this run, which does not check it (no export.vllm_python), does not replace it unless export.overwrite=true."""
    if checked_in_engine(cfg, engine) or cfg.export.overwrite or not isinstance(info, dict) or not info.get("verified"):
        return
    if made_from(info) == digest:
        raise UserError(
            f"{where} holds this checkpoint's export checked in vLLM {info['verified'].get('engine_version')}, and "
            "this run does not check (export.vllm_python is unset): set export.vllm_python, or "
            "export.overwrite=true to replace it unchecked"
        )


def find_report(cfg: DictConfig, checkpoint: Path, digest: str, target=None, serving=None) -> Optional[dict[str, Any]]:
    """The eval report the model card shows: export.report, else the one train.py wrote beside the
    checkpoint (<output_dir>/eval/report.json), else none. It must have measured these weights (`digest`,
    the checkpoint's sha256: a run moved or copied elsewhere keeps its report; a report without one, from an
    earlier draftsmith, is matched by the checkpoint's path), with the target in the dtype the export serves it in:
    the card shows its acceptance under a serving command in that dtype, which is `target`'s when the caller loaded
    it (the sweep does), else the one target.dtype loads it in; and with the SERVED settings `serving` where given."""
    path = Path(cfg.export.report) if cfg.export.report else checkpoint.resolve().parent / EVAL_DIR / REPORT_NAME
    if not path.is_file():
        if cfg.export.report:
            found = "is a folder, not an eval's report.json" if path.is_dir() else "does not exist"
            raise UserError(f"export.report={cfg.export.report!r} {found}")
        return None
    report = read_json(path, "eval report")
    if gaps := report_gaps(report):
        raise UserError(f"{path}: not an eval report (no {', '.join(gaps)})")
    evaluated = report["drafter"]
    same = (
        evaluated["sha256"] == digest if "sha256" in evaluated else evaluated.get("path") == str(checkpoint.resolve())
    )
    if not same:
        raise UserError(
            f"{path} evaluates other weights ({evaluated.get('path')}, sha256 {str(evaluated.get('sha256'))[:12]}) "
            f"than {checkpoint.resolve()} (sha256 {digest[:12]}); pass export.report for this checkpoint's eval, or "
            "evaluate it"
        )
    if target is not None:
        exported, loaded = served_dtype(target), "as it was given"
    else:
        exported = dtype_name(resolve_dtype(cfg.target.dtype, resolve_device(cfg.eval.device)))
        loaded = f"target.dtype={cfg.target.dtype}"
    measured = report.get("dtype")  # absent from a report of an earlier draftsmith
    if measured is not None and measured != exported:
        raise UserError(
            f"{path} measured the drafter with the target in {measured}, but this export loads it in {exported} "
            f"({loaded}), the dtype its card's serving command names: evaluate the "
            f"checkpoint with target.dtype={exported} and pass that report as export.report, or export with "
            f"target.dtype={measured}"
        )
    if serving is not None:
        advice = "evaluate the checkpoint with those and pass that report as export.report"
        require_same_serving(evaluated.get("config") or {}, serving, str(path), advice)
    return {**report, "_path": str(path.resolve()), "_sha256": file_sha256(path)}


def with_reported_accuracy(source: Source, report: Optional[dict[str, Any]]) -> None:
    """What the eval report measured on the eval split and decoding read (`drafter.learned`), taken
    from the report the export was given, else from where the checkpoint's own eval reads it (the run's
    eval_accuracy.json beside it: a run without an eval stage, a Medusa tree shaped by default priors in its export
    otherwise): the checkpoint never holds it (the eval writes only its own files), and the export records it in
    draftsmith_export.json's `learned`."""
    measured = ((report or {}).get("drafter", {}).get("learned") or {}).get(EVAL_SPLIT_METRICS)
    if not measured:
        from draftsmith.eval.accuracy import measured_accuracy

        measured = measured_accuracy(source.checkpoint)[0]
    if measured:
        source.drafter.learned = {**source.drafter.learned, EVAL_SPLIT_METRICS: dict(measured)}


def served_config(repo: EngineRepo, gamma: int, schedule: Optional[dict[str, Any]], drafter) -> dict[str, Any]:
    """The engine's speculative config for this folder, less `model`: for one that takes a whole config (vLLM) the
    method, γ, what the folder needs (P-EAGLE's parallel_drafting), the sampling settings pinned for this drafter
    (vllm_pinned: probabilistic drafting for a drafter that samples its drafts) and the γ per batch size."""
    if not SERVING_ENGINES[repo.engine].takes_speculative_config:
        return {"method": repo.method, **repo.options}
    config = {"method": repo.method, "num_speculative_tokens": gamma, **repo.options, **vllm_pinned(drafter)}
    if schedule is not None:
        config["num_speculative_tokens_per_batch_size"] = schedule["num_speculative_tokens_per_batch_size"]
    return config


def export_info(
    source: Source,
    repo: EngineRepo,
    gamma: int,
    digest: str,
    report: Optional[dict],
    schedule: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """draftsmith_export.json: where the folder came from and what was converted on the way."""
    drafter = source.drafter
    releases_known = SERVING_ENGINES[repo.engine].knows_releases
    releases = exporter_for(drafter.type).releases(asdict(drafter.config), gamma)
    info = {
        "draftsmith_export": EXPORT_FORMAT,
        "draftsmith_version": metadata.version("draftsmith"),
        "engine": repo.engine,
        "drafter_type": drafter.type,
        "drafter_config": {k: v for k, v in asdict(drafter.config).items() if k not in drafter.config.RESOLVED},
        "learned": drafter.learned,
        "source": {"checkpoint": str(source.checkpoint.resolve()), "sha256": digest},
        "target": {**source.target.shape.__dict__, "id": source.target.shape.id},
        "verifier": source.target.verifier,
        "trust_remote_code": source.target.trust_remote_code,  # the serving command runs the target's own code
        "num_speculative_tokens": gamma,
        "conventions": repo.conventions,
        "serve": repo.serve,
        "target_overrides": repo.target_overrides or None,  # what the serving command tells vLLM of the target
        "compilation_config": repo.compilation_config or None,  # how the serving command has vLLM compile
        "engine_arguments": repo.engine_arguments or None,  # vLLM's engine arguments the serving command gives
        "target_dtype": served_dtype(source.target_model),  # the dtype the serving command serves the target in
        "speculative_config": served_config(repo, gamma, schedule, drafter),
        "vllm_releases": served_by(repo.method, releases) if releases_known else None,
        # the same for programs (the monitor's re-verify): the releases serving it as trained, from `first` to before
        # `removed_in` (None: unbounded)
        "vllm_release_range": {"first": releases.first, "removed_in": releases.removed_in} if releases_known else None,
        "vllm_builds": served_builds(
            source.target.config,
            repo.cpu_build_limit,
            served_target_limit(
                source.target.config, source.target_model, repo.method, exporter_for(drafter.type).vllm_shares_embedding
            ),
        )
        if releases_known
        else None,
        "batch_schedule": schedule,
        "engine_settings": None,  # what the engine resolved, when the export was checked in it
        "recommended_num_speculative_tokens": recommended_gamma(report, chain_engines(source)),
        "eval_report": None
        if report is None
        else {
            "path": report["_path"],
            "sha256": report["_sha256"],  # the monitor judges against this report: a later eval replacing it is refused
            "temperature": report["temperature"],
            "tau_all": report["domains"]["all"]["chain"]["tau"],
        },
    }
    return info


def serving_name(cfg: DictConfig, engine: str, folder: Path) -> str:
    """How the serving commands name the drafter: its Hub repo when pushed, else its local path."""
    from draftsmith.export.push import repo_id_for

    return repo_id_for(cfg, engine) if cfg.export.push.repo_id else str(folder.resolve())


def check_round_trip(exporter, source: Source, repo: EngineRepo, staged: Path, target, gamma: int, final: Path) -> None:
    """Read the staged folder back into a drafter and export that again: the same tensors must come
    out, or the folder's config does not describe its weights."""
    from draftsmith.formats.folder import read_folder  # on use: it imports this package (the formats' registry)

    drafter = read_folder(staged / repo.weights_dir, target)
    again = exporter.build(
        repo.engine,
        Source(drafter, source.checkpoint, source.target_model, source.target, source.vllm_format),
        gamma,
        final,
    )
    differ = [
        name
        for name, tensor in repo.tensors.items()
        if name not in again.tensors or not torch.equal(again.tensors[name].cpu(), tensor.cpu())
    ]
    if differ or set(again.tensors) != set(repo.tensors):
        raise InternalError(
            f"the {repo.engine} folder does not read back into the same drafter (tensors {differ[:4]} differ); "
            "this is a draftsmith bug"
        )


def stage_repo(repo: EngineRepo, staged: Path, target: TargetInfo) -> Path:
    """Write the folder's config and weights into `staged` (`staging`'s folder; the card and
    draftsmith_export.json follow once the folder has been checked); returns it."""
    weights_dir = staged / repo.weights_dir
    weights_dir.mkdir(parents=True)
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in sorted(repo.tensors.items())}
    # one metadata key: reproducible bytes
    save_safetensors(tensors, weights_dir / WEIGHTS_NAME, metadata={"format": "pt"})
    write_json(weights_dir / "config.json", repo.config, sort_keys=True)
    if repo.tokenizer:
        copy_tokenizer(target, weights_dir)
    if repo.extra is not None:
        repo.extra(staged)
    return staged
