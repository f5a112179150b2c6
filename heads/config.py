"""The recipe's side of every drafter kind, without torch: `DrafterConfig`, the base of each kind's Config
dataclass (the recipe's drafter section, in heads/<kind>_config.py), and the checks of settings several kinds
share. Composing a recipe, `--help` and a refused value read only these modules (heads/__init__.py's
`config_class`), so they answer before torch would have imported (seconds); the drafters, heads/<kind>.py,
import it.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from draftsmith.errors import UserError

if TYPE_CHECKING:
    from draftsmith.target import TargetShape


class DrafterConfig:
    """Base of every drafter's Config dataclass."""

    # Keys that set how it trains or decodes, not what its weights compute: a warm start may change
    # them (`architecture`); every other key must be the starting drafter's.
    SETTINGS: ClassVar[tuple[str, ...]] = ()
    # Of the SETTINGS, those that set only how it decodes and is served (the eval's trees, the engine's speculative
    # config), read when it does: eval, export and sweep take them from their command line over the checkpoint's,
    # so a trained drafter is measured and served another way without training again (formats/folder.py).
    SERVED: ClassVar[tuple[str, ...]] = ()
    # Keys from_target fills from the target (a layer's or a whole model's HF config, to rebuild it on
    # load): neither a setting nor a choice of the recipe's, and recorded in full by the checkpoint only.
    RESOLVED: ClassVar[tuple[str, ...]] = ("decoder",)
    # Keys naming released weights a fresh drafter starts from (a Hub id or folder): a warm start or a resume
    # starts from its own folder instead, so they fix nothing about the weights it loads.
    STARTS: ClassVar[tuple[str, ...]] = ()
    # The key counting the positions ahead a training step scores, the k-th the token k + 2 ahead (a training-time
    # test's steps, Medusa's heads): a row of data.max_length must hold them all (draftsmith/recipe.py)
    POSITIONS_AHEAD: ClassVar[Optional[str]] = None

    def check(self, target: Optional[TargetShape] = None) -> None:
        """Raise a one-line UserError for a bad setting. `target`: the target's shape when known."""

    def resolved(self, fields: dict[str, Any]) -> dict[str, Any]:
        """`fields` (this config's, by key) with a null that stands for a value this config knows once from_target
        filled it in replaced by that value: two drafters compare alike however their recipes said it
        (`architecture`)."""
        return fields

    def released_start(self) -> Optional[str]:
        """`drafter.KEY=VALUE` naming the released weights a fresh drafter of these settings starts from (a STARTS
        key's), or None: a drafter built from the target alone."""
        named = [key for key in self.STARTS if getattr(self, key, None) is not None]
        return f"drafter.{named[0]}={getattr(self, named[0])}" if named else None

    def check_read(self) -> None:
        """Raise a one-line UserError for a setting changed from its default that the config's other settings leave
        unread (`refuse_unread`). Checked where a recipe builds a drafter; a saved drafter's config is read as it was
        trained."""


def check_mask_token(mask_token_id: Optional[int], target: Optional[TargetShape], required_by: str = "") -> None:
    """A drafter's mask token (P-EAGLE's, PARD's, DFlash's): a token of the target's vocabulary, which
    the engine feeds at the masked positions; `required_by` names the setting that needs one."""
    if required_by and mask_token_id is None:
        raise UserError(
            f"{required_by} needs drafter.mask_token_id: the token the engine feeds at the masked positions "
            "(any token of the target's vocabulary)"
        )
    if target is not None and mask_token_id is not None and not 0 <= mask_token_id < target.vocab_size:
        raise UserError(
            f"drafter.mask_token_id={mask_token_id} is not a token of the target's {target.vocab_size}-token vocabulary"
        )


def refuse_unread(config: DrafterConfig, keys: tuple[str, ...], setting: str, read_at: object) -> None:
    """One-line UserError for a key of `keys` changed from its default when drafter.`setting` is not `read_at`, the
    value it is read at: the drafter would train and be served as if it were left out (a Config's `check_read`)."""
    actual = getattr(config, setting)
    if actual == read_at:
        return

    def shown(value: object) -> object:
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else value

    declared = {field.name: field for field in fields(config)}
    for key in keys:
        default = declared[key].default
        if getattr(config, key) != (declared[key].default_factory() if default is MISSING else default):
            raise UserError(
                f"drafter.{key}={shown(getattr(config, key))} is read only with drafter.{setting}={shown(read_at)}, "
                f"and this recipe's is {shown(actual)}: leave it at its default, or set drafter.{setting}="
                f"{shown(read_at)}"
            )


def check_tap_layers(layers: list[int], num_layers: int, key: str, default: Optional[str], advice: str) -> None:
    """One-line UserErrors for target layer ids (draftsmith's convention, draftsmith.target) that a
    drafter concatenates: none given, ids the target lacks, or not strictly increasing (the engines
    concatenate the captured states in layer order). `default` describes the rule that chose the ids
    when the recipe left `key` unset (None: the recipe set them); then the error advises setting
    `key` to `advice`, since a small target's default can be unusable."""
    if default is None:
        where, hint = f"{key}={layers}", ""
    else:
        where, hint = (
            f"{default} = {layers} for this {num_layers}-layer target",
            f"; set {key} to {advice} of your own, e.g. [0, 1, 2]",
        )
    if not layers:
        raise UserError(f"{key} is empty: name at least one target layer")
    bad = [layer for layer in layers if not -1 <= layer < num_layers]
    if bad:
        raise UserError(
            f"{where}: layer id(s) {bad} out of range for a target with {num_layers} layers (valid: "
            f"-1..{num_layers - 1}; {num_layers - 1}, the normed last state, trains but is refused at export: vLLM "
            "cannot capture it as a tap){hint}"
        )
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise UserError(f"{where}: ids must be distinct and increasing (engines concatenate the layers in order){hint}")


def check_tree_settings(config) -> None:
    """One-line errors for the dynamic tree's settings (heads/eagle_base.py's EagleProposer)."""
    if config.tree_depth < 1 or config.tree_topk < 1:
        raise UserError(f"drafter.tree_depth and tree_topk must be >= 1 (got {config.tree_depth}, {config.tree_topk})")


def check_steps_ahead(config) -> None:
    """One-line errors for the settings `steps_ahead_loss` (heads/vocab_loss.py) reads: `ttt_steps` and `ttt_decay`."""
    if config.ttt_steps < 1:
        raise UserError(f"drafter.ttt_steps must be >= 1 (got {config.ttt_steps})")
    if not 0 < config.ttt_decay <= 1:
        raise UserError(f"drafter.ttt_decay={config.ttt_decay} must be in (0, 1]")
