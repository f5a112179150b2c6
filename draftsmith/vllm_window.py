"""The sliding window vLLM serves a model's sliding-window layers with, where transformers' class would attend another.

draftsmith computes a target (and a draft model) as the engine serves it: a drafter trained and measured against
another window than the served one is accepted less in production, silently. Two ways the counts part:

- the release states vLLM's count in a field of its own (SERVED_WINDOW_FIELD) and transformers' class derives another
  from it (MiMo-V2's one more);
- vLLM's model class attends one key more than `sliding_window` says (VLLM_ONE_MORE_KEY), while transformers' class
  attends `sliding_window` keys, the query's own included.

Only the in-memory config changes: a release's config.json stays as written, and a config.json draftsmith writes for
an engine states the window as the release would (`as_released`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from draftsmith.families import SLIDING, config_field, layer_types, text_config

# The release field stating how many keys (the query's own included) vLLM's sliding-window layers attend. A
# transformers class reading it as its `sliding_window` agrees (Inkling's, Dots3-Note's); one deriving another count
# from it (MiMo-V2's one more, after SGLang's reference, its comment says) runs another target than vLLM serves.
SERVED_WINDOW_FIELD = "sliding_window_size"
# the model types (a wrapper's language model's included) whose vLLM 0.32 model class serves a sliding-window layer
# `sliding_window + 1` keys, [pos - sliding_window, pos], "to match the training convention" (commandr.py,
# cohere2_moe.py), where transformers' class attends `sliding_window`; tests/test_families_vllm.py keeps the table
# equal to vLLM's sources. SGLang's window for them is not read here.
VLLM_ONE_MORE_KEY = ("cohere2", "cohere2_moe")


def served_window(config: Any) -> Optional[int]:
    """The window vLLM's sliding-window layers attend where transformers' `sliding_window` says another: the
    release's SERVED_WINDOW_FIELD, else one more key for a VLLM_ONE_MORE_KEY model type; None where they agree or no
    layer slides."""
    text = text_config(config)
    stated, ours = config_field(text, SERVED_WINDOW_FIELD), config_field(text, "sliding_window")
    if not isinstance(ours, int) or SLIDING not in layer_types(text):
        return None
    if not isinstance(stated, int) and config_field(text, "model_type") in VLLM_ONE_MORE_KEY:
        stated = ours + 1
    return stated if isinstance(stated, int) and stated != ours else None


def serve_window(config: Any) -> Optional[int]:
    """Sets a config built by transformers' class to attend the window vLLM serves (`served_window`), in place: the
    target's as draftsmith loads it, and a draft model's each time its class builds its config from a dict. The count
    is stated in SERVED_WINDOW_FIELD too, so that a config built again from this one's dict (which transformers'
    class may derive its window from again) is served the same window, not widened twice. Returns that window, None
    where nothing changed."""
    window = served_window(config)
    if window is not None:
        text = text_config(config)
        text.sliding_window = window
        setattr(text, SERVED_WINDOW_FIELD, window)
    return window


def as_released(values: Mapping[str, Any]) -> dict[str, Any]:
    """A dict saved from a config `serve_window` set, as its release states it for vLLM, which widens a
    VLLM_ONE_MORE_KEY model type's `sliding_window` itself: that field one key fewer, and the SERVED_WINDOW_FIELD
    draftsmith stated dropped (no such release states it). Other dicts as they are."""
    stated = values.get(SERVED_WINDOW_FIELD)
    if values.get("model_type") not in VLLM_ONE_MORE_KEY or not isinstance(stated, int):
        return dict(values)
    released = {key: value for key, value in values.items() if key != SERVED_WINDOW_FIELD}
    return {**released, "sliding_window": stated - 1}
