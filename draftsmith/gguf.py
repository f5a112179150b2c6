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
from pathlib import Path

from draftsmith.errors import UserError, one_line
from draftsmith.files import file_sha256
from draftsmith.target import TargetShape

SOURCE_FILE = "gguf_source.json"  # provenance: which GGUF file (and hash) a cached directory came from


def cache_root() -> Path:
    """DRAFTSMITH_CACHE, else ~/.cache/draftsmith; dequantized targets live under targets/."""
    return Path(os.environ.get("DRAFTSMITH_CACHE") or "~/.cache/draftsmith").expanduser() / "targets"


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
    """The target's shape from a GGUF file's metadata, for recipe validation: the header is parsed
    (the file is memory-mapped) and no tensor is read or dequantized. None for a file on the Hub."""
    source = local_file(name_or_path, gguf_file)
    if source is None:
        return None
    reader = open_reader(source)
    try:
        architecture = field_value(reader, "general.architecture")
        vocab = reader.fields.get(f"{architecture}.vocab_size")
        return TargetShape(
            name_or_path=str(source),
            model_type=architecture,
            hidden_size=int(field_value(reader, f"{architecture}.embedding_length")),
            vocab_size=int(field_value(reader, f"{architecture}.vocab_size"))
            if vocab is not None
            else len(reader.fields["tokenizer.ggml.tokens"].data),
            num_hidden_layers=int(field_value(reader, f"{architecture}.block_count")),
        )
    except (KeyError, ValueError, IndexError) as err:
        raise UserError(f"cannot read GGUF target {source}: its header lacks {one_line(err)}") from None


def open_reader(source: Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise UserError(
            "target.gguf_file needs the `gguf` package: pip install 'draftsmith[smollm]' (or pip install gguf)"
        ) from None
    try:
        return GGUFReader(source)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise UserError(f"cannot read GGUF target {source}: {one_line(err)}") from None


def field_value(reader, key: str):
    """A scalar or string metadata value of the header."""
    value = reader.fields[key].contents()
    if value is None:
        raise KeyError(key)
    return value


def materialize(name_or_path: str, gguf_file: str, revision: str | None = None) -> Path:
    """The transformers directory for a GGUF target, converting it on first use."""
    source = locate(name_or_path, gguf_file, revision)
    digest = file_sha256(source)
    directory = cache_root() / f"{source.stem}-{digest[:16]}"
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
        os.replace(staging, directory)
    return directory


def convert(source: Path, directory: Path) -> None:
    """Dequantize `source` with transformers (through the `gguf` package) into `directory`.

    A model loaded from GGUF refuses save_pretrained (it records its quantization origin), so its
    weights are copied into a fresh model of the same config first. Float32: the file's
    dequantized values are low-precision products float32 holds exactly; target.dtype casts at load."""
    open_reader(source)  # the `gguf` package transformers needs, and a readable header: one line if not
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
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
