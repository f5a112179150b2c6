"""A data stage's vLLM engine (data.regenerate.engine=vllm, data.capture.engine=vllm): the keyword arguments of vLLM's
`LLM` and the worker's environment, from the recipe's `target` section and the stage's `vllm` section
(draftsmith.recipe_schema.VllmEngineSection), so both stages run the target alike."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch

from draftsmith.engines import serves_language_model_only
from draftsmith.model_files import SAFETENSORS_INDEX
from draftsmith.target import dtype_name, local_target_config, resolve_device, resolve_dtype

log = logging.getLogger("draftsmith.data")


def warn_unread_vllm(section, prefix: str) -> None:
    """A data stage run by transformers says which of its `vllm` settings (`section`: data.capture or
    data.regenerate, under `prefix`) it does not read: a recipe made for vLLM (eagle3_sharegpt_smollm2's) switched to
    transformers keeps them, and a vLLM setting given without `engine=vllm` would run the stage without it, unsaid."""
    from draftsmith.recipe_schema import VllmEngineSection

    if section.engine == "vllm":
        return
    unread = [
        f"{prefix}.vllm.{key}={value}"
        for key, value in section.vllm.items()
        if value != getattr(VllmEngineSection, key)
    ]
    if unread:
        log.warning(
            "%s: not read: %s.engine=%s runs the target in this process (%s.engine=vllm reads them)",
            ", ".join(unread), prefix, section.engine, prefix,
        )  # fmt: skip


def vllm_dtype(target, vllm) -> str:
    """The dtype vLLM runs the target in: the stage's vllm.dtype, whose auto is the dtype the trainer loads the target
    in on this machine (target.dtype), so that what the engine computes is that target's."""
    dtype = resolve_dtype(target.dtype if vllm.dtype == "auto" else vllm.dtype, resolve_device())
    return dtype_name(dtype)


def engine_arguments(target, vllm, max_model_len: int, seed: int, state) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM's `LLM` arguments for this rank's engine, and what its worker's environment adds: on a CPU the job's torch
    threads (vLLM-CPU would take one), with several processes on GPUs each rank's engine on GPUs of its own."""
    gpu = torch.cuda.is_available()
    arguments = {
        "model": target.name_or_path,
        "revision": target.revision,
        "tokenizer": target.name_or_path,
        "dtype": vllm_dtype(target, vllm),
        "tensor_parallel_size": vllm.tensor_parallel_size,
        "gpu_memory_utilization": vllm.gpu_memory_utilization or (0.9 if gpu else 0.3),
        "enforce_eager": (not gpu) if vllm.enforce_eager is None else vllm.enforce_eager,
        "max_num_seqs": vllm.max_num_seqs,
        "max_model_len": max_model_len,
        "seed": seed,
        "trust_remote_code": bool(target.trust_remote_code),  # the target's own code, as draftsmith runs it
    }
    if serves_language_model_only(target.name_or_path):  # text prompts: a wrapper's processor is never used
        arguments["language_model_only"] = True
    env = {} if gpu or "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    if gpu and state.num_processes > 1:  # data parallel: this rank's engine on its own GPUs
        first = state.local_process_index * vllm.tensor_parallel_size
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(vllm.tensor_parallel_size))
    return arguments, env


def engine_refusal(target, vllm, key: str) -> Optional[str]:
    """Why vLLM would not start on the stage's settings (`key`: its `vllm` section's recipe key), in one line before
    any data is read; None when it may: a local target folder without safetensors weights, and a tensor-parallel size
    that does not divide the target's attention heads. What vLLM refuses beyond these (its config's own validation) is
    the same kind of line when the engine starts (VllmEngine)."""
    folder = Path(target.name_or_path)
    if folder.is_dir() and not ((folder / SAFETENSORS_INDEX).is_file() or any(folder.glob("*.safetensors"))):
        return f"target.name_or_path={target.name_or_path!r} holds no safetensors weights for vLLM to load"
    config = local_target_config(target.name_or_path) or {}
    heads = (config.get("text_config") or config).get("num_attention_heads")
    if isinstance(heads, int) and heads % vllm.tensor_parallel_size:
        return (
            f"{key}.tensor_parallel_size={vllm.tensor_parallel_size} does not divide the target's {heads} attention "
            "heads, which vLLM splits evenly over its GPUs"
        )
    return None
