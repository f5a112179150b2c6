"""What the engine tests that run vLLM's own modules without an engine (DFlash-backbone drafters' blocks, EAGLE-3's
draft step) run inside vLLM's environment, not draftsmith's (their scripts import it from tests/, which
`helpers.run_in_vllm` puts on that environment's path): vLLM's engine and speculative config for a drafter folder, and
its model's block outputs for a context and a block, computed by vLLM's own modules with its attention kernel replaced
by plain attention over [the context's keys/values ; the block's own] (`ContextThenBlock`; with an empty context, a
layer's own causal, windowed attention) and its grouped RMSNorms over stacked per-layer weights run layer by layer (the
CPU build's kernel applies layer 0's weight to every layer: tests/test_dflash_cpu_build.py)."""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs


def engine_config(target: str, speculative: dict):
    """vLLM's float32 engine config for `target` with the speculative config `speculative` resolved into it (set
    directly: the engine's own check refuses some methods on a CPU), and that speculative config."""
    config = EngineArgs(model=target, dtype="float32", max_model_len=256, enforce_eager=True).create_engine_config()
    spec = EngineArgs(model=target, speculative_config=speculative).create_speculative_config(
        config.model_config, config.parallel_config
    )
    object.__setattr__(config, "speculative_config", spec)
    return config, spec


def single_process(port: str) -> None:
    """vLLM's distributed state for one CPU process (call under `set_current_vllm_config`)."""
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    initialize_model_parallel(1, 1)


class ContextThenBlock(torch.nn.Module):
    """One layer's attention of the block's queries over the context's keys/values and the block's own, all visible,
    or, given the positions, within the layer's sliding window (vLLM's non-causal window: |distance| < window) and
    causal where the layer is."""

    def __init__(self, attention, keys, values, context_positions=None, block_positions=None):
        super().__init__()
        self.heads, self.kv, self.dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        self.scaling, self.keys, self.values = attention.scaling, keys, values
        self.window, self.causal = getattr(attention, "sliding_window", None), getattr(attention, "causal", False)
        self.context_positions, self.block_positions = context_positions, block_positions

    def forward(self, q, k, v):
        n = q.shape[0]
        keys = torch.cat([self.keys, k.view(n, self.kv, self.dim)]).repeat_interleave(self.heads // self.kv, 1)
        values = torch.cat([self.values, v.view(n, self.kv, self.dim)]).repeat_interleave(self.heads // self.kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q.view(n, self.heads, self.dim), keys) * self.scaling
        if self.block_positions is not None:
            every = torch.cat([self.context_positions, self.block_positions])
            distance = self.block_positions[:, None] - every[None, :]
            allowed = distance >= 0 if self.causal else torch.ones_like(distance, dtype=torch.bool)
            if self.window is not None:
                allowed &= distance.abs() <= self.window - 1
            scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, -1)


def per_layer_rms(weights, states, eps: float, shared: bool = False):
    """vLLM's grouped RMSNorm by the stacked [L, d] `weights`, each layer by its own row, of `states` [L, ...] (or,
    `shared`, of one [...] for every layer)."""
    normed = torch.stack([torch.empty_like(states) for _ in weights]) if shared else torch.empty_like(states)
    for i, weight in enumerate(weights):
        ops.rms_norm(normed[i], (states if shared else states[i]).contiguous(), weight.contiguous(), eps)
    return normed


def block_outputs(model, given: dict, windowed: bool = False):
    """The model's outputs for the block `given["block"]` at `given["positions"]` after the context of the tapped
    states `given["aux"]` at `given["context_positions"]`, its token table `given["table"]` (what vLLM's loader
    shares from the target), its context keys normed layer by layer; `windowed`: the layers' windows and causal flags
    applied. Returns the outputs and how many layers' context keys/values were captured."""
    inner = model.model
    inner.embed_tokens.weight.data.copy_(given["table"])
    captured = []
    for layer in inner._attn_layers:
        layer.impl.do_kv_cache_update = lambda attn, k, v, cache, slots: captured.append((k.clone(), v.clone()))
    inner._normalize_context_k = lambda all_k: per_layer_rms(inner._k_norm_weights, all_k, inner._rms_norm_eps)
    context = model.combine_hidden_states(given["aux"])
    with torch.no_grad():
        inner.precompute_and_store_context_kv(context, given["context_positions"], given["context_positions"])
        positions = (given["context_positions"], given["positions"]) if windowed else ()
        for layer, (keys, values) in zip(inner.layers, captured):
            layer.self_attn.attn = ContextThenBlock(layer.self_attn, keys, values, *positions)
        outputs = inner(given["block"], given["positions"])
    return outputs, len(captured)
