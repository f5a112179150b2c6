"""The capture directory's files: each shard, written to `<name>.tmp` and renamed into place, each rank's
manifest part and the merged manifest.json. Apart from data_prep/capture.py, which runs the target, so that
what lands on disk (and how a resumed run trusts it) reads in one place."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from draftsmith.data_prep.dataset import tokenizer_identity
from draftsmith.data_prep.features import (
    DISTRIBUTION_DTYPE,
    DISTRIBUTION_FIELDS,
    FP8_MAX,
    LAYER_CONVENTION,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    SHARD_METADATA,
    STORAGE_DTYPES,
    file_sha256,
    hidden_names,
    manifest_part_name,
    resolved_sources,
    shard_name,
)
from draftsmith.errors import UserError
from draftsmith.files import created_file_mode, read_json, replacing, save_safetensors, write_json
from draftsmith.target import dtype_name
from draftsmith.target_weights import WEIGHT_RECORDS, same_embedding_norms, same_layer_values

CAPTURE_AGAIN = "remove it to capture again"  # the advice for a capture's own file that is not JSON


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    index: int
    start: int  # first conversation, as an index into the tokenized data set
    stop: int  # one past the last
    tokens: int

    @property
    def name(self) -> str:
        return shard_name(self.rank, self.index)


def recorded_data(cfg: DictConfig) -> dict[str, Any]:
    """The data settings a capture's rows are made with, as manifest.json records them (its `data`); data.train's
    files as resolved absolute paths, so that training reads the capture from any directory."""
    return {
        "sources": resolved_sources(cfg.data.train),
        "max_length": cfg.data.max_length,
        "overlong": cfg.data.overlong,
        "max_conversations": cfg.data.max_conversations,
        "thinking": cfg.data.thinking,
    }


def data_record(cfg: DictConfig, tokenizer, data) -> dict[str, Any]:
    """What a capture's `data_fingerprint` is made of, recorded beside its settings in each part and the
    manifest, so that a refusal over another fingerprint says which input changed: the data settings (`data`,
    `recorded_data`), the tokenizer and `data.train`'s conversations by their content (`data_content`: sha256 over
    the tokenized rows' conversation digests, whatever path or library version read them)."""
    content = hashlib.sha256()
    for batch in data.select_columns(["digest"]).iter(batch_size=100_000):  # a column of millions, a batch at a time
        content.update("".join(f"{digest}\n" for digest in batch["digest"]).encode())
    return {
        "data": recorded_data(cfg),
        "tokenizer": tokenizer_identity(tokenizer),
        "data_content": content.hexdigest()[:16],
    }


# settings a capture records that an earlier draftsmith did not, with what such a capture was made with
RECORDED_SINCE = {"engine": "transformers"}


def refuse_other_capture(directory: Path, settings: dict[str, Any], record: Optional[dict[str, Any]] = None) -> None:
    """A directory holding a capture with other settings is never mixed into: resuming it would join shards of
    two different captures under one manifest (a manifest part without shards holds nothing to join). One line names
    each setting that differs with both values and, where the data's fingerprint differs, which of its inputs changed
    in words (`data_changes`; `record`: this run's `data_record`), never the two hashes. Settings without a
    `data_fingerprint` are compared before the data is read, with the data settings alone where `record` holds them
    (`{"data": recorded_data(cfg)}`)."""
    settings = json.loads(json.dumps(settings))  # as the files hold them (a tuple is a list there)
    for path in [directory / MANIFEST_NAME, *sorted(directory.glob("manifest_part_*.json"))]:
        if not path.is_file():
            continue
        file = read_json(path, advice=CAPTURE_AGAIN)
        if path.name != MANIFEST_NAME and not file.get("shards"):
            continue  # a part of a run that stopped before its first shard (an engine that did not start) holds none
        found = file.get("settings", file)  # parts keep settings apart; the manifest at top level
        found = {**RECORDED_SINCE, **found}
        differ = [
            change
            for key, value in settings.items()
            if key != "data_fingerprint"
            for change in (
                target_changes(found[key], value)
                if key == "target" and isinstance(found.get(key), dict)
                else [f"{key}: {found.get(key)!r} -> {value!r}"] * (found.get(key) != value)
            )
        ]
        if "data_fingerprint" in settings and found.get("data_fingerprint") != settings["data_fingerprint"]:
            differ += data_changes(file, record)
        elif "data_fingerprint" not in settings and record is not None:  # before tokenizing: the data settings alone
            differ += setting_changes(file.get("data"), record["data"])
        if differ:
            raise UserError(
                f"{directory} already holds a capture with other settings ({'; '.join(differ)[:600]}): put back "
                "what it was made with, or remove it or set data.capture.output to another directory"
            )


def target_changes(found: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a capture's target record (`target_description`) and this run's: each field by name, and
    the weights as TargetShape.same_weights compares them, as far as both records know them (an engine that reads no
    layer of the target, or an earlier draftsmith, records fewer: not a change; nor is a field an earlier draftsmith
    did not record, such as a Hub target's commit)."""
    changes = [
        f"target {key}: {found.get(key)!r} -> {value!r}"
        for key, value in now.items()
        if key not in WEIGHT_RECORDS and key in found and found[key] != value
    ]
    same = same_embedding_norms(found.get("embedding_norms"), now.get("embedding_norms")) and same_layer_values(
        found.get("layer_values"), now.get("layer_values")
    )
    return changes if same else [*changes, "the target's weights (its input embedding or last layer differs)"]


def data_changes(file: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """In words, what changed in the data a capture's file (a part or the manifest) was made from, against this
    run's `data_record`: the data settings it records, else its tokenizer, else data.train's content, else how the
    same data was read. A capture begun before draftsmith recorded these says so."""
    changed = setting_changes(file.get("data"), record["data"])
    if changed:
        return changed
    tokenizer = file.get("tokenizer")
    if isinstance(tokenizer, dict) and tokenizer != record["tokenizer"]:
        keys = [key for key, now in record["tokenizer"].items() if tokenizer.get(key) != now]
        return [f"the target's tokenizer: its {', '.join(keys)} changed since the capture was made"]
    if "data_content" not in file:
        return [
            "the data it was made from: data.train's content, the tokenizer, or how they were read (a path given "
            "another way, another draftsmith or datasets version); the capture predates draftsmith recording which"
        ]
    if file["data_content"] != record["data_content"]:
        return ["data.train's content: a file's conversations changed since the capture was made"]
    return [
        "how the data was read: the same conversations and settings, read by another draftsmith or datasets version "
        "or from a path given another way, which may tokenize them otherwise"
    ]


def setting_changes(recorded: Any, data: dict[str, Any]) -> list[str]:
    """Each data setting a manifest's `data` records otherwise than the recipe gives it (sources compared as resolved
    paths), as `data.max_length: 96 -> 64`; none where the file records no data settings (a capture made before
    draftsmith recorded them)."""
    if not isinstance(recorded, dict):
        return []
    if "sources" in recorded:
        recorded = {**recorded, "sources": resolved_sources(recorded["sources"] or [])}
    return [
        f"{'data.train' if key == 'sources' else f'data.{key}'}: {recorded[key]!r} -> {now!r}"
        for key, now in data.items()
        if key in recorded and recorded[key] != now
    ]


# The temporary files a capture writes (`replacing`'s shards and manifests, the vLLM engine's folders of states): a
# killed run's are removed by the next, and nothing else is (the output folder may be a user's own, holding other
# `.tmp` files).
LEFTOVERS = ("shard_*.safetensors.tmp", "manifest*.json.tmp", "engine-*.tmp")


def refuse_foreign_files(directory: Path) -> None:
    """A capture is not begun in a directory holding files no capture wrote (a training run's output_dir, a folder of
    the user's own): its shards and manifest would sit among files a reader of either takes for its own. One begun
    there keeps the files put beside it since (remove_leftovers never removes them)."""
    own = ("shard_*.safetensors", MANIFEST_NAME, "manifest_part_*.json", *LEFTOVERS)
    if (directory / MANIFEST_NAME).is_file() or any(directory.glob("manifest_part_*.json")):
        return
    entries = sorted(directory.iterdir()) if directory.is_dir() else []
    foreign = [
        entry.name
        for entry in entries
        if not entry.name.startswith(".") and not any(fnmatch.fnmatch(entry.name, pattern) for pattern in own)
    ]
    if foreign:
        raise UserError(
            f"{directory} holds files no capture wrote ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})"
            ": set data.capture.output to a new or empty directory"
        )


def remove_leftovers(directory: Path) -> None:
    """The temporary files a killed capture left (`LEFTOVERS`). They are never read; removing them only reclaims
    the space, and is safe while no rank is writing."""
    for path in [path for pattern in LEFTOVERS for path in directory.glob(pattern)]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def is_intact(path: Path, entry: dict[str, Any]) -> bool:
    return path.is_file() and path.stat().st_size == entry["bytes"] and file_sha256(path) == entry["sha256"]


def write_shard(
    directory: Path, shard: ShardPlan, tensors: dict[str, torch.Tensor], domains: list[str]
) -> dict[str, Any]:
    """Write to `<name>.tmp`, make it durable, rename it into place; return its manifest entry. The `.tmp` is removed
    when anything stops the write (a full disk, Ctrl-C, SIGTERM): it was left until the next run."""
    path = directory / shard.name
    # One metadata key: safetensors writes several in a per-process random order, and a shard must
    # be the same bytes whenever it is made (a resumed capture equals an uninterrupted one).
    header = {
        "schema_version": SCHEMA_VERSION,
        "first_conversation": shard.start,
        "domains": domains,
    }  # domains: one per conversation
    with replacing(path) as tmp:
        # safetensors' full disk raised as the OSError naming the file: a shard is the capture command's output, and
        # that line (exit 74) says to free space and run the same command again, which keeps the shards before it
        save_safetensors(tensors, tmp, metadata={SHARD_METADATA: json.dumps(header, sort_keys=True)})
        os.chmod(tmp, created_file_mode())  # a training job run by another user reads the shards
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the rename must never publish bytes still only in the page cache
        digest = file_sha256(tmp)
    return {
        "file": shard.name,
        "rank": shard.rank,
        "index": shard.index,
        "first_conversation": shard.start,
        "conversations": shard.stop - shard.start,
        "tokens": shard.tokens,
        "bytes": path.stat().st_size,
        "sha256": digest,
        "domains": dict(sorted(Counter(domains).items())),
    }


def merge_manifest(directory: Path, settings: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """Join every rank's part into manifest.json, with totals and the bytes/token comparison."""
    parts = [
        read_json(directory / manifest_part_name(rank), advice=CAPTURE_AGAIN) for rank in range(settings["world_size"])
    ]
    shards = sorted(
        (entry for part in parts for entry in part["shards"]), key=lambda entry: entry["first_conversation"]
    )
    tokens = sum(entry["tokens"] for entry in shards)
    total_bytes = sum(entry["bytes"] for entry in shards)
    domains: Counter[str] = Counter()
    for entry in shards:
        domains.update(entry["domains"])
    computed = sum(part.get("last_run", {}).get("tokens_computed", 0) for part in parts)
    seconds = max(part.get("last_run", {}).get("seconds", 0.0) for part in parts)  # ranks run side by side
    hidden_size = settings["target"]["hidden_size"]
    # EAGLE-3 offline (SpecForge) stores the last hidden state plus three layers in bf16: 4 * 2 * H.
    anchor = 8 * hidden_size
    manifest = {
        "schema_version": SCHEMA_VERSION,
        **settings,
        "layer_convention": LAYER_CONVENTION,
        "fields": field_layout(settings, hidden_size),
        **record,  # the data settings, tokenizer and content (data_record)
        "conversations": sum(entry["conversations"] for entry in shards),
        "tokens": tokens,
        "bytes": total_bytes,
        "bytes_per_token": total_bytes / tokens,
        "anchor_bytes_per_token": anchor,
        "anchor_ratio": total_bytes / tokens / anchor,
        "domains": dict(sorted(domains.items())),
        "shards": shards,
        # The last run's throughput, all ranks together (0 when it only reused finished shards).
        "last_run": {
            "tokens_computed": computed,
            "seconds": seconds,
            "tokens_per_s": round(computed / seconds, 1) if seconds else 0.0,
        },
    }
    write_json(directory / MANIFEST_NAME, manifest)
    return manifest


def field_layout(settings: dict[str, Any], hidden_size: int) -> dict[str, str]:
    """Every tensor a shard holds, with its dtype and shape (T = the shard's tokens)."""
    storage = dtype_name(STORAGE_DTYPES[settings["dtype"]])
    fields = {"input_ids": "int32 [T]", "loss_mask": "uint8 [T]", "offsets": "int64 [conversations + 1]"}
    for name in hidden_names(settings["final"], settings["layers"]):
        fields[name] = f"{storage} [T, {hidden_size}]"
        if settings["dtype"] == "float8":
            fields[f"{name}.scale"] = (
                f"float32 [T]: {name} = {name}.float() * scale[:, None], scale = absmax / {FP8_MAX:g}"
            )
    distribution = dtype_name(DISTRIBUTION_DTYPE)
    shapes = {
        "topk_ids": f"int32 [T, {settings['topk']}]",
        "topk_logprobs": f"{distribution} [T, {settings['topk']}]",
        "logits": f"{distribution} [T, {settings['target']['vocab_size']}]",
    }
    fields |= {name: shapes[name] for name in DISTRIBUTION_FIELDS[settings["logits"]]}
    return fields
