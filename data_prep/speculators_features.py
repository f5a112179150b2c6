"""The target's states in the offline data format of speculators 0.9.0 (vLLM's drafter trainer), from
draftsmith's own tokenization and target forward, so the same conversations and states feed both
trainers:

    python -m data_prep.speculators_features OUTPUT recipe=NAME [key=value ...]

OUTPUT is a folder `speculators train --data-path OUTPUT` reads without a vLLM server:

- the rows (`datasets` save_to_disk, torch format): `input_ids`, `loss_mask` and `seq_len` of every
  conversation of the recipe's `data.train`, tokenized exactly as draftsmith's training tokenizes it
  (chat template, assistant mask, `data.max_length`), in order;
- `hidden_states/hs_{i}.safetensors` for row i: `token_ids` [T] and `hidden_states` [T, taps + 1, H],
  the taps in vLLM's layer ids and, last, the final decoder layer's output before the final norm
  (what vLLM's `extract_hidden_states` appends; speculators' reader splits it off as the verifier's
  last state);
- `token_freq.pt`: the count of every token under the loss mask, as `speculators prepare-data` writes
  it, from which `--draft-vocab-size` picks the draft vocabulary;
- `draftsmith_features.json`: the target, the layer ids in both conventions, the rows (their count and a
  sha256 of their tokens and masks); written last, when the folder is complete (until then the same
  record is `draftsmith_features.unfinished.json`, written before the first state).

Layer ids: the taps are the target layers the recipe's drafter reads, asked of its kind through the registry
(EAGLE-3's `aux_layers`, its default when unset, moved onto attention layers on a hybrid target as `draftsmith
train` moves them); a kind that reads no inner layer is refused. draftsmith's
id i is the output of decoder layer i; vLLM's (speculators' `--target-layer-ids`) id j is the input of
layer j, transformers' `hidden_states[j]`: j = i + 1. vLLM's id L, the last slot, is not transformers'
`hidden_states[L]` (that one is after the final norm), so it is read at the final norm's input. The ids
are checked as `draftsmith train` checks the drafter's, and the last layer (every row's last
slot already) is refused, before the data is read.

A row's file is written to `.tmp` and renamed when complete: a run killed and started again skips the
finished rows; a complete folder is left as it is. Only a run with the same record continues a folder:
one made with other settings, or holding files but no record, is refused before anything is written, as
its states would be mixed with rows they do not belong to. One run at a time writes a folder (its lock).
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports below (torch's: seconds): draftsmith.cli.run_module
    from draftsmith.cli import run_module

    run_module("draftsmith.data_prep.speculators_features", __doc__, positional=1)

import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Sequence

import torch
from omegaconf import OmegaConf

from draftsmith.data_prep.dataset import load_tokenized
from draftsmith.errors import UserError
from draftsmith.files import created_file_mode, replacing, require_same_settings, save_safetensors, write_text_atomic
from draftsmith.heads import drafter_class
from draftsmith.outputs import LOCK_NAME, DirectoryLock, check_output_dir
from draftsmith.recipe import load_recipe
from draftsmith.target import (
    DTYPES,
    TargetShape,
    dtype_name,
    layer_output,
    load_target,
    load_tokenizer,
    num_layers,
    resolve_dtype,
)
from draftsmith.target_loading import load_config

HIDDEN_STATES = "hidden_states"
TOKEN_FREQ = "token_freq.pt"
INFO = "draftsmith_features.json"
UNFINISHED = "draftsmith_features.unfinished.json"  # INFO while the folder is being written


def speculators_states(model, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """[T, len(layer_ids) + 1, H] for one sequence `input_ids` [T]: transformers' `hidden_states[j]`
    for each vLLM layer id j < L (the mean of its residual streams on a multi-stream target, as vLLM reads it:
    `layer_output`), then the last decoder layer's output before the final norm."""
    count = num_layers(model)
    if any(not 0 <= j < count for j in layer_ids):
        raise UserError(
            f"speculators' layer ids {list(layer_ids)} must lie in 0..{count - 1} for a target of {count} layers"
        )
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is None:
        raise UserError(
            f"{type(model).__name__} has no final norm at get_decoder().norm: its pre-norm last state cannot be read"
        )
    captured = []
    handle = norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            states = model(input_ids=input_ids[None], output_hidden_states=True, return_dict=True).hidden_states
    finally:
        handle.remove()
    return torch.stack([*(layer_output(states, j - 1)[0] for j in layer_ids), captured[-1][0]], dim=1)


def tap_layer_ids(cfg, config, target: TargetShape) -> list[int]:
    """draftsmith's ids of the taps: the target layers the recipe's drafter reads (its kind's `features`), resolved
    for this target (`config`: its HF config) as `draftsmith train` resolves them (`for_target`) and refused as
    train refuses them. Refused too: a kind that reads no inner layer (speculators' features are inner-layer taps),
    and the target's last layer, whose output (vLLM id L) is every row's last slot already, which speculators'
    reader splits off."""
    kind = drafter_class(cfg.drafter.type)
    drafter = OmegaConf.to_object(cfg.drafter)
    drafter.check(target)
    ours = list(kind.features(kind.for_target(drafter, target, config), target).layers)
    if not ours:
        raise UserError(
            f"speculators' features are a drafter kind's taps of the target's inner layers, and drafter.type="
            f"{cfg.drafter.type} reads none: give a recipe whose drafter taps inner layers"
        )
    last = target.num_hidden_layers - 1
    if last in ours:
        raise UserError(
            f"drafter.type={cfg.drafter.type} taps layers {ours}: layer {last} is the target's last, whose output "
            f"every speculators row holds already as its last slot (vLLM id {last + 1}): tap layers in -1..{last - 1}"
        )
    return ours


def claim_folder(output: Path, info: dict) -> bool:
    """Whether `output` is complete already with these features (`info`); otherwise it is new or an unfinished
    run's with the same `info`, recorded (UNFINISHED) before anything else is written. Any other folder is
    refused: resuming it would mix its states with rows they do not belong to."""
    record = next((output / name for name in (INFO, UNFINISHED) if (output / name).is_file()), None)
    if record is not None and record.name == UNFINISHED and not any((output / HIDDEN_STATES).glob("hs_*.safetensors")):
        record = None  # a run that stopped before its first state (a target that did not load) left nothing to mix
    elif record is None and any(entry.is_file() and entry.name != LOCK_NAME for entry in output.rglob("*")):
        raise UserError(f"{output} holds files but no {INFO}: give another OUTPUT folder, or delete it")
    if record is None:
        output.mkdir(parents=True, exist_ok=True)
        write_text_atomic(output / UNFINISHED, json.dumps(info, indent=2) + "\n")
        return False
    try:
        found = json.loads(record.read_text())
    except ValueError:
        found = {}
    found = found if isinstance(found, dict) else {}
    require_same_settings(
        found, info, f"{output} holds speculators features made", "give another OUTPUT folder, or delete it"
    )
    return record.name == INFO


def write_speculators_data(cfg, output: Path, dtype: str = "bfloat16") -> dict:
    """Write `output` (the module docstring's layout) for recipe `cfg`; returns its info."""

    output = Path(output)
    check_output_dir(output, named=f"OUTPUT {str(output)!r}")
    config = load_config(cfg.target)
    target = TargetShape.from_config(config, cfg.target.name_or_path)
    ours = tap_layer_ids(cfg, config, target)
    layer_ids = [i + 1 for i in ours]
    tokenizer = load_tokenizer(cfg.target)
    rows = load_tokenized(cfg, cfg.data.train, tokenizer, "data.train")
    frequency: Counter[int] = Counter()
    digest = hashlib.sha256()
    for row in rows:
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        mask = torch.tensor(row["loss_mask"], dtype=torch.bool)
        frequency.update(ids[mask].tolist())
        digest.update(len(ids).to_bytes(8, "little") + ids.numpy().tobytes() + mask.numpy().tobytes())
    info = {
        "target": str(cfg.target.name_or_path),  # speculators reads the verifier from it
        "target_revision": cfg.target.revision,
        "target_dtype": dtype_name(resolve_dtype(cfg.target.dtype, "cpu")),
        "draftsmith_layer_ids": ours,
        "speculators_layer_ids": layer_ids,
        "last_slot": f"vLLM id {target.num_hidden_layers}: the last decoder layer's output before the final norm",
        "dtype": dtype,
        "data": list(cfg.data.train),
        "max_length": int(cfg.data.max_length),
        "rows": len(rows),
        "tokens": int(sum(rows["length"])),
        "masked_tokens": int(sum(frequency.values())),
        "rows_sha256": digest.hexdigest()[:16],  # what the states were computed from, whatever made the rows
    }
    with DirectoryLock(output, key="OUTPUT"):
        if not claim_folder(output, info):
            write_features(cfg, output, rows, layer_ids, frequency, dtype)
    return info


def write_features(cfg, output: Path, rows, layer_ids: list[int], frequency: Counter, dtype: str) -> None:
    """The states of every row not written yet, then the rows, the token counts and the record."""
    import datasets

    hidden_dir = output / HIDDEN_STATES
    hidden_dir.mkdir(exist_ok=True)
    model = load_target(cfg.target, "cpu")
    for index, row in enumerate(rows):
        path = hidden_dir / f"hs_{index}.safetensors"
        if path.is_file():
            continue
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        states = speculators_states(model, ids, layer_ids).to(DTYPES[dtype]).contiguous()
        with replacing(path) as tmp:  # a full disk leaves no partial row behind
            save_safetensors({"token_ids": ids, HIDDEN_STATES: states}, tmp)
            os.chmod(tmp, created_file_mode())  # speculators run by another user reads them
    table = datasets.Dataset.from_dict(
        {"input_ids": rows["input_ids"], "loss_mask": rows["loss_mask"], "seq_len": rows["length"]}
    )
    # speculators' reader compares token ids as tensors: the torch format is saved with the rows
    table.with_format("torch").save_to_disk(str(output))
    torch.save(dict(frequency), output / TOKEN_FREQ)
    os.replace(output / UNFINISHED, output / INFO)


def main(argv: Sequence[str]) -> None:
    if not argv or "=" in argv[0]:
        from draftsmith.cli import invoked_usage

        raise UserError(
            f"usage: {invoked_usage('python -m data_prep.speculators_features OUTPUT recipe=NAME [key=value ...]')}"
        )
    if not argv[0]:  # `"$OUT"` with OUT unset: Path("") is the current folder
        raise UserError("OUTPUT is empty: give the folder to write the features to")
    print(json.dumps(write_speculators_data(load_recipe(list(argv[1:])), Path(argv[0])), indent=2))
