"""Push exported folders to the Hugging Face Hub with `huggingface_hub`.

The vllm folder goes to `export.push.repo_id`, another engine's to `<repo_id>-<engine>`; each on the
branch `export.push.revision` (created when missing), the repo private unless
`export.push.private=false`. The token is HF_TOKEN or the local `hf auth login`, read by the client
itself: draftsmith never prints or writes it. The client uploads only files whose content changed,
so pushing an unchanged export again makes no new commit; a file the branch holds that the folder does not
is deleted in the same commit, so the branch serves exactly the folder. Before anything is exported,
`claim_hub_repos` refuses a branch holding another checkpoint's export (or files no export wrote) as
export/run.py's claim_export_dir refuses such a local folder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from draftsmith.engines import SERVING_ENGINES
from draftsmith.errors import HubUnavailable, UserError, one_line
from draftsmith.files import read_json
from draftsmith.formats import exporter_for
from draftsmith.formats.repo import EXPORT_INFO, check_vllm_repo_id
from draftsmith.heads import drafter_class

log = logging.getLogger("draftsmith.export")  # a push is a log line: stdout holds the command's result alone

# A refusal of the token (none, expired, without write access) is fixed where the token comes from.
TOKEN_HINT = "set HF_TOKEN or run `hf auth login` with a token that can write to"


def repo_id_for(cfg: DictConfig, engine: str) -> str:
    return cfg.export.push.repo_id + SERVING_ENGINES[engine].repo_suffix


def served_revision(cfg: DictConfig) -> Optional[str]:
    """The branch the serving commands must name: the pushed one, unless it is main, which engines load without."""
    push = cfg.export.push
    return push.revision if push.repo_id and push.revision != "main" else None


def require_served_names(cfg: DictConfig, kind: str) -> None:
    """The vllm folder pushed is served by its repo id, from which vLLM may read another method (as from a path);
    an export whose drafter is in a subfolder beside the model it serves (Medusa-2: `medusa/` and the merged
    `target/`) is served from two folders, and an engine loads a Hub repo's root only."""
    if not cfg.export.push.repo_id:
        return
    subfolders = exporter_for(kind).weights_dirs
    if subfolders:
        raise UserError(
            f"export.push.repo_id={cfg.export.push.repo_id}: a {drafter_class(kind).TITLE} export is served from "
            f"subfolders ({', '.join(f'{name}/' for name in subfolders)} and the model beside them), and engines "
            "load a Hub repo's root only: export without export.push, then push each subfolder to a repo of its "
            "own (`hf upload ORG/NAME FOLDER`) and serve those ids"
        )
    if "vllm" in cfg.export.engines and exporter_for(kind).vllm_method_from_name:
        check_vllm_repo_id(repo_id_for(cfg, "vllm"), drafter_class(kind).TITLE)


def claim_hub_repos(cfg: DictConfig, digest: str) -> None:
    """Before anything is exported: every branch the push would replace is new, empty (`.gitattributes` only) or
    holds this checkpoint's export (`digest`, its draftsmith_export.json's source sha256), and not one checked in
    vLLM that this run, which does not check, would replace; else refused unless export.overwrite=true (the
    repo's history keeps what the push replaces)."""
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    from draftsmith.export.run import made_from, refuse_unchecked_replacement

    api, push = HfApi(), cfg.export.push
    for engine in cfg.export.engines:
        repo_id = repo_id_for(cfg, engine)
        where = f"{repo_id}@{push.revision}"
        try:
            files = sorted(
                {sibling.rfilename for sibling in api.model_info(repo_id, revision=push.revision).siblings or []}
                - {".gitattributes"}  # what the Hub writes into a new repo
            )
            held = (
                read_json(Path(api.hf_hub_download(repo_id, EXPORT_INFO, revision=push.revision)), "export record")
                if EXPORT_INFO in files
                else None
            )
        except (RepositoryNotFoundError, RevisionNotFoundError):
            continue  # the push creates it (a private repo the token cannot see: the push says so)
        except (httpx2.TransportError, HfHubHTTPError) as err:
            again = "run the same command again"
            raise hub_failure(err, f"could not read {where}", repo_id, "nothing was exported", again) from None
        if not files or cfg.export.overwrite:
            continue
        if made_from(held) != digest:
            what = (
                f"the export of another checkpoint (sha256 {str(made_from(held))[:12]})"
                if held is not None
                else f"files no draftsmith export wrote ({', '.join(files[:3])})"
            )
            raise UserError(
                f"{where} holds {what}; push to another export.push.repo_id or export.push.revision, or "
                "export.overwrite=true to replace it (the repo's history keeps it)"
            )
        refuse_unchecked_replacement(cfg, held, digest, where, engine)


def hub_failure(err: Exception, what: str, repo_id: str, kept: str, retry: str) -> Exception:
    """The Hub refusing (bad input, exit 2; a refused token says where tokens come from) or out of reach, or
    failing on its side (HubUnavailable, exit 69: `retry`); `kept`: what the command leaves, for the user to know."""
    from huggingface_hub.errors import HfHubHTTPError

    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, HfHubHTTPError) and (status is None or status < 500):
        token = f": {TOKEN_HINT} {repo_id}, then {retry}" if status in (401, 403) else ""
        return UserError(f"{what}: {one_line(err)}; {kept}{token}")
    return HubUnavailable(f"{what}: {one_line(err)}; {kept}: {retry}")


def commit_message(cfg: DictConfig, engine: str, report: Optional[dict[str, Any]], folder: Path) -> str:
    if cfg.export.push.commit_message:
        return cfg.export.push.commit_message
    info = read_json(folder / EXPORT_INFO, "export record")
    summary = f"draftsmith: {info['drafter_type']} drafter for {info['target']['id']} ({engine})"
    if report is not None:
        rows = report["domains"]["all"]
        taus = ", ".join(f"{method} τ {row['tau']:.2f}" for method, row in rows.items() if row["tau"] is not None)
        summary += f"; eval at T={report['temperature']}: {taus}"
    if info.get("verified"):
        summary += f"; vLLM {info['verified']['engine_version']} τ {info['verified']['tau_engine']:.2f}, lossless"
    return summary


def push_folders(cfg: DictConfig, folders: dict[str, Path], report: Optional[dict[str, Any]]) -> dict[str, str]:
    """Push every engine folder; returns engine -> the commit its branch now points at."""
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api, push = HfApi(), cfg.export.push
    heads = {}
    for engine, folder in folders.items():
        repo_id = repo_id_for(cfg, engine)
        try:
            api.create_repo(repo_id, private=push.private, exist_ok=True, repo_type="model")
            if push.revision != "main":
                api.create_branch(repo_id, branch=push.revision, exist_ok=True)
            commit = api.upload_folder(
                repo_id=repo_id,
                folder_path=str(folder),
                revision=push.revision,
                commit_message=commit_message(cfg, engine, report, folder),
                delete_patterns="*",  # what an earlier export left and this one has not (.gitattributes is kept)
            )
        except (httpx2.TransportError, HfHubHTTPError) as err:
            where, again = f"{repo_id}@{push.revision}", "run the same command again to push them"
            raise hub_failure(
                err, f"could not push {folder} to {where}", repo_id, "the folders are exported", again
            ) from None
        except (OSError, ValueError) as err:
            raise UserError(f"could not push {folder} to {repo_id}@{push.revision}: {one_line(err)}") from None
        heads[engine] = commit.oid
        log.info("pushed %s to %s@%s (%s)", folder, repo_id, push.revision, commit.oid[:12])
    return heads


def require_push_allowed(cfg: DictConfig) -> None:
    """A push with HF_HUB_OFFLINE=1 set cannot happen: refused before any folder is written, not after."""
    from huggingface_hub import constants

    if cfg.export.push.repo_id and constants.HF_HUB_OFFLINE:
        raise UserError(
            f"export.push.repo_id={cfg.export.push.repo_id} pushes to the Hub, which HF_HUB_OFFLINE=1 forbids: "
            "unset HF_HUB_OFFLINE, or leave export.push.repo_id out to export without pushing"
        )
