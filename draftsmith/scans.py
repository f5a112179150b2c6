"""The chunk of transformers' PyTorch Mamba-2 scan in the multi-token forwards of decoding: the eval loop's target,
and a draft model built from a Mamba-2 target's layers.

Mamba-2 mixers (hybrid targets with Mamba-2 layers) scan a forward of several tokens in chunks of the config's
`chunk_size` (128 or 256 in releases), padding the forward up to a whole chunk and working on [chunk x chunk] blocks
per head; one token takes the recurrent step and no chunk. mamba_ssm's CUDA kernels are tuned to that chunk, but the
PyTorch code that runs without them (on a CPU, or a GPU without mamba_ssm) makes a verify forward of 4 tokens cost
what one of 256 does: about 50 one-token steps on a CPU, which would make every speculative method look slower than
it is served. The scan is exact for any chunk (only the rounding of its sums moves, about 1e-6 in a tiny target's
logits), so these forwards take chunks no wider than SCAN_CHUNK there; the prefill every method shares alike."""

from __future__ import annotations

import importlib.util
import weakref
from contextlib import contextmanager

import torch

SCAN_CHUNK = 32  # the widest chunk a PyTorch Mamba-2 scan takes in decoding's forwards
_MIXERS: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = weakref.WeakKeyDictionary()


def reference_scan_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Mamba-2 mixers of `model` (a module holding `A_log`, `dt_bias` and an int `chunk_size`) that scan in
    PyTorch: all of them, unless the model is on CUDA where mamba_ssm is installed (its kernels run instead)."""
    if model not in _MIXERS:
        device = model.get_output_embeddings().weight.device
        kernels = device.type == "cuda" and importlib.util.find_spec("mamba_ssm") is not None
        _MIXERS[model] = (
            []
            if kernels
            else [
                module
                for module in model.modules()
                if isinstance(getattr(module, "chunk_size", None), int)
                and hasattr(module, "A_log")
                and hasattr(module, "dt_bias")
            ]
        )
    return _MIXERS[model]


@contextmanager
def scan_chunks(model: torch.nn.Module, tokens: int):
    """Within: a forward of `tokens` tokens scans in chunks of min(tokens, SCAN_CHUNK) in every PyTorch Mamba-2
    mixer whose own chunk is wider; their chunks are put back after, also when the forward raises."""
    chunk = min(tokens, SCAN_CHUNK)
    narrowed = [(mixer, mixer.chunk_size) for mixer in reference_scan_mixers(model) if mixer.chunk_size > chunk > 1]
    for mixer, _ in narrowed:
        mixer.chunk_size = chunk
    try:
        yield
    finally:
        for mixer, size in narrowed:
            mixer.chunk_size = size
