"""The free baselines' speculative configs, as vLLM serves them: its n-gram proposer (prompt lookup) and suffix
decoding (arctic-inference's). Neither trains nor runs a draft forward; the sweep, the standard protocol and the
load benchmarks time them beside a trained drafter with the same sampling settings (VLLM_PINNED)."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from draftsmith.engines import NGRAM, PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN, SUFFIX, SuffixSettings
from draftsmith.formats.repo import VLLM_PINNED


def ngram_config(gamma: int) -> dict[str, Any]:
    """vLLM's n-gram proposer (prompt lookup of 2 to 4 tokens) at γ, with the pinned sampling settings."""
    return {
        "method": NGRAM,
        "prompt_lookup_min": PROMPT_LOOKUP_MIN,
        "prompt_lookup_max": PROMPT_LOOKUP_MAX,
        **VLLM_PINNED,
        "num_speculative_tokens": gamma,
    }


def suffix_config(cached_answers: int = SuffixSettings.max_cached_requests) -> dict[str, Any]:
    """vLLM's suffix decoding (arXiv 2411.04975: suffix trees over the prompt and the engine's earlier answers,
    arctic-inference's) at vLLM 0.32's own defaults (SuffixSettings), written out so a row records them, with the last
    `cached_answers` answers kept (0: the prompt's tree only). Its length per step is its own, so no γ to sweep."""
    settings = replace(SuffixSettings(), max_cached_requests=cached_answers)
    return {
        "method": SUFFIX,
        "num_speculative_tokens": settings.max_tree_depth,
        **{f"suffix_decoding_{key}": value for key, value in asdict(settings).items()},
        **VLLM_PINNED,
    }
