"""The line for a write into one of data_prep's caches that its disk or its permissions refused (`cache_fault`):
the Hugging Face caches a data set is loaded through, and the tokenized-data cache. Their writers' errors name no
file, or one inside the cache, so the line was `no space left on device` alone, or `cannot read FILE:
DatasetGenerationError`, the data file blamed for the cache's disk."""

from __future__ import annotations

import errno
import os
from typing import NamedTuple

import datasets

from draftsmith.errors import STORAGE_ERRNOS, CacheWriteFailed, UserError, exception_chain, storage_reason


class Cache(NamedTuple):
    """A cache as its line names it: what it is, its folder, and the setting that moves it."""

    what: str
    folder: str | os.PathLike
    setting: str


# what a file system answers a write with when the disk or the permissions, not the data, are at fault
WRITE_REFUSED_ERRNOS = STORAGE_ERRNOS | {errno.EACCES, errno.EPERM}


def storage_fault(err: BaseException) -> OSError | None:
    """The OSError of the disk or of permissions (WRITE_REFUSED_ERRNOS) that `err` is or was raised from (a library
    wraps its own: datasets' DatasetGenerationError), or None."""
    return next(
        (link for link in exception_chain(err) if isinstance(link, OSError) and link.errno in WRITE_REFUSED_ERRNOS),
        None,
    )


def cache_fault(fault: OSError, what: str, cache: str | os.PathLike, setting: str) -> Exception:
    """The line for a write into a cache that `fault` (`storage_fault`) refused, naming the cache (`what`, at `cache`)
    and the `setting` that moves it (an environment variable or a recipe key): a cache is often on another disk than
    the input and the output, and its writers' errors name no file, or one inside it. A full or failing disk is
    CacheWriteFailed (exit 74) with the room left there, its command's advice added by `outcome`; a read-only one or
    permissions bad input (exit 2)."""
    named = f"{what} {cache} ({setting})"
    if fault.errno in STORAGE_ERRNOS and fault.errno != errno.EROFS:
        reason = storage_reason(fault.errno, cache, named=False)
        return CacheWriteFailed(
            f"could not write {named}: {reason}; free space there (or fix the disk), or set {setting} to a folder "
            "on another disk"
        )
    return UserError(f"{named} cannot be written: {fault.strerror}; set {setting} to a folder you can write")


def raise_cache_fault(err: BaseException, cache: Cache, *within: Cache) -> None:
    """Raise the line for `err` where it is, or was raised from, a write a disk or permissions refused
    (`storage_fault`), naming the one of `within` that holds the file that failed, else `cache`; return where
    `err` is no such fault."""
    fault = storage_fault(err)
    if fault is None:
        return
    failed = os.path.abspath(os.fsdecode(fault.filename)) if fault.filename else None
    if failed:
        cache = next((each for each in within if failed.startswith(os.path.abspath(each.folder) + os.sep)), cache)
    raise cache_fault(fault, cache.what, cache.folder, cache.setting) from None


def hugging_face_caches() -> tuple[Cache, Cache]:
    """datasets' cache, and the Hub's, into which a Hub data set's files are downloaded: read when a load fails, as
    the environment set them then."""
    from huggingface_hub import constants

    return (
        Cache("the Hugging Face cache", datasets.config.HF_DATASETS_CACHE, "HF_DATASETS_CACHE"),
        Cache("the Hugging Face cache", os.path.abspath(constants.HF_HUB_CACHE), "HF_HUB_CACHE"),
    )
