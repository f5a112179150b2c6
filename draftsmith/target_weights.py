"""Which weights a target holds, as every checkpoint, capture and export records it beside the target's sizes
(`TargetShape.embedding_norms` and `TargetShape.layer_values`), and how two records are compared.

A record is read from the loaded target, or alone from its checkpoint by the modules' names where the stage does not
hold the weights: a vLLM capture (vLLM runs the target, this process builds it without weights) and a sharded target
(its layers' pieces would be gathered by a collective every rank must join).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from draftsmith.errors import UserError
from draftsmith.hub_cache import hub_revision
from draftsmith.model_files import checkpoint_folder, stored_name, tensor_names

EMBEDDING_ROWS = 8  # TargetShape.embedding_norms: the rows read
LAYER_VALUES = 8  # TargetShape.layer_values: the values read of each weight of the last layer
LAYER_TOLERANCE = 4e-3  # same_layer_values: how far apart they may be, of the largest of a weight's values
WEIGHT_RECORDS = ("embedding_norms", "layer_values")  # the fields of TargetShape that say which weights


def row_norms(rows: torch.Tensor) -> tuple[float, ...]:
    """`TargetShape.embedding_norms` of the input embedding's first rows (one copy to the host)."""
    return tuple(round(norm, 6) for norm in rows.float().norm(dim=1).tolist())


def last_layer_weights(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The weights `TargetShape.layer_values` reads, by their names in `model`: each module's `weight` of two or more
    dimensions (and at least LAYER_VALUES values) in the target's last decoder layer, in the module's order (a
    checkpoint stores them by these names; a fused expert stack is a load's own, built from the experts'); none where
    its decoder keeps no list of its layer count, and for a quantized target, whose values as loaded depend on where
    (FP8 kept on a GPU, dequantized on a CPU) and differ from its checkpoint's."""
    if getattr(model.config, "quantization_config", None) is not None:
        return []
    decoder = decoder_of(model)
    count = getattr(getattr(decoder, "config", None), "num_hidden_layers", None)
    stacks = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if not stacks:
        return []
    prefix = next(name for name, found in model.named_modules() if found is stacks[0][-1])
    named = stacks[0][-1].named_parameters()
    kept = [(name, p) for name, p in named if name.rpartition(".")[2] == "weight" and p.dim() >= 2]
    return [(f"{prefix}.{name}", p) for name, p in kept if p.numel() >= LAYER_VALUES]


def decoder_of(model) -> torch.nn.Module:
    """The target's decoder (its layers and final norm): `get_decoder()`, or where that answers the causal LM itself
    (Llama-4's text model class) the model it wraps."""
    from transformers import PreTrainedModel

    decoder = model.get_decoder()
    if decoder is model:
        decoder = next((child for child in model.children() if isinstance(child, PreTrainedModel)), model)
    return decoder


def layer_values(weights: Sequence[torch.Tensor]) -> Optional[tuple[float, ...]]:
    """`TargetShape.layer_values`: the first LAYER_VALUES values of each of `last_layer_weights`, wherever they were
    read from (one copy to the host); None where there are none. Values, not norms: a fine-tune's small update moves a
    row's norm by far less than bfloat16 rounds it (second order), and its values by more (`same_layer_values`)."""
    if not weights:
        return None
    values = torch.cat([w.detach().reshape(-1)[:LAYER_VALUES].float() for w in weights]).tolist()
    return tuple(float(f"{value:.6g}") for value in values)


def loaded_records(model, name_or_path: str) -> dict:
    """The records of a loaded target: its embedding's rows as it holds them, its last layer's values as it holds
    them or, where they are sharded (DTensor), as its checkpoint `name_or_path` stores them."""
    norms = row_norms(model.get_input_embeddings().weight[:EMBEDDING_ROWS].detach())
    weights = [p for _, p in last_layer_weights(model)]
    if not any(isinstance(w, DTensor) for w in weights):
        return {"embedding_norms": norms, "layer_values": layer_values(weights)}
    try:
        return {"embedding_norms": norms, "layer_values": stored_layer_values(model, name_or_path)}
    except UserError:  # a name that is no checkpoint here: not read, as in what an earlier draftsmith saved
        return {"embedding_norms": norms, "layer_values": None}


def stored_records(model, name_or_path: str, reader: str) -> dict:
    """The records of `model`'s weights read alone from its checkpoint `name_or_path` by the modules' names (`model`
    may hold none: a target built empty; a wrapper's language model by the names its release stores: `stored_name`);
    each None where the checkpoint stores its weights under other names or in other shapes. `reader` names what reads
    them, for the line when the checkpoint cannot be read."""
    embedding, norms = stored_weight_name(model, model.get_input_embeddings(), name_or_path, reader), None
    if embedding is not None:
        stored = tensor_names(checkpoint_folder(name_or_path, reader, hub_revision(model)))
        with safe_open(str(stored[embedding]), "pt") as f:
            norms = row_norms(f.get_slice(embedding)[:EMBEDDING_ROWS])
    return {"embedding_norms": norms, "layer_values": stored_layer_values(model, name_or_path, reader)}


def stored_weight_name(model, module, name_or_path: str, reader: str) -> Optional[str]:
    """The checkpoint name of `module`'s weight (`stored_name`), if the checkpoint holds it."""
    if module is None:
        return None
    prefix = next(name for name, found in model.named_modules() if found is module)
    return stored_name(f"{prefix}.weight", tensor_names(checkpoint_folder(name_or_path, reader, hub_revision(model))))


def stored_layer_values(model, name_or_path: str, reader: str = "target.shard") -> Optional[tuple[float, ...]]:
    """`layer_values` of `last_layer_weights(model)` read alone from the checkpoint, each tensor's first values only."""
    stored = tensor_names(checkpoint_folder(name_or_path, reader, hub_revision(model)))
    layer = [(stored_name(name, stored), weight) for name, weight in last_layer_weights(model)]
    if not layer or any(name is None for name, _ in layer):
        return None
    leading = []
    for name, weight in layer:
        with safe_open(str(stored[name]), "pt") as f:
            tensor = f.get_slice(name)
            if list(tensor.get_shape()) != list(weight.shape):
                return None
            leading.append(tensor[first_values(weight.shape, LAYER_VALUES)])
    return layer_values(leading)


def first_values(shape: torch.Size, count: int) -> tuple[slice, ...]:
    """The slice of a tensor of `shape` that holds its first `count` values in row-major order: a checkpoint tensor
    is read by it, not whole."""
    index = []
    for dim in range(len(shape)):
        inner = math.prod(shape[dim + 1 :])
        if inner < count:
            return (*index, slice(0, math.ceil(count / inner)))
        index.append(slice(0, 1))
    return tuple(index)


def same_layer_values(mine: Optional[Sequence[float]], theirs: Optional[Sequence[float]]) -> bool:
    """Whether two records of a target's last layer's values (`TargetShape.layer_values`) are of the same weights, as
    far as both know: each weight's LAYER_VALUES values within LAYER_TOLERANCE of the largest of them, as bfloat16 and
    float16 round them (0.2% and 0.05% of a value; a float16 subnormal, absolutely, far less), and a fine-tune moves
    them by more."""
    if mine is None or theirs is None or len(mine) != len(theirs):
        return True
    for first in range(0, len(mine), LAYER_VALUES):
        a, b = mine[first : first + LAYER_VALUES], theirs[first : first + LAYER_VALUES]
        scale = max(max(map(abs, a)), max(map(abs, b)), 1e-12)
        if any(abs(x - y) > LAYER_TOLERANCE * scale for x, y in zip(a, b)):
            return False
    return True


def same_embedding_norms(mine: Optional[Sequence[float]], theirs: Optional[Sequence[float]]) -> bool:
    """Whether two records of a target's first embedding rows' norms (`TargetShape.embedding_norms`) are of the same
    weights, as far as both know: bfloat16 rounds a row's norm by under 0.5%, two different models' first rows differ
    by far more."""
    if mine is None or theirs is None or len(mine) != len(theirs):
        return True
    return all(abs(a - b) <= 1e-2 * max(abs(a), abs(b), 1e-6) for a, b in zip(mine, theirs))
