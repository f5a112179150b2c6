"""The line for a write into one of data_prep's caches that its disk or its permissions refused (errors.cache_fault):
the Hugging Face caches a data set is loaded through, and the tokenized-data cache. Their writers' errors name no
file, or one inside the cache, so the line was `no space left on device` alone, or `cannot read FILE:
DatasetGenerationError`, the data file blamed for the cache's disk."""

from __future__ import annotations

import os
from typing import NamedTuple

import datasets

from draftsmith.errors import cache_fault, storage_fault


class Cache(NamedTuple):
    """A cache as its line names it: what it is, its folder, and the setting that moves it."""

    what: str
    folder: str | os.PathLike
    setting: str


def raise_cache_fault(err: BaseException, cache: Cache, *within: Cache) -> None:
    """Raise the line for `err` where it is, or was raised from, a write a disk or permissions refused
    (errors.storage_fault), naming the one of `within` that holds the file that failed, else `cache`; return where
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
