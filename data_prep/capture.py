"""Capture the frozen target's features over `data.train` into sharded safetensors files:

    python -m data_prep.capture recipe=NAME [key=value ...]
    accelerate launch -m data_prep.capture recipe=NAME ...   (or torchrun --nproc-per-node N -m ...)

The recipe's `data.capture` section says what to store; by default exactly what the recipe's drafter
asks for (its `features`), in bfloat16. data_prep/features.py describes the format and reads it.

Work is planned deterministically from the tokenized data's order: rank r of N takes the r-th
contiguous slice of the conversations and cuts it into shards of about `shard_tokens` tokens, so a
shard's name says which conversations it holds. A shard is written to `<name>.tmp` and renamed when
complete, and only then recorded in the rank's manifest part (data_prep/capture_files.py); a killed
job run again skips the recorded shards whose sha256 still matches and redoes the rest (a `.tmp` is
never read, only overwritten). After a barrier, rank 0 merges the parts into manifest.json.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports below (torch's: seconds): draftsmith.cli.run_module
    from draftsmith.cli import run_module

    run_module("draftsmith.data_prep.capture", __doc__, command="capture")

import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from itertools import accumulate, chain
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.data_prep.capture_files import (
    CAPTURE_AGAIN,
    ShardPlan,
    data_record,
    is_intact,
    merge_manifest,
    recorded_data,
    refuse_foreign_files,
    refuse_other_capture,
    remove_leftovers,
    write_shard,
)
from draftsmith.data_prep.capture_vllm import VllmCapture
from draftsmith.data_prep.collate import Collator
from draftsmith.data_prep.conversations import load_conversations
from draftsmith.data_prep.dataset import cache_key, require_context, tokenize_conversations
from draftsmith.data_prep.features import DISTRIBUTION_DTYPE, encode, hidden_names, manifest_part_name
from draftsmith.data_prep.local_files import source_files
from draftsmith.data_prep.vllm_stage import warn_unread_vllm
from draftsmith.errors import UserError
from draftsmith.files import read_json, write_json
from draftsmith.outputs import held_by_main_process
from draftsmith.progress import progress_bar
from draftsmith.recipe import load_recipe
from draftsmith.recipe_schema import CaptureSection
from draftsmith.sharding import Lockstep, end_process_group, ranks_state
from draftsmith.streams import not_captured
from draftsmith.target import (
    FeatureRequest,
    TargetOutput,
    TargetShape,
    check_layer_ids,
    check_layers,
    dtype_name,
    load_target,
    load_tokenizer,
    run_target,
)
from draftsmith.target_loading import load_config

log = logging.getLogger("draftsmith.capture")


@dataclass(frozen=True)
class Selection:
    """What goes into every shard (the recipe's data.capture with the drafter's defaults filled in)."""

    final: bool
    layers: tuple[int, ...]
    logits: str  # none | topk | full
    topk: Optional[int]  # entries per token when logits=topk, else None
    dtype: str  # bfloat16 | float16 | float8


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
    state = ranks_state()
    directory = Path(cfg.data.capture.output or Path(cfg.output_dir) / "features")
    with held_by_main_process(directory, state, key="data.capture.output"):
        return capture_into(cfg, directory, state)


def capture_into(cfg: DictConfig, directory: Path, state) -> CaptureResult:
    section = cfg.data.capture
    if not cfg.data.train:
        raise UserError("data.train is empty: give at least one conversation file or Hub data set id to capture")
    warn_unread_vllm(section, "data.capture")
    refuse_foreign_files(directory)
    config = load_config(cfg.target)  # config.json, read once: what the target has not, before its weights load
    require_context(cfg.target, cfg.data.max_length, config)
    config = config.get_text_config()
    if section.layers is not None:
        check_layer_ids(config.num_hidden_layers, section.layers)
    if section.logits == "topk" or section.topk != CaptureSection.topk:  # a top-k the capture keeps, or refuses unused
        require_topk_within(section.topk, getattr(config, "vocab_size", None))
    for source in cfg.data.train:  # a path that does not exist: one line before the target loads
        source_files(str(source))
    tokenizer = load_tokenizer(cfg.target)
    engine = CAPTURE_ENGINES[section.engine]
    # the target and what to capture of it before the data, as training loads it (trainer/setup.py): one that cannot
    # be a target, or a capture the engine cannot make, is refused before minutes of tokenizing
    target = engine.target(cfg, state)
    selection = resolve_selection(cfg, target)
    if refusal := engine.refusal(cfg, selection, target):
        raise UserError(refusal)
    made_with = {
        "target": target_description(engine.shape(cfg, target), target, cfg),
        "final": selection.final,
        "layers": list(selection.layers),
        "logits": selection.logits,
        "topk": selection.topk,
        "dtype": selection.dtype,
        "shard_tokens": section.shard_tokens,
        "world_size": state.num_processes,
        "engine": section.engine,
    }
    # every setting, the data's as the recipe gives them, before minutes of tokenizing
    refuse_other_capture(directory, made_with, {"data": recorded_data(cfg)})
    with state.main_process_first():  # rank 0 tokenizes and caches, the others read the cache
        # Exactly as training tokenizes (data_prep.dataset.load_tokenized), so a capture lines up with the
        # online data set row by row; the conversations' fingerprint also keys the capture.
        conversations = load_conversations(
            list(cfg.data.train), cfg.data.max_conversations, skip_invalid_utf8=cfg.data.skip_invalid_utf8
        )
        data = tokenize_conversations(
            conversations, tokenizer, cfg.data.max_length, cfg.data.overlong, cfg.data.cache_dir, cfg.data.thinking
        )
    fingerprint = cache_key(conversations, tokenizer, cfg.data.max_length, cfg.data.overlong, cfg.data.thinking)
    settings = {"target": made_with["target"], "data_fingerprint": fingerprint, **made_with}  # the files' key order
    # Every rank checks before any rank writes, so all of them see the same files and agree.
    made_from = data_record(cfg, tokenizer, data) | {"engine_release": engine.release(cfg)}  # recorded, not compared
    refuse_other_capture(directory, settings, made_from)
    if state.is_main_process:
        remove_leftovers(directory)
    state.wait_for_everyone()

    plan = plan_shards(list(data["length"]), state.num_processes, section.shard_tokens)[state.process_index]
    part_path = directory / manifest_part_name(state.process_index)
    part = read_json(part_path, advice=CAPTURE_AGAIN) if part_path.is_file() else {"shards": []}
    done = {entry["file"]: entry for entry in part["shards"]}

    run = {"tokens_computed": 0, "seconds": 0.0}  # this run's work on this rank (a resumed run reuses shards)

    def record() -> None:
        shards = sorted(done.values(), key=lambda entry: entry["index"])
        rank = state.process_index
        write_json(part_path, {"settings": settings, **made_from, "rank": rank, "shards": shards, "last_run": run})

    record()  # from the start, so the merge finds a part for every rank, even one with no conversations
    computed = 0
    missing = [
        shard for shard in plan if shard.name not in done or not is_intact(directory / shard.name, done[shard.name])
    ]
    progress = progress_bar(
        total=sum(s.tokens for s in plan),
        initial=sum(shard.tokens for shard in plan) - sum(shard.tokens for shard in missing),  # not in its rate
        unit="tok",
        desc="capture",
        disable=not state.is_main_process,
    )
    reused = len(plan) - len(missing)
    with engine.opened(cfg, target, tokenizer, selection, directory, state, bool(missing)) as computing:
        started = time.perf_counter()  # the engine started: its start is not this run's capture rate
        for shard in missing:
            rows = data[shard.start : shard.stop]
            stored = computing.shard(rows, progress)
            for index, conversation in enumerate(stored):
                refuse_nonfinite(conversation, rows, index)
            done[shard.name] = write_shard(directory, shard, shard_tensors(stored, rows), rows["domain"])
            computed += 1
            run["tokens_computed"] += shard.tokens
            run["seconds"] = round(time.perf_counter() - started, 3)  # forward + encode + write
            record()  # only now that the shard is in place under its final name
    progress.close()
    log.info("rank %d: computed %d shard(s), reused %d", state.process_index, computed, reused)

    state.wait_for_everyone()
    manifest = None
    if state.is_main_process:
        manifest = merge_manifest(directory, settings, made_from)
        rate = manifest["last_run"]["tokens_per_s"]
        print(
            f"captured {manifest['tokens']} tokens ({manifest['conversations']} conversations, "
            f"{len(manifest['shards'])} shards) into {directory}: {manifest['bytes_per_token']:.1f} bytes/token; "
            f"EAGLE-3's four bf16 features (8*H) would be {manifest['anchor_bytes_per_token']} bytes/token (ratio "
            f"{manifest['anchor_ratio']:.3f}); "
            + (f"this run captured {rate:.0f} tokens/s" if rate else "every shard was complete, none computed"),
            flush=True,
        )
    return CaptureResult(directory=directory, computed=computed, reused=reused, manifest=manifest)


def require_topk_within(topk: int, vocab: Optional[int]) -> None:
    if vocab is not None and topk > vocab:
        raise UserError(f"data.capture.topk={topk} is more than the target's vocabulary of {vocab}")


def resolve_selection(cfg: DictConfig, target) -> Selection:
    """data.capture with None/auto replaced by what the recipe's drafter asks for."""
    from draftsmith.heads import drafter_class

    section = cfg.data.capture
    shape = TargetShape.of(target, cfg.target.name_or_path)
    kind = drafter_class(cfg.drafter.type)
    # the layers the drafter train builds reads: a default tap moved onto a hybrid target's attention layers too
    wanted = kind.features(kind.for_target(OmegaConf.to_object(cfg.drafter), shape, target.config), shape)
    if wanted.streams:
        raise not_captured(cfg.drafter.type, "draftsmith capture")
    layers = tuple(sorted(set(wanted.layers if section.layers is None else section.layers)))
    check_layers(target, layers)
    final = wanted.final if section.final is None else bool(section.final)
    logits = ("topk" if wanted.logits else "none") if section.logits == "auto" else section.logits
    if logits != "topk" and section.topk != CaptureSection.topk:  # it would change nothing, without a word
        raise UserError(
            f"data.capture.topk={section.topk} is read when the capture keeps the top-k distribution, and this one "
            f"keeps {logits} (data.capture.logits={section.logits}): set data.capture.logits=topk, or leave topk out"
        )
    if logits == "topk":
        require_topk_within(section.topk, target.get_output_embeddings().weight.shape[0])
    if not (final or layers or logits != "none"):
        raise UserError("nothing to capture: data.capture has final=false, no layers and logits=none")
    left_out = [f"layer {layer}" for layer in wanted.layers if layer not in layers]
    left_out += ["the final hidden state"] * (wanted.final and not final)
    left_out += ["the logits"] * (wanted.logits and logits == "none")
    if left_out:  # a capture of part of it is the user's to make; training this drafter from it is refused later
        log.warning(
            "the recipe's %s drafter reads %s, which these data.capture settings leave out: training it from this "
            "capture will be refused (leave data.capture.layers, final and logits unset for what it reads)",
            cfg.drafter.type,
            ", ".join(left_out),
        )
    return Selection(final, layers, logits, section.topk if logits == "topk" else None, section.dtype)


def target_description(shape: TargetShape, target, cfg: DictConfig) -> dict[str, Any]:
    """The target's shape (as the capture's engine reads it), id, revision and the dtype its forward ran in (features
    depend on it)."""
    return {
        **asdict(shape),
        "id": shape.id,
        "revision": cfg.target.revision,
        "dtype": dtype_name(target.dtype),
    }


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


class TransformersCapture:
    """The target in this process, loaded as training loads it; batches of conversations of similar length (less
    padding), each forward through lockstep when the target is sharded."""

    @staticmethod
    def target(cfg: DictConfig, state):
        return load_target(cfg.target, state.device, shard=cfg.target.shard)

    @staticmethod
    def shape(cfg: DictConfig, target) -> TargetShape:
        return TargetShape.of(target, cfg.target.name_or_path)

    @staticmethod
    def release(cfg: DictConfig) -> str:
        import transformers

        return f"transformers {transformers.__version__}, torch {torch.__version__}"

    @staticmethod
    def refusal(cfg: DictConfig, selection: Selection, target) -> Optional[str]:
        return None

    @classmethod
    @contextmanager
    def opened(cls, cfg: DictConfig, target, tokenizer, selection: Selection, directory: Path, state, needed: bool):
        # A sharded target's forwards are collectives, and ranks have different numbers of them (their slices
        # differ, a resumed run skips finished shards): Lockstep keeps them in step, here too on a rank with no work.
        engine = cls(target, selection, cfg.train.micro_batch_size, tokenizer.pad_token_id, state.device)
        yield engine
        engine.lockstep.finish()

    def __init__(self, target, selection: Selection, micro_batch_size: int, pad_token_id: int, device):
        self.target, self.selection, self.micro_batch_size, self.device = target, selection, micro_batch_size, device
        self.collate = Collator(pad_token_id)
        self.lockstep = Lockstep(target)

    @torch.no_grad()
    def shard(self, rows: dict[str, list], progress) -> list[dict[str, torch.Tensor]]:
        """Each conversation's stored tensors (on CPU), in data order."""
        request = FeatureRequest(
            final=self.selection.final, layers=self.selection.layers, logits=self.selection.logits != "none"
        )
        lengths: list[int] = rows["length"]
        stored: list[dict[str, torch.Tensor]] = [{} for _ in lengths]
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        for first in range(0, len(order), self.micro_batch_size):
            members = order[first : first + self.micro_batch_size]
            batch = self.collate(
                [{"input_ids": rows["input_ids"][i], "loss_mask": rows["loss_mask"][i]} for i in members]
            )
            out = self.lockstep.run(
                run_target, self.target, batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device),
                request,
            )  # fmt: skip
            for row, i in enumerate(members):
                stored[i] = stored_tensors(out, row, lengths[i], self.selection)
            progress.update(sum(lengths[i] for i in members))
        return stored


# data.capture.engine -> what computes the states: the target here, or a vLLM engine of its own (capture_vllm.py)
CAPTURE_ENGINES = {"transformers": TransformersCapture, "vllm": VllmCapture}


def shard_tensors(stored: list[dict[str, torch.Tensor]], rows: dict[str, list]) -> dict[str, torch.Tensor]:
    """A shard's tensors: its conversations' stored tensors end to end, with their tokens, loss masks and offsets."""
    tensors = {name: torch.cat([conversation[name] for conversation in stored]) for name in stored[0]}
    tensors["input_ids"] = torch.tensor(list(chain.from_iterable(rows["input_ids"])), dtype=torch.int32)
    tensors["loss_mask"] = torch.tensor(list(chain.from_iterable(rows["loss_mask"])), dtype=torch.uint8)
    tensors["offsets"] = torch.tensor([0, *accumulate(rows["length"])], dtype=torch.int64)
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
