"""`data.capture.engine=vllm`: the target's states computed by a vLLM engine in its own environment, stored in the
same shards as data_prep/capture.py's own forward writes (data_prep/features.py), so training reads either alike.

The engine runs vLLM's `extract_hidden_states` method: every prompt is prefilled once (one token generated), the asked
layers' states kept in a cache of their own and written to a file per prompt by draftsmith's connector
(draftsmith/engine_scripts/hidden_states.py); vLLM's prompt log-probabilities give the top-k. These are the
states vLLM hands its own EAGLE-3 drafter when it serves the target, computed by vLLM's kernels, with the target
sharded however vLLM shards it (`data.capture.vllm.tensor_parallel_size`); draftsmith never loads its weights.

vLLM's layer id j is the input of decoder layer j: draftsmith's layer i (its output) is vLLM's i + 1, and draftsmith's
-1 (the embeddings) vLLM's 0. vLLM hands out no state after the final norm and no whole next-token distribution: a
capture that asks for `final`, for the last layer (draftsmith's L - 1 is after the final norm, transformers'
`hidden_states[L]`; vLLM's L before it) or for `logits=full` is refused in one line before the data is read, as is a
vLLM environment that cannot import the target's model and vLLM's CPU build for a target it does not compute as defined
(formats/versions.py's limits). A model class without `SupportsEagle3` stops at the engine's start with vLLM's line.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from draftsmith.data_prep.features import DISTRIBUTION_DTYPE, encode, hidden_names
from draftsmith.data_prep.vllm_stage import engine_arguments, vllm_dtype
from draftsmith.engines import VllmEngine, vllm_distribution, vllm_python
from draftsmith.formats.versions import CPU_BUILD, cpu_build_limit, require_engine_imports
from draftsmith.target import empty_target, loaded_config, num_layers, resolve_dtype

PYTHON_KEY = "data.capture.vllm.python"


class VllmCapture:
    """A vLLM engine capturing this rank's shards; a shard's states pass through `scratch`, a folder of the capture's
    own that holds one request's files at a time (a `.tmp`: a killed run's is removed by the next)."""

    @staticmethod
    def target(cfg, state):
        """The target as the capture's checks read it: built without its weights, in the dtype vLLM runs it in."""
        return empty_target(cfg.target, resolve_dtype(vllm_dtype(cfg.target, cfg.data.capture.vllm), "cpu"))

    @staticmethod
    def refusal(cfg, selection, target) -> Optional[str]:
        """Why vLLM cannot capture `selection` of `target`, in one line; None when it can: what vLLM hands out, then
        the engine's environment (a Python without vLLM, or without what the target's vLLM model imports, is a line
        of its own) and build."""
        asked = unextractable(selection, num_layers(target))
        if asked is not None:
            return f"data.capture.engine=vllm cannot capture {asked}: set data.capture.engine=transformers"
        python = vllm_python(cfg.data.capture.vllm.python, PYTHON_KEY)
        config = loaded_config(target)
        require_engine_imports(config, python, PYTHON_KEY)
        limit = cpu_build_limit(config, vllm_dtype(cfg.target, cfg.data.capture.vllm))
        if limit is not None and vllm_distribution(python, PYTHON_KEY) == CPU_BUILD:
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
        arguments |= {
            # prompt log-probabilities of a prefix found cached would not be computed again
            "enable_prefix_caching": False,
            "max_logprobs": max(selection.topk or 0, 1),
            "logprobs_mode": "raw_logprobs",  # log-softmax of the target's logits, as draftsmith's forward stores
        }
        if selection.layers:  # a capture of the top-k alone needs no states
            arguments["speculative_config"] = {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": [layer + 1 for layer in selection.layers]}
                },
            }
            arguments["kv_transfer_config"] = {
                "kv_connector": "HiddenStatesConnector",
                "kv_connector_module_path": "hidden_states",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(scratch), "allow_custom_save_path": True},
            }
        with VllmEngine(vllm_python(v.python, PYTHON_KEY), PYTHON_KEY, arguments, env) as engine:
            yield cls(engine, selection, scratch, v.max_num_seqs)
        shutil.rmtree(scratch, ignore_errors=True)

    def __init__(self, engine: VllmEngine, selection, scratch: Path, requests: int):
        self.engine, self.selection, self.scratch, self.requests = engine, selection, scratch, requests

    def shard(self, rows: dict[str, list], progress) -> list[dict[str, torch.Tensor]]:
        """Each conversation's stored tensors (as data_prep.capture.stored_tensors converts a forward's), a request
        of up to max_num_seqs conversations at a time."""
        stored = []
        for first in range(0, len(rows["input_ids"]), self.requests):
            prompts = rows["input_ids"][first : first + self.requests]
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch.mkdir()
            files = self.engine.capture(prompts, self.selection.topk or 0, bool(self.selection.layers), self.scratch)
            for prompt, path in zip(prompts, files):
                stored.append(self.converted(load_file(path), prompt))
            progress.update(sum(map(len, prompts)))
        shutil.rmtree(self.scratch, ignore_errors=True)
        return stored

    def converted(self, tensors: dict[str, torch.Tensor], prompt: list[int]) -> dict[str, torch.Tensor]:
        if tensors["token_ids"].tolist() != list(prompt):  # a file of another request: never stored as this one's
            raise RuntimeError("vLLM's captured states are of other tokens than the conversation's")
        stored: dict[str, torch.Tensor] = {}
        for column, name in enumerate(hidden_names(False, self.selection.layers)):
            # [T, layers, H], in the order of the ascending layer ids asked
            stored |= encode(name, tensors["hidden_states"][:, column], self.selection.dtype)
        if self.selection.logits == "topk":
            stored["topk_ids"] = tensors["topk_ids"].to(torch.int32)
            stored["topk_logprobs"] = tensors["topk_logprobs"].to(DISTRIBUTION_DTYPE)
        return {name: tensor.contiguous() for name, tensor in stored.items()}


def unextractable(selection, layers: int) -> Optional[str]:
    """What of `selection` vLLM does not hand out (its decoder layers' states, through extract_hidden_states, and the
    top-k, from the prompt log-probabilities), of a target of `layers` layers; None when it hands out all of it."""
    last = layers - 1
    if last in selection.layers:
        return (
            f"layer {last}, in draftsmith's convention the target's last state after its final norm (transformers' "
            f"hidden_states[{last + 1}]), where vLLM's id {last + 1} is the state before that norm (or leave it out)"
        )
    if selection.final:
        return "the state after the final norm (data.capture.final, or the drafter's own features)"
    if selection.logits == "full":
        return "the whole next-token distribution (data.capture.logits=full)"
    return None
