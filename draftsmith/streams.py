"""The residual streams of a target with hyper-connections (DeepSeek-V4's `hc_mult`): its decoder layers pass S
streams a position, [B, T, S, H], and the decoder's `hc_head` collapses the last layer's into one state before the
final norm (Qwen4-Exp's `hc_count` streams lie side by side, [B, T, S*H], and its `hyper_connection_mixer` collapses
them). transformers' outputs hold only that collapse (`hidden_states[-1]`), so a drafter that reads the streams
themselves (an MTP layer, as vLLM hands it `previous_hidden_states`) gets them as they enter the collapse, [B, T, S, H].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

from draftsmith.errors import UserError


@contextlib.contextmanager
def last_layer_streams(model, wanted: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Within it, a forward of `model` leaves the streams entering its decoder's collapse as `captured["streams"]`,
    [B, T, S, H] (nothing where not `wanted`); a target with one state a position has none to give: one line."""
    captured: dict[str, torch.Tensor] = {}
    if not wanted:
        yield captured
        return
    collapse = stream_collapse(model)
    if collapse is None:
        raise UserError(
            f"the drafter reads the residual streams of a target with hyper-connections; {type(model).__name__} "
            "passes one hidden state a position"
        )
    width = model.config.get_text_config().hidden_size

    def keep(_, args) -> None:
        streams = args[0]
        captured["streams"] = streams.unflatten(-1, (-1, width)) if streams.shape[-1] != width else streams

    hook = collapse.register_forward_pre_hook(keep)
    try:
        yield captured
    finally:
        hook.remove()


def stream_collapse(model) -> Optional[torch.nn.Module]:
    """The module of `model`'s decoder that collapses its last layer's streams into the final norm's input; None for a
    target passing one state a position."""
    decoder = model.get_decoder()
    return getattr(decoder, "hc_head", None) or getattr(decoder, "hyper_connection_mixer", None)


def not_captured(kind: str, setting: str) -> UserError:
    """The refusal of `setting` (data.features, or the capture command) for a drafter that reads the streams: a
    capture holds one state a position (data_prep/features.py), never a layer's streams."""
    return UserError(
        f"{setting}: drafter.type={kind} reads the target's last layer's residual streams, which a feature capture "
        "does not hold: train it on the target's forward (data.features=null)"
    )
