"""Captured target features on disk: the format `python -m data_prep.capture` writes, and the reader
that lets training use them instead of running the target every step.

A capture directory holds
    manifest.json                           what was captured, from which target and data; every shard
    shard_{rank:02d}_{index:05d}.safetensors   written by that rank, whole conversations each
    manifest_part_{rank:02d}.json           one rank's finished shards (resume), merged into manifest.json

A shard concatenates its conversations along T; `offsets` (int64 [n+1]) marks where each starts and
the safetensors metadata `draftsmith_features` (a JSON object: schema_version, first_conversation,
domains) names each one's domain. Tensors per token:
    input_ids      int32 [T]
    loss_mask      uint8 [T]
    final          [T, H] storage dtype     the last hidden state after the final norm (if captured)
    layer_{i}      [T, H] storage dtype     output of decoder layer i, -1 = embeddings (draftsmith.target)
    {name}.scale   float32 [T]              float8 only: x ≈ q.float() * scale[:, None], scale = absmax / 448
    topk_ids       int32 [T, k]             logits=topk: the target's k most likely next tokens
    topk_logprobs  float16 [T, k]           ... and their log-probabilities under the full distribution
    logits         float16 [T, V]           logits=full
Row t of the distribution fields is the target's prediction after reading tokens 0..t (for token
t+1), the same alignment as the model's own logits. The distribution is float16 whatever the
storage dtype: log-probabilities lie in about [-100, 0], where float16 is 8x finer than bfloat16
and float8 would blur the ranking the drafter learns from.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open
from torch.utils.data import Dataset

from draftsmith.errors import UserError, one_line
from draftsmith.files import file_sha256, read_json
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape, target_id
from draftsmith.target_weights import same_embedding_norms, same_layer_values

SCHEMA_VERSION = 2  # 2: shard metadata in one key (reproducible bytes)
SHARD_METADATA = "draftsmith_features"
MANIFEST_NAME = "manifest.json"
LAYER_CONVENTION = (
    "layer i is the output of decoder layer i (0-based), i.e. transformers' hidden_states[i + 1]; "
    "-1 is the token embeddings (hidden_states[0]); 'final' is the last hidden state after the final "
    "norm (the lm_head input)"
)
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8": torch.float8_e4m3fn}
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
DISTRIBUTION_DTYPE = torch.float16
DISTRIBUTION_FIELDS = {"none": (), "topk": ("topk_ids", "topk_logprobs"), "full": ("logits",)}


def shard_name(rank: int, index: int) -> str:
    return f"shard_{rank:02d}_{index:05d}.safetensors"


def manifest_part_name(rank: int) -> str:
    return f"manifest_part_{rank:02d}.json"


def hidden_names(final: bool, layers: Sequence[int]) -> list[str]:
    """Tensor names of the hidden-state features: `final`, then `layer_{i}` per layer id."""
    return (["final"] if final else []) + [f"layer_{layer}" for layer in layers]


def encode(name: str, hidden: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """Hidden states [T, H] in a storage dtype; float8 adds a per-row scale (`name.scale`)."""
    if dtype != "float8":
        return {name: hidden.to(STORAGE_DTYPES[dtype])}
    # A scale per token, not per tensor: hidden-state norms vary a lot between positions (the first
    # token's are often 10-100x the rest), and one outlier row must not flush the others to zero.
    absmax = hidden.float().abs().amax(dim=-1)
    scale = absmax.clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    # Clamp: float8_e4m3fn has no inf, and a rounding step past 448 would cast to NaN.
    quantized = (hidden.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {name: quantized, f"{name}.scale": scale}


def decode(stored: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Stored hidden states back to float32."""
    return stored.float() if scale is None else stored.float() * scale[:, None]


def expected_features(target: TargetShape, request: FeatureRequest) -> dict[str, Any]:
    """What a training run needs from a capture, in the form `open_features(expect=...)` checks."""
    return {
        "name_or_path": target.name_or_path,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "num_hidden_layers": target.num_hidden_layers,
        "embedding_norms": target.embedding_norms,
        "layer_values": target.layer_values,
        "final": request.final,
        "layers": list(request.layers),
        "logits": request.logits,
    }


@dataclass
class _Shard:
    path: Path
    sha256: str
    offsets: list[int]  # n + 1 token offsets of its conversations
    domains: list[str]


class FeatureStore(Dataset):
    """A capture as a map-style data set of conversations, in the order of the tokenized data they
    were captured from. Item i: `input_ids`, `loss_mask` (long [T]), `domain`, and each stored
    feature as a float32 tensor (`final`, `layer_{i}` [T, H]; `topk_ids` long / `topk_logprobs`
    [T, k] or `logits` [T, V]). Each shard's sha256 is checked the first time this process reads it.
    """

    def __init__(self, directory: Path, manifest: dict[str, Any], shards: list[_Shard]):
        self.directory = directory
        self.manifest = manifest
        self.final: bool = manifest["final"]
        self.layers: tuple[int, ...] = tuple(manifest["layers"])
        self.logits: str = manifest["logits"]  # none | topk | full
        self.vocab_size: int = manifest["target"]["vocab_size"]
        self._quantized = manifest["dtype"] == "float8"
        self._shards = shards
        # Index of each shard's first conversation, then the total.
        self._starts = [0, *accumulate(len(shard.domains) for shard in shards)]
        self._verified: set[Path] = set()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        number = bisect.bisect_right(self._starts, index) - 1
        shard, local = self._shards[number], index - self._starts[number]
        self._verify(shard)
        start, stop = shard.offsets[local], shard.offsets[local + 1]
        with safe_open(str(shard.path), framework="pt") as f:

            def rows(name: str) -> torch.Tensor:
                return f.get_slice(name)[start:stop]  # reads only this conversation's rows

            item: dict[str, Any] = {
                "input_ids": rows("input_ids").long(),
                "loss_mask": rows("loss_mask").long(),
                "domain": shard.domains[local],
                "sample": f"{shard.path.name} conversation {local}",
            }
            for name in hidden_names(self.final, self.layers):
                item[name] = decode(rows(name), rows(f"{name}.scale") if self._quantized else None)
            if self.logits == "topk":
                item["topk_ids"] = rows("topk_ids").long()
                item["topk_logprobs"] = rows("topk_logprobs").float()
            elif self.logits == "full":
                item["logits"] = rows("logits").float()
        return item

    def lengths(self) -> list[int]:
        """Every conversation's token count, in order, from the shard headers (no tensor is read)."""
        return [stop - start for shard in self._shards for start, stop in zip(shard.offsets, shard.offsets[1:])]

    def token_rows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, loss_mask) of every conversation in order, reading no feature: what a drafter's
        `prepare` counts tokens from (EAGLE-3's draft vocabulary)."""
        for shard in self._shards:
            self._verify(shard)
            with safe_open(str(shard.path), framework="pt") as f:
                input_ids, loss_mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").long()
            for start, stop in zip(shard.offsets, shard.offsets[1:]):
                yield input_ids[start:stop], loss_mask[start:stop]

    def _verify(self, shard: _Shard) -> None:
        if shard.path in self._verified:
            return
        if file_sha256(shard.path) != shard.sha256:
            raise UserError(
                f"feature shard {shard.path} is corrupt (sha256 differs from {MANIFEST_NAME}); run draftsmith capture "
                "again with the same recipe to redo it"
            )
        self._verified.add(shard.path)

    def to_target_output(self, batch: Mapping[str, Any]) -> TargetOutput:
        """A collated batch as the TargetOutput a drafter's loss takes, on the batch's device.

        `logits` [B, T, V] float32: the stored logits for logits=full; for logits=topk, the top-k
        log-probabilities at their ids and -inf elsewhere, so `softmax(logits)` is the target's
        distribution renormalized over its top k (use a soft cross-entropy, -sum p*log q: a KL with
        log_target=True is NaN at the -inf entries); None when no distribution was captured. The
        batch also keeps `topk_ids`/`topk_logprobs` [B, T, k] for losses that stay sparse.
        `final` is None when it was not captured.
        """
        logits = batch.get("logits")
        if self.logits == "topk":
            ids = batch["topk_ids"]
            logits = torch.full((*ids.shape[:-1], self.vocab_size), float("-inf"), device=ids.device)
            logits.scatter_(-1, ids, batch["topk_logprobs"].float())
        return TargetOutput(
            logits=logits,
            final=batch.get("final"),
            layers={layer: batch[f"layer_{layer}"] for layer in self.layers},
        )


def open_features(directory: str | os.PathLike, expect: Optional[Mapping[str, Any]] = None) -> FeatureStore:
    """Open a finished capture. Checks the manifest and, when `expect` is given (see
    `expected_features`; any subset of its keys), that the capture fits the target and drafter.
    Every shard must exist with the manifest's size and a readable header; its sha256 is checked
    when first read. Any misfit is a one-line UserError naming the file."""
    directory = Path(directory)
    manifest = _read_manifest(directory)
    if expect is not None:
        _check_expectation(directory, manifest, expect)
    shards = [_open_shard(directory, entry) for entry in manifest["shards"]]
    return FeatureStore(directory, manifest, shards)


_MANIFEST_KEYS = ("target", "final", "layers", "logits", "dtype", "shards", "tokens")
# The data settings a capture's rows were made with (its manifest's `data`; `thinking` since it is recorded).
CAPTURED_DATA_KEYS = ("max_length", "overlong", "max_conversations", "thinking")


def resolved_sources(sources) -> list[str]:
    """Data sources as a capture's manifest records and compares them: a file or folder as its resolved absolute
    path, so that the same files given from another directory are the same sources; a Hub id or `named:` source
    as given. A manifest written before recorded paths as typed: a relative one resolves against the current
    directory."""
    return [str(Path(source).resolve()) if Path(source).exists() else source for source in map(str, sources)]


def require_captured_settings(cfg) -> None:
    """Training from `data.features` trains on the capture's rows, made by its target: a recipe whose
    data.train (unless empty), max_length, overlong, max_conversations or thinking, or whose target.dtype (unless
    auto), differs from
    the capture's (its manifest.json) would be silently overruled, and its run's recipe.yaml would record
    settings the run did not use. Refused in one line naming each such key with both values, before any
    data is read or a model loads; a damaged or unfinished capture is the manifest's own one line."""
    directory = Path(cfg.data.features)
    manifest = _read_manifest(directory)
    captured = manifest.get("data") if isinstance(manifest.get("data"), dict) else {}
    differ = [
        (f"data.{key}", cfg.data[key], captured[key])
        for key in CAPTURED_DATA_KEYS
        if key in captured and captured[key] != cfg.data[key]
    ]
    # data.train is not read either: the capture's sources are (an empty one names nothing to overrule)
    train, sources = (resolved_sources(given) for given in (cfg.data.train, captured.get("sources") or []))
    if train and "sources" in captured and train != sources:
        differ.append(("data.train", train, sources))
    dtype = manifest["target"].get("dtype") if isinstance(manifest["target"], dict) else None
    if cfg.target.dtype != "auto" and dtype is not None and cfg.target.dtype != dtype:
        differ.append(("target.dtype", cfg.target.dtype, dtype))
    if differ:
        ours = ", ".join(f"{key}={value}" for key, value, _ in differ)
        theirs = ", ".join(f"{key}={value}" for key, _, value in differ)
        raise UserError(
            f"the recipe resolves to {ours}, but the features in {directory} were captured with {theirs}: set the "
            "capture's values, or capture again with the recipe's"
        )


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST_NAME
    if not path.is_file():
        hint = (
            "the capture has not finished" if any(directory.glob("manifest_part_*.json")) else "not a feature capture"
        )
        raise UserError(f"{directory} holds no {MANIFEST_NAME} ({hint}); run draftsmith capture to write it")
    manifest = read_json(path, "feature manifest")
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{path}: feature schema version {version!r}, but this draftsmith reads version {SCHEMA_VERSION}; capture "
            "again"
        )
    missing = [key for key in _MANIFEST_KEYS if key not in manifest]
    if missing:
        raise UserError(f"{path}: corrupt manifest, missing {', '.join(missing)}")
    return manifest


def _check_expectation(directory: Path, manifest: Mapping[str, Any], expect: Mapping[str, Any]) -> None:
    captured = manifest["target"]
    shape_keys = ("hidden_size", "vocab_size", "num_hidden_layers")
    mismatch = [key for key in shape_keys if key in expect and expect[key] != captured[key]]
    if mismatch:
        captured_shape = ", ".join(f"{key}={captured[key]}" for key in shape_keys)
        expected_shape = ", ".join(f"{key}={expect[key]}" for key in shape_keys if key in expect)
        raise UserError(
            f"features in {directory} were captured from target {captured['name_or_path']} ({captured_shape}) "
            f"but the recipe's target is {expect.get('name_or_path', '?')} ({expected_shape})"
        )
    mine, theirs = expect.get("embedding_norms"), captured.get("embedding_norms")
    layers_differ = not same_layer_values(expect.get("layer_values"), captured.get("layer_values"))
    if not same_embedding_norms(mine, theirs) or layers_differ:
        raise UserError(
            f"features in {directory} were captured from target {captured['name_or_path']}, and the recipe's target "
            f"{expect.get('name_or_path', '?')} has the same shape but other weights (its "
            f"{'last layer' if layers_differ else 'input embedding'} differs): capture again from this target, or give "
            "the one captured"
        )
    # the same weights found under another name (a copied or moved folder) are the target captured; where either side
    # records no weights (a capture by an earlier draftsmith), only the name can say so
    unweighed = mine is None or theirs is None
    if unweighed and "name_or_path" in expect and target_id(str(expect["name_or_path"])) != captured["id"]:
        raise UserError(
            f"features in {directory} were captured from target {captured['name_or_path']}, and the recipe's target "
            f"{expect['name_or_path']} has its shape under another name; the capture records no weights to compare "
            "(an earlier draftsmith's): give the target captured, or capture again from this one"
        )
    needed = sorted(set(expect.get("layers") or ()))
    if not set(needed) <= set(manifest["layers"]):
        raise UserError(
            f"features in {directory} hold layers {sorted(manifest['layers'])} but the drafter needs {needed}; capture "
            f"again with data.capture.layers={needed}"
        )
    if expect.get("final") and not manifest["final"]:
        raise UserError(
            f"features in {directory} hold no final hidden state but the drafter needs it; capture again with "
            "data.capture.final=true"
        )
    if expect.get("logits") and manifest["logits"] == "none":
        raise UserError(
            f"features in {directory} hold no target distribution but the drafter needs the target's logits; "
            "capture again with data.capture.logits=topk (or full)"
        )


def _open_shard(directory: Path, entry: Mapping[str, Any]) -> _Shard:
    path = directory / entry["file"]
    if not path.is_file():
        raise UserError(f"feature shard {path} listed in {MANIFEST_NAME} is missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise UserError(
            f"feature shard {path} is truncated or altered ({size} bytes, {MANIFEST_NAME} says {entry['bytes']})"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            offsets = f.get_tensor("offsets").tolist()
            domains = json.loads(f.metadata()[SHARD_METADATA])["domains"]
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"feature shard {path} is corrupt ({one_line(err, 200)})") from None
    if len(domains) != entry["conversations"] or offsets[-1] != entry["tokens"]:
        raise UserError(
            f"feature shard {path} does not match its {MANIFEST_NAME} entry (conversations or tokens differ)"
        )
    return _Shard(path=path, sha256=entry["sha256"], offsets=offsets, domains=domains)
