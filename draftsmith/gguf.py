"""GGUF targets: `target.gguf_file` names a GGUF file (llama.cpp's format, often the only local copy
of a model a user has); it is dequantized once into a plain transformers directory (config.json,
safetensors, tokenizer with its chat template) and every stage then loads that directory.

Why a cache and not `from_pretrained(gguf_file=...)` on every load: dequantizing takes as long as
the forward passes of a small training run, every rank of a launch would repeat it, and a serving
engine (vLLM) verifying an export needs safetensors anyway. The cache directory is keyed by the
file's SHA-256, so a changed file never reuses a stale conversion, and it is written to a temporary
directory and renamed into place under a lock, so concurrent ranks or a kill leave no half-written
target behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
from pathlib import Path

from draftsmith import files
from draftsmith.errors import UserError, one_line
from draftsmith.files import file_sha256, readable_as_created
from draftsmith.model_files import TRANSFORMERS_LAYERS
from draftsmith.target import TargetShape

SOURCE_FILE = "gguf_source.json"  # provenance: which GGUF file (and hash) a cached directory came from


def targets_cache() -> Path:
    """Dequantized targets live under the cache's targets/ (draftsmith.files.cache_root)."""
    return files.cache_root() / "targets"


def local_file(name_or_path: str, gguf_file: str) -> Path | None:
    """The GGUF file on disk: `gguf_file` inside the local directory `name_or_path`, or an absolute
    path; None where `name_or_path` is a Hub repository (the file is downloaded when first used)."""
    path = Path(gguf_file).expanduser()
    candidate = path if path.is_absolute() else Path(name_or_path).expanduser() / gguf_file
    if candidate.is_file():
        return candidate
    if Path(name_or_path).expanduser().exists() or path.is_absolute():
        raise UserError(f"target.gguf_file={gguf_file!r}: no such file ({candidate})")
    return None


def locate(name_or_path: str, gguf_file: str, revision: str | None) -> Path:
    """The GGUF file: on disk (`local_file`), or a file of the Hub repository `name_or_path`
    (downloaded through huggingface_hub's cache)."""
    local = local_file(name_or_path, gguf_file)
    if local is not None:
        return local
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(name_or_path, gguf_file, revision=revision))
    except Exception as err:  # offline, unknown repository or file: one line, not a traceback
        raise UserError(f"target.gguf_file={gguf_file!r} of {name_or_path!r}: {one_line(err)}") from None


def header_shape(name_or_path: str, gguf_file: str) -> TargetShape | None:
    """The target's shape from a GGUF file's metadata, for recipe validation: only the key-value header
    is read, no tensor. None for a file on the Hub (it is downloaded when first used)."""
    source = local_file(name_or_path, gguf_file)
    if source is None:
        return None
    fields = header_fields(source)
    try:
        architecture = fields["general.architecture"]
        return TargetShape(
            name_or_path=str(source),
            model_type=architecture,
            hidden_size=int(fields[f"{architecture}.embedding_length"]),
            # an array is read as its length: the tokenizer's token list when the vocabulary size is not written
            vocab_size=int(fields.get(f"{architecture}.vocab_size", fields["tokenizer.ggml.tokens"])),
            num_hidden_layers=int(fields[f"{architecture}.block_count"]),
        )
    except KeyError as err:
        raise UserError(f"cannot read GGUF target {source}: its header lacks {err}") from None


# GGUF metadata value types (ggml's docs/gguf.md): scalars by struct format; 8 is a string, 9 an array.
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


def header_fields(source: Path) -> dict[str, object]:
    """Every key of a GGUF file's metadata: scalars and strings as values, arrays as their lengths.
    The gguf package's reader maps every tensor and decodes every array (seconds for a tokenizer of
    50k tokens); validation needs three numbers, so the header is walked here, skipping array items."""

    def read(f, fmt: str):
        size = struct.calcsize("<" + fmt)
        data = f.read(size)
        if len(data) < size:
            raise ValueError("the header ends early")
        return struct.unpack("<" + fmt, data)[0]

    def string(f, keep: bool = True):
        length = read(f, "Q")
        return f.read(length).decode("utf-8", "replace") if keep else f.seek(length, 1)

    def value(f, kind: int, keep: bool = True):
        if kind in SCALARS:
            return read(f, SCALARS[kind])
        if kind == STRING:
            return string(f, keep)
        if kind == ARRAY:
            item, count = read(f, "I"), read(f, "Q")
            if item in SCALARS:
                f.seek(count * struct.calcsize("<" + SCALARS[item]), 1)
            else:
                for _ in range(count):
                    value(f, item, keep=False)
            return count
        raise ValueError(f"unknown metadata value type {kind}")

    try:
        with open(source, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError("not a GGUF file")
            if read(f, "I") < 2:
                raise ValueError("GGUF version 1 is not supported")
            read(f, "Q")  # the tensor count
            fields = {}
            for _ in range(read(f, "Q")):
                key = string(f)
                fields[key] = value(f, read(f, "I"))
            return fields
    except (OSError, ValueError, struct.error) as err:
        raise UserError(f"cannot read GGUF target {source}: {one_line(err)}") from None


def materialize(name_or_path: str, gguf_file: str, revision: str | None = None) -> Path:
    """The transformers directory for a GGUF target, converting it on first use."""
    source = locate(name_or_path, gguf_file, revision)
    digest = file_sha256(source)
    directory = targets_cache() / f"{source.stem}-{digest[:16]}"
    if (directory / SOURCE_FILE).is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / ".lock", "w") as lock:  # one conversion, however many ranks ask
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (directory / SOURCE_FILE).is_file():
            return directory
        staging = directory.with_name(directory.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        convert(source, staging)
        (staging / SOURCE_FILE).write_text(
            json.dumps({"gguf_file": str(source.resolve()), "sha256": digest}, indent=2) + "\n"
        )
        readable_as_created(staging)  # a job run by another user sharing the cache loads the target
        os.replace(staging, directory)
    return directory


def convert(source: Path, directory: Path) -> None:
    """Dequantize `source` with transformers (through the `gguf` package) into `directory`.

    A model loaded from GGUF refuses save_pretrained (it records its quantization origin), so its
    weights are copied into a fresh model of the same config first. Float32: the file's
    dequantized values are low-precision products float32 holds exactly; target.dtype casts at load."""
    try:
        import gguf  # noqa: F401  (transformers needs it; a clear message beats its ImportError)
    except ImportError:
        raise UserError(
            "target.gguf_file needs the `gguf` package: pip install 'draftsmith[smollm]' (or pip install gguf)"
        ) from None
    header_fields(source)  # a file that is not GGUF: one line, before transformers tries
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32, **TRANSFORMERS_LAYERS
        )
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise UserError(f"cannot read GGUF target {source}: {one_line(err)}") from None
    config = loaded.config
    # The saved directory holds plain float weights: a leftover `quantization_config: gguf` would make
    # transformers and vLLM look for GGUF blocks that are not there.
    for stale in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, stale):
            delattr(config, stale)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    directory.mkdir(parents=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
