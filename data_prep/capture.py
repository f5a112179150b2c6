"""Capture the frozen target's features over `data.train` into sharded safetensors files:

    python -m data_prep.capture recipe=NAME [key=value ...]
    accelerate launch -m data_prep.capture recipe=NAME ...   (or torchrun --nproc-per-node N -m ...)

The recipe's `data.capture` section says what to store; by default exactly what the recipe's drafter
asks for (its `features`), in bfloat16. data_prep/features.py describes the format and reads it.

Work is planned deterministically from the tokenized data's order: rank r of N takes the r-th
contiguous slice of the conversations and cuts it into shards of about `shard_tokens` tokens, so a
shard's name says which conversations it holds. A shard is written to `<name>.tmp` and renamed when
complete, and only then recorded in the rank's manifest part; a killed job run again skips the
recorded shards whose sha256 still matches and redoes the rest (a `.tmp` is never read, only
overwritten). After a barrier, rank 0 merges the parts into manifest.json.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from itertools import accumulate, chain
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from accelerate import PartialState
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError
from safetensors.torch import save_file
from tqdm.auto import tqdm

from draftsmith.data_prep.conversations import load_conversations
from draftsmith.data_prep.dataset import Collator, cache_key, tokenize_conversations, tokenizer_identity
from draftsmith.data_prep.features import (
    DISTRIBUTION_DTYPE,
    DISTRIBUTION_FIELDS,
    FP8_MAX,
    LAYER_CONVENTION,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    SHARD_METADATA,
    STORAGE_DTYPES,
    encode,
    file_sha256,
    hidden_names,
    part_name,
    shard_name,
)
from draftsmith.errors import StorageError, UserError, one_line
from draftsmith.files import write_text_atomic
from draftsmith.outputs import held_by_main_process
from draftsmith.recipe import load_recipe
from draftsmith.sharding import Lockstep, end_process_group
from draftsmith.target import (
    FeatureRequest,
    TargetOutput,
    TargetShape,
    check_layers,
    load_target,
    load_tokenizer,
    run_target,
)

log = logging.getLogger("draftsmith.capture")


def shard_mode() -> int:
    """safetensors writes through a private temporary file (mode 0600); shards get the mode any other
    new file gets, so that a training job run by another user can read them."""
    mask = os.umask(0)  # the only way to read the umask is to set it; put it straight back
    os.umask(mask)
    return 0o666 & ~mask


@dataclass(frozen=True)
class Selection:
    """What goes into every shard (the recipe's data.capture with the drafter's defaults filled in)."""

    final: bool
    layers: tuple[int, ...]
    logits: str  # none | topk | full
    topk: Optional[int]  # entries per token when logits=topk, else None
    dtype: str  # bfloat16 | float16 | float8


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


@dataclass
class CaptureResult:
    directory: Path
    computed: int  # shards this rank computed in this run
    reused: int  # shards this rank found complete from an earlier run
    manifest: Optional[dict[str, Any]]  # the merged manifest (main process only)


def main(argv: Sequence[str]) -> None:
    cfg = load_recipe(argv)  # validate before any model or data is touched
    capture(cfg)
    end_process_group()


def capture(cfg: DictConfig) -> CaptureResult:
    """Capture on every rank; the main process holds the capture directory while they run."""
    # Without a GPU, accelerate forms a (gloo) process group only when told the run is on CPU.
    state = PartialState(cpu=not torch.cuda.is_available())
    directory = Path(cfg.data.capture.output or Path(cfg.output_dir) / "features")
    with held_by_main_process(directory, state):
        return capture_into(cfg, directory, state)


def capture_into(cfg: DictConfig, directory: Path, state) -> CaptureResult:
    section = cfg.data.capture
    if not cfg.data.train:
        raise UserError("data.train is empty: give at least one conversation file or Hub data set id to capture")

    tokenizer = load_tokenizer(cfg.target)
    with state.main_process_first():  # rank 0 tokenizes and caches, the others read the cache
        # Exactly as training tokenizes (data_prep.load_tokenized), so a capture lines up with the
        # online data set row by row; the conversations' fingerprint also keys the capture.
        conversations = load_conversations(
            list(cfg.data.train), cfg.data.max_conversations, skip_invalid_utf8=cfg.data.skip_invalid_utf8
        )
        data = tokenize_conversations(
            conversations, tokenizer, cfg.data.max_length, cfg.data.overlong, cfg.data.cache_dir, cfg.data.thinking
        )
    target = load_target(cfg.target, state.device, shard=cfg.target.shard)
    # A sharded target's forwards are collectives, and ranks have different numbers of them (their
    # slices differ, a resumed run skips finished shards): Lockstep keeps them in step.
    lockstep = Lockstep(target)
    selection = resolve_selection(cfg, target)

    settings = {
        "target": target_description(target, cfg),
        "data_fingerprint": cache_key(
            conversations, tokenizer, cfg.data.max_length, cfg.data.overlong, cfg.data.thinking
        ),
        "final": selection.final,
        "layers": list(selection.layers),
        "logits": selection.logits,
        "topk": selection.topk,
        "dtype": selection.dtype,
        "shard_tokens": section.shard_tokens,
        "world_size": state.num_processes,
    }
    # Every rank checks before any rank writes, so all of them see the same files and agree.
    refuse_other_capture(directory, settings)
    if state.is_main_process:
        remove_leftovers(directory)
    state.wait_for_everyone()

    plan = plan_shards(list(data["length"]), state.num_processes, section.shard_tokens)[state.process_index]
    part_path = directory / part_name(state.process_index)
    done = {entry["file"]: entry for entry in read_json(part_path)["shards"]} if part_path.is_file() else {}

    run = {"tokens_computed": 0, "seconds": 0.0}  # this run's work on this rank (a resumed run reuses shards)

    def record() -> None:
        shards = sorted(done.values(), key=lambda entry: entry["index"])
        write_json(part_path, {"settings": settings, "rank": state.process_index, "shards": shards, "last_run": run})

    record()  # from the start, so the merge finds a part for every rank, even one with no conversations
    computed = reused = 0
    started = time.perf_counter()
    progress = tqdm(total=sum(s.tokens for s in plan), unit="tok", desc="capture", disable=not state.is_main_process)
    for shard in plan:
        entry = done.get(shard.name)
        if entry is not None and is_intact(directory / shard.name, entry):
            reused += 1
            progress.update(shard.tokens)
            continue
        rows = data[shard.start : shard.stop]
        tensors = capture_shard(
            target,
            rows,
            selection,
            cfg.train.micro_batch_size,
            tokenizer.pad_token_id,
            state.device,
            progress,
            lockstep,
        )
        done[shard.name] = write_shard(directory, shard, tensors, rows["domain"])
        computed += 1
        run["tokens_computed"] += shard.tokens
        run["seconds"] = round(time.perf_counter() - started, 3)  # forward + encode + write
        record()  # only now that the shard is in place under its final name
    progress.close()
    lockstep.finish()
    log.info("rank %d: computed %d shard(s), reused %d", state.process_index, computed, reused)

    state.wait_for_everyone()
    manifest = None
    if state.is_main_process:
        manifest = merge_manifest(directory, settings, cfg, tokenizer)
        print(
            f"captured {manifest['tokens']} tokens ({manifest['conversations']} conversations, "
            f"{len(manifest['shards'])} shards) into {directory}: {manifest['bytes_per_token']:.1f} bytes/token; "
            f"EAGLE-3's four bf16 features (8*H) would be {manifest['anchor_bytes_per_token']} bytes/token (ratio "
            f"{manifest['anchor_ratio']:.3f}); this run captured {manifest['last_run']['tokens_per_s']:.0f} tokens/s",
            flush=True,
        )
    return CaptureResult(directory=directory, computed=computed, reused=reused, manifest=manifest)


def resolve_selection(cfg: DictConfig, target) -> Selection:
    """data.capture with None/auto replaced by what the recipe's drafter asks for."""
    from draftsmith.heads import drafter_class

    section = cfg.data.capture
    shape = TargetShape.of(target, cfg.target.name_or_path)
    wanted = drafter_class(cfg.drafter.type).features(OmegaConf.to_object(cfg.drafter), shape)
    layers = tuple(sorted(set(wanted.layers if section.layers is None else section.layers)))
    check_layers(target, layers)
    final = wanted.final if section.final is None else bool(section.final)
    logits = ("topk" if wanted.logits else "none") if section.logits == "auto" else section.logits
    vocab = target.get_output_embeddings().weight.shape[0]
    if logits == "topk" and section.topk > vocab:
        raise UserError(f"data.capture.topk={section.topk} is more than the target's vocabulary of {vocab}")
    if not (final or layers or logits != "none"):
        raise UserError("nothing to capture: data.capture has final=false, no layers and logits=none")
    return Selection(final, layers, logits, section.topk if logits == "topk" else None, section.dtype)


def target_description(target, cfg: DictConfig) -> dict[str, Any]:
    """The target's shape, id, revision and the dtype its forward ran in (features depend on it)."""
    shape = TargetShape.of(target, cfg.target.name_or_path)
    return {
        **asdict(shape),
        "id": shape.id,
        "revision": cfg.target.revision,
        "dtype": str(target.dtype).removeprefix("torch."),
    }


def refuse_other_capture(directory: Path, settings: dict[str, Any]) -> None:
    """A directory holding a capture with other settings is never mixed into: resuming it would
    join shards of two different captures under one manifest."""
    for path in [directory / MANIFEST_NAME, *sorted(directory.glob("manifest_part_*.json"))]:
        if not path.is_file():
            continue
        found = read_json(path)
        found = found.get("settings", found)  # parts keep settings apart; the manifest at top level
        differ = [key for key in settings if found.get(key) != settings[key]]
        if differ:
            changes = "; ".join(f"{key}: {found.get(key)!r} -> {settings[key]!r}" for key in differ)
            raise UserError(
                f"{directory} already holds a capture with other settings ({changes[:400]}); remove it or set "
                "data.capture.output to another directory"
            )


def remove_leftovers(directory: Path) -> None:
    """Temporary files of a killed run: ours (`*.tmp`) and safetensors' own (`.tmp*`). They are
    never read; removing them only reclaims the space, and is safe while no rank is writing."""
    for path in [*directory.glob("*.tmp"), *directory.glob(".tmp*")]:
        path.unlink(missing_ok=True)


def plan_shards(lengths: Sequence[int], world: int, shard_tokens: int) -> list[list[ShardPlan]]:
    """Per rank, its shards: rank r takes conversations [r*n/world, (r+1)*n/world) and closes a
    shard once it holds at least `shard_tokens` tokens. Depends only on the data and settings."""
    count = len(lengths)
    plans: list[list[ShardPlan]] = []
    for rank in range(world):
        shards: list[ShardPlan] = []
        start, stop = rank * count // world, (rank + 1) * count // world
        first, tokens = start, 0
        for i in range(start, stop):
            tokens += lengths[i]
            if tokens >= shard_tokens or i == stop - 1:
                shards.append(ShardPlan(rank, len(shards), first, i + 1, tokens))
                first, tokens = i + 1, 0
        plans.append(shards)
    return plans


def is_intact(path: Path, entry: dict[str, Any]) -> bool:
    return path.is_file() and path.stat().st_size == entry["bytes"] and file_sha256(path) == entry["sha256"]


@torch.no_grad()
def capture_shard(
    target,
    rows: dict[str, list],
    selection: Selection,
    micro_batch_size: int,
    pad_token_id: int,
    device,
    progress,
    lockstep: Optional[Lockstep] = None,
) -> dict[str, torch.Tensor]:
    """Run the target over one shard's conversations and return the shard's tensors (on CPU); each
    forward through `lockstep` when the target is sharded."""
    lockstep = lockstep or Lockstep(target)
    request = FeatureRequest(final=selection.final, layers=selection.layers, logits=selection.logits != "none")
    lengths: list[int] = rows["length"]
    collate = Collator(pad_token_id)
    per_conversation: list[dict[str, torch.Tensor]] = [{} for _ in lengths]
    # Batch conversations of similar length together (less padding); results go back in data order.
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for first in range(0, len(order), micro_batch_size):
        members = order[first : first + micro_batch_size]
        batch = collate([{"input_ids": rows["input_ids"][i], "loss_mask": rows["loss_mask"][i]} for i in members])
        out = lockstep.run(
            run_target, target, batch["input_ids"].to(device), batch["attention_mask"].to(device), request
        )
        for row, i in enumerate(members):
            per_conversation[i] = stored_tensors(out, row, lengths[i], selection)
            refuse_nonfinite(per_conversation[i], rows, i)
        progress.update(sum(lengths[i] for i in members))
    tensors = {name: torch.cat([c[name] for c in per_conversation]) for name in per_conversation[0]}
    tensors["input_ids"] = torch.tensor(list(chain.from_iterable(rows["input_ids"])), dtype=torch.int32)
    tensors["loss_mask"] = torch.tensor(list(chain.from_iterable(rows["loss_mask"])), dtype=torch.uint8)
    tensors["offsets"] = torch.tensor([0, *accumulate(lengths)], dtype=torch.int64)
    return tensors


def stored_tensors(out: TargetOutput, row: int, length: int, selection: Selection) -> dict[str, torch.Tensor]:
    """One conversation's features from a batched forward, converted for storage (on the device, then CPU)."""
    hidden = {"final": out.final} | {f"layer_{layer}": out.layers[layer] for layer in selection.layers}
    stored: dict[str, torch.Tensor] = {}
    for name in hidden_names(selection.final, selection.layers):
        stored |= encode(name, hidden[name][row, :length], selection.dtype)
    if selection.logits == "topk":
        logprobs, ids = torch.log_softmax(out.logits[row, :length].float(), dim=-1).topk(selection.topk, dim=-1)
        stored["topk_ids"] = ids.to(torch.int32)
        stored["topk_logprobs"] = logprobs.to(DISTRIBUTION_DTYPE)
    elif selection.logits == "full":
        limit = torch.finfo(DISTRIBUTION_DTYPE).max  # saturate rather than store inf
        stored["logits"] = out.logits[row, :length].float().clamp(-limit, limit).to(DISTRIBUTION_DTYPE)
    return {name: tensor.contiguous().cpu() for name, tensor in stored.items()}


def refuse_nonfinite(stored: dict[str, torch.Tensor], rows: dict[str, list], index: int) -> None:
    """A shard never holds NaN/inf features: a target that produces them is reported at capture, not
    as a NaN loss somewhere in training. (Top-k log-probabilities may be -inf: zero probability.)"""
    for name, tensor in stored.items():
        values = tensor.float()
        bad = values.isnan() if name == "topk_logprobs" else ~values.isfinite()
        if bad.any():
            position = int(bad.reshape(len(values), -1).any(-1).nonzero()[0])
            raise UserError(
                f"the target's {name} is not finite at token {position} of {rows['sample'][index]}; refusing to write "
                "a shard with it"
            )


def write_shard(
    directory: Path, shard: ShardPlan, tensors: dict[str, torch.Tensor], domains: list[str]
) -> dict[str, Any]:
    """Write to `<name>.tmp`, make it durable, rename it into place; return its manifest entry."""
    path = directory / shard.name
    tmp = path.with_name(path.name + ".tmp")
    # One metadata key: safetensors writes several in a per-process random order, and a shard must
    # be the same bytes whenever it is made (a resumed capture equals an uninterrupted one).
    header = {
        "schema_version": SCHEMA_VERSION,
        "first_conversation": shard.start,
        "domains": domains,
    }  # domains: one per conversation
    try:
        save_file(tensors, str(tmp), metadata={SHARD_METADATA: json.dumps(header, sort_keys=True)})
    except SafetensorError as err:  # how safetensors reports a full disk; an OSError is one already
        tmp.unlink(missing_ok=True)
        raise StorageError(f"could not write {tmp}: {one_line(err)}; the shards before it are intact") from None
    os.chmod(tmp, shard_mode())
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())  # the rename must never publish bytes still only in the page cache
    digest = file_sha256(tmp)
    os.replace(tmp, path)
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


def merge_manifest(directory: Path, settings: dict[str, Any], cfg: DictConfig, tokenizer) -> dict[str, Any]:
    """Join every rank's part into manifest.json, with totals and the bytes/token comparison."""
    parts = [read_json(directory / part_name(rank)) for rank in range(settings["world_size"])]
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
        "tokenizer": tokenizer_identity(tokenizer),
        "data": {
            "sources": list(cfg.data.train),
            "max_length": cfg.data.max_length,
            "overlong": cfg.data.overlong,
            "max_conversations": cfg.data.max_conversations,
        },
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
    storage = str(STORAGE_DTYPES[settings["dtype"]]).removeprefix("torch.")
    fields = {"input_ids": "int32 [T]", "loss_mask": "uint8 [T]", "offsets": "int64 [conversations + 1]"}
    for name in hidden_names(settings["final"], settings["layers"]):
        fields[name] = f"{storage} [T, {hidden_size}]"
        if settings["dtype"] == "float8":
            fields[f"{name}.scale"] = (
                f"float32 [T]: {name} = {name}.float() * scale[:, None], scale = absmax / {FP8_MAX:g}"
            )
    distribution = str(DISTRIBUTION_DTYPE).removeprefix("torch.")
    shapes = {
        "topk_ids": f"int32 [T, {settings['topk']}]",
        "topk_logprobs": f"{distribution} [T, {settings['topk']}]",
        "logits": f"{distribution} [T, {settings['target']['vocab_size']}]",
    }
    fields |= {name: shapes[name] for name in DISTRIBUTION_FIELDS[settings["logits"]]}
    return fields


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not valid JSON ({err}); remove it to capture again") from None


def write_json(path: Path, value: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(value, indent=2) + "\n")


if __name__ == "__main__":
    from draftsmith.cli import configure_logging, entry_point

    configure_logging()
    entry_point(main, __doc__, command="capture")
