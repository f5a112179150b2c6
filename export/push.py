"""Push exported folders to the Hugging Face Hub with `huggingface_hub`.

The vllm folder goes to `export.push.repo_id`, another engine's to `<repo_id>-<engine>`; each on the
branch `export.push.revision` (created when missing), the repo private unless
`export.push.private=false`. The token is HF_TOKEN or the local `hf auth login`, read by the client
itself: draftsmith never prints or writes it. The client uploads only files whose content changed,
so pushing an unchanged export again makes no new commit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from draftsmith.errors import HubUnavailable, UserError, one_line
from draftsmith.files import read_json
from draftsmith.formats.repo import EXPORT_INFO


def repo_id_for(cfg: DictConfig, engine: str) -> str:
    base = cfg.export.push.repo_id
    return base if engine == "vllm" else f"{base}-{engine}"


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
            )
        except (httpx2.TransportError, HfHubHTTPError) as err:  # the network, or the Hub's own fault: retry
            status = getattr(getattr(err, "response", None), "status_code", None)
            if isinstance(err, HfHubHTTPError) and (status is None or status < 500):
                raise UserError(f"could not push {folder} to {repo_id}@{push.revision}: {one_line(err)}") from None
            raise HubUnavailable(
                f"could not push {folder} to {repo_id}@{push.revision}: {one_line(err)}; the folders are exported: "
                "run the same command again to push them"
            ) from None
        except (OSError, ValueError) as err:
            raise UserError(f"could not push {folder} to {repo_id}@{push.revision}: {one_line(err)}") from None
        heads[engine] = commit.oid
        print(f"pushed {folder} to {repo_id}@{push.revision} ({commit.oid[:12]})")
    return heads
