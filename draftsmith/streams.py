"""The residual streams of a target with hyper-connections (DeepSeek-V4's `hc_mult`): its decoder layers pass S
streams a position, [B, T, S, H], and the decoder's `hc_head` collapses the last layer's into one state before the
final norm. transformers' outputs hold only that collapse (`hidden_states[-1]`, normed), so a drafter that reads the
streams themselves (V4's own MTP layer, as vLLM hands it `previous_hidden_states`) gets them as they enter `hc_head`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from draftsmith.errors import UserError


@contextlib.contextmanager
def last_layer_streams(model, wanted: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Within it, a forward of `model` leaves the streams entering its decoder's `hc_head` as `captured["streams"]`
    (nothing where not `wanted`); a target with one state a position has none to give: one line."""
    captured: dict[str, torch.Tensor] = {}
    if not wanted:
        yield captured
        return
    collapse = getattr(model.get_decoder(), "hc_head", None)
    if collapse is None:
        raise UserError(
            f"the drafter reads the residual streams of a target with hyper-connections; {type(model).__name__} "
            "passes one hidden state a position"
        )
    hook = collapse.register_forward_pre_hook(lambda _, args: captured.update(streams=args[0]))
    try:
        yield captured
    finally:
        hook.remove()


def not_captured(kind: str, setting: str) -> UserError:
    """The refusal of `setting` (data.features, or the capture command) for a drafter that reads the streams: a
    capture holds one state a position (data_prep/features.py), never a layer's streams."""
    return UserError(
        f"{setting}: drafter.type={kind} reads the target's last layer's residual streams, which a feature capture "
        "does not hold: train it on the target's forward (data.features=null)"
    )
