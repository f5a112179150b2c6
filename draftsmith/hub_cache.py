"""The Hub and its cache as draftsmith reads them: whether the Hub can be reached (one probe, remembered; out of
reach, loads read the cache alone at once), the commit a Hub id's load read (a loaded target carries it, and its own
files are read again at it), the commits of a repository the cache holds and the cached id closest to one it does not
(a Hub id mistyped), a Hub id's folder of files (`hub_folder`), and the lines where what is asked is not there: the
Hub out of reach is exit 69 (the same command gets it once the Hub answers), a Hub id not cached offline bad input."""

from __future__ import annotations

import difflib
import time
from pathlib import Path
from typing import Optional

from draftsmith.errors import HubUnavailable, UserError, one_line

# how long a probe's answer about the Hub holds: the loads of one command share it, and a long `monitor watch` asks
# again at a later check
HUB_PROBE_TTL_S = 30.0
_hub_probes: dict[str, tuple[float, Optional[Exception]]] = {}  # endpoint -> (time.monotonic() asked, its failure)


def hub_out_of_reach(name_or_path: str) -> Optional[Exception]:
    """Why the Hub a load of `name_or_path` would ask cannot be reached: the failure of one request to it (no
    answer within HF_HUB_ETAG_TIMEOUT), remembered for HUB_PROBE_TTL_S; None for a local folder, with HF_HUB_OFFLINE=1
    (no request is made) or when the Hub answers. Where it is out of reach a load reads the Hub cache alone
    (`local_files_only`): huggingface_hub would retry each file's request for about 25 s, logging every try, and then
    read the cache all the same."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or Path(name_or_path).expanduser().is_dir():
        return None
    return endpoint_out_of_reach(constants.ENDPOINT)


def endpoint_out_of_reach(endpoint: str) -> Optional[Exception]:
    """The failure of one request to the Hub at `endpoint` (no answer within HF_HUB_ETAG_TIMEOUT), remembered for
    HUB_PROBE_TTL_S; None when it answers. A Hub data set's load (data_prep/conversations.py) asks it of datasets'
    endpoint, a model's (`hub_out_of_reach`) of huggingface_hub's."""
    from huggingface_hub import constants, get_session

    asked, failure = _hub_probes.get(endpoint, (-HUB_PROBE_TTL_S, None))
    if time.monotonic() - asked >= HUB_PROBE_TTL_S:
        try:  # any answer, an error status too, is the Hub's: only no answer is out of reach
            get_session().head(endpoint, timeout=constants.HF_HUB_ETAG_TIMEOUT)
            failure = None
        except Exception as err:  # noqa: BLE001 - the HTTP client's transport error, whose class differs by version
            failure = err
        _hub_probes[endpoint] = (time.monotonic(), failure)
    return failure


# A loaded target's attribute: the Hub commit its files were read from (None: a local folder), which its TargetShape
# records and its own files are read again at (`checkpoint_folder`), whatever the repository's main has become since.
HUB_COMMIT = "draftsmith_hub_commit"


def hub_revision(model) -> Optional[str]:
    """The Hub commit a loaded target was read from (draftsmith.target.with_hub_commit); None for a local folder's."""
    return getattr(model, HUB_COMMIT, None)


def hub_snapshot(name_or_path: str, revision: Optional[str]) -> Optional[Path]:
    """The Hub cache's snapshot of repository `name_or_path` at `revision` (None: main) a load has read: the folder of
    its config.json, named by its commit, holding what the load fetched; None for a local folder, or none cached."""
    if Path(name_or_path).expanduser().is_dir():
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
    if not isinstance(found, str) or Path(found).parent.parent.name != "snapshots":
        return None
    return Path(found).parent


def hub_commit(name_or_path: str, revision: Optional[str]) -> Optional[str]:
    """The commit `hub_snapshot` finds `revision` at; None where it finds none."""
    folder = hub_snapshot(name_or_path, revision)
    return None if folder is None else folder.name


def cached_repos() -> list:
    """The model repositories the Hub cache holds (huggingface_hub's CachedRepoInfo); none where there is no cache."""
    from huggingface_hub import CacheNotFound, constants, scan_cache_dir

    try:
        return [repo for repo in scan_cache_dir(constants.HF_HUB_CACHE).repos if repo.repo_type == "model"]
    except CacheNotFound:
        return []


def cached_commits(name_or_path: str) -> str:
    """The commits of Hub repository `name_or_path` the Hub cache holds, each with its refs (`main -> 1a2b`); or ""."""
    held = sorted(
        (rev.commit_hash, sorted(rev.refs))
        for repo in cached_repos()
        if repo.repo_id == name_or_path
        for rev in repo.revisions
    )
    return ", ".join(f"{', '.join(refs)} -> {commit}" if refs else commit for commit, refs in held)


def closest_cached_id(name_or_path: str) -> Optional[str]:
    """The Hub id the cache holds whose spelling is closest to `name_or_path` (a Hub id mistyped), where one is close;
    None where none is, or `name_or_path` itself is cached."""
    cached = [repo.repo_id for repo in cached_repos()]
    close = difflib.get_close_matches(name_or_path, cached, n=1, cutoff=0.8)
    return close[0] if close and close[0] != name_or_path else None


def not_cached(what: str, name_or_path: str, guess: bool = True) -> UserError:
    """The line for Hub id `name_or_path` not in the Hub cache with HF_HUB_OFFLINE=1; with `guess`, naming the cached
    id closest to it (a Hub id mistyped)."""
    from huggingface_hub import constants

    close = closest_cached_id(name_or_path) if guess else None
    said = f" (did you mean {close}?, which the cache holds)" if close else ""
    return UserError(
        f"{what}: not in the Hub cache ({constants.HF_HUB_CACHE}){said}, and HF_HUB_OFFLINE=1 forbids downloading it: "
        "download it once with a network, or give a local folder"
    )


def unreachable(said: str, out_of_reach: Exception, doing: str = "") -> HubUnavailable:
    """`said` (a line ending "the Hub") continued: the Hub cannot be reached (`out_of_reach`, the probe's failure)
    `doing`; exit 69, as the same command gets what it needs once the Hub answers."""
    from huggingface_hub import constants

    return HubUnavailable(
        f"{said} ({constants.ENDPOINT}) cannot be reached{doing} ({one_line(out_of_reach)}): run the same command "
        "again when the Hub can be reached, or give a local folder"
    )


def hub_folder(name_or_path: str, what: str, revision: Optional[str] = None) -> Path:
    """A model's folder: a local one, or a Hub id's snapshot at `revision` (None: main) holding its JSON and
    safetensors files, downloaded, or read from the Hub cache alone with HF_HUB_OFFLINE=1 or the Hub out of reach
    (`hub_out_of_reach`). Where it is not there, one line starting with `what`: the Hub out of reach is
    HubUnavailable (exit 69: the same command downloads it once the Hub answers), anything else bad input."""
    if Path(name_or_path).expanduser().is_dir():
        return Path(name_or_path).expanduser()
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    out_of_reach = hub_out_of_reach(name_or_path)
    try:
        return Path(
            snapshot_download(
                name_or_path,
                revision=revision,
                allow_patterns=["*.safetensors", "*.json"],
                local_files_only=out_of_reach is not None,
            )
        )
    except LocalEntryNotFoundError as err:
        if out_of_reach is not None:
            raise unreachable(
                f"{what}: not in the Hub cache ({constants.HF_HUB_CACHE}), and the Hub", out_of_reach
            ) from None
        if constants.HF_HUB_OFFLINE:
            raise not_cached(what, name_or_path) from None
        raise UserError(f"{what}: {one_line(err)}") from err  # a request that failed midway: its chain says so (69)
    except (HfHubHTTPError, ValueError, OSError) as err:
        raise UserError(f"{what}: {one_line(err)}") from err
