"""Where a model is read from, and the line when it cannot be: a local folder (a file in it this process may not
read is named as such, not as what transformers makes of it) or a Hub id (with the Hub out of reach, read from the
Hub cache alone at once, not after huggingface_hub's retries). The target's loads (draftsmith/target.py) and a
released assistant's (heads/gemma4_assistant.py) go through it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from draftsmith.errors import UserError, hub_cache_miss, one_line

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


def read_pretrained(load: Callable[..., Any], name_or_path: str, what: str, **kwargs) -> Any:
    """`load(name_or_path, **kwargs)`, a transformers `from_pretrained`: from the Hub cache alone while the Hub is
    out of reach (`hub_out_of_reach`); a model that does not load is one line starting with `what` (`not_loadable`)."""
    out_of_reach = hub_out_of_reach(name_or_path)
    if out_of_reach is not None:
        kwargs["local_files_only"] = True
        # a model's load: transformers does not hand local_files_only on to its look for a PEFT adapter's config
        if "adapter_kwargs" in kwargs:
            kwargs["adapter_kwargs"] = {**kwargs["adapter_kwargs"], "local_files_only": True}
    try:
        return load(name_or_path, **kwargs)
    except (OSError, ValueError) as err:
        raise not_loadable(what, err, name_or_path, out_of_reach) from err


def not_loadable(
    what: str, err: BaseException, name_or_path: str, out_of_reach: Optional[Exception] = None
) -> UserError:
    """The line for a model that did not load: transformers' reason; for a local folder it cannot read, the file
    (transformers names another cause: "No such file or directory" for unreadable weights, "Should have a
    `model_type` key" for an unreadable folder); for a Hub id not in the cache with HF_HUB_OFFLINE=1, that
    (transformers' own line then says it could not connect, which it never tried). Raised from `err`, whose chain
    says whether the Hub was out of reach instead (errors.hub_unreachable); `out_of_reach` is the failed probe's
    error of a load that read the cache alone (`hub_out_of_reach`)."""
    from huggingface_hub import constants

    miss = hub_cache_miss(err)
    if constants.HF_HUB_OFFLINE and miss is not None:  # offline, no request was made
        return UserError(
            f"{what}: not in the Hub cache ({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE=1 forbids downloading "
            "it: download it once with a network, or give a local folder"
        )
    if miss is not None and out_of_reach is not None and miss.__cause__ is None:
        # the request that failed was the probe's: chained as huggingface_hub chains its own, the miss reads as the
        # Hub out of reach (exit 69), not as bad input
        miss.__cause__ = out_of_reach
    folder = Path(name_or_path).expanduser()
    unreadable = first_unreadable(folder) if folder.is_dir() else None
    if unreadable is not None and failed_on(err, unreadable):
        return UserError(f"{what}: cannot read {unreadable}: permission denied")
    return UserError(f"{what}: {one_line(err)}")


def failed_on(err: BaseException, unreadable: Path) -> bool:
    """Whether the unreadable file or folder is why `err` was raised: a PermissionError in its chain, or a link
    naming it (a tokenizer that fails for its own reason beside unreadable weights is not failing on them)."""
    link: Optional[BaseException] = err
    while link is not None:
        if isinstance(link, PermissionError) or str(unreadable) in str(link):
            return True
        link = link.__cause__ or link.__context__
    return False


def first_unreadable(folder: Path) -> Optional[Path]:
    """The first folder or file under `folder` (itself included) that this process may not read, or None."""
    denied: list[str] = []

    def listing_failed(err: OSError) -> None:
        if isinstance(err, PermissionError):
            denied.append(err.filename)

    for parent, _, files in os.walk(folder, onerror=listing_failed):
        if denied:
            break
        for name in sorted(files):
            try:
                with open(os.path.join(parent, name), "rb"):
                    pass
            except PermissionError:
                return Path(parent, name)
    return Path(denied[0]) if denied else None
