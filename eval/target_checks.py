"""What draftsmith's eval loop needs of a target, checked before it decodes (and by a training run before it trains,
where the run's eval stage will decode): a cache it can roll back, and, where the loop gives the target explicit masks
and positions (a tree's nodes, a batch's padded rows), a target that computes by them."""

from __future__ import annotations

import logging
import weakref

import torch
from transformers.cache_utils import DummyLayer

from draftsmith.caches import RecordedStates, cut_keys, new_cache, recordable_layers
from draftsmith.errors import UserError, one_line, out_of_memory
from draftsmith.eval.trees import attention_masks
from draftsmith.families import LINEAR, ROLLED_BACK, layer_types, reads_in_order
from draftsmith.scans import scan_chunks
from draftsmith.target import FeatureRequest, run_target

log = logging.getLogger("draftsmith.eval")

# models proven to compute by explicit masks and positions (check_explicit_masks), each with the longest context proven
_PROVEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# whether a model's transformers code keeps its linear-attention states at every position (keeps_each_position)
_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# models whose logits on a probe were finite (check_finite_logits)
_FINITE: weakref.WeakSet = weakref.WeakSet()
# whether a model's forward returns the cache it is given (returns_cache)
_RETURNS_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_target(model, tree: bool = False, batch: bool = False, length: int = 4) -> None:
    """Tree verification (`tree`) needs a backend that takes a custom 4D mask; rolling a rejected draft back
    needs layers whose keys can be cut and gathered (full or sliding-window attention: a sliding-window
    layer keeps every key in the loop's cache, and its mask hides those out of the window) or whose
    state can be kept and put back (linear and compressed attention, for chains: they read tokens in order). A tree,
    or a batch of rows (`batch`), is verified under explicit masks and positions (`check_explicit_masks`, at the
    longest context the run decodes, `length`)."""
    check_finite_logits(model)
    implementation = getattr(model.config, "_attn_implementation", "eager")
    if implementation not in ("eager", "sdpa"):
        raise UserError(
            "the eval loop needs attn_implementation 'sdpa' or 'eager' (custom tree masks); the target uses "
            f"{implementation!r}"
        )
    own_cache = getattr(model, "_supports_default_dynamic_cache", None)  # what transformers' generate asks
    if own_cache is not None and not own_cache():
        raise UserError(
            f"the eval loop holds the target's keys and states in transformers' DynamicCache, which "
            f"{type(model).__name__} does not take (it keeps a cache of its own)"
        )
    # a layer whose cache layer holds nothing (experts or an MLP as a layer of its own) has nothing to roll back
    cached = zip(layer_types(model.config), new_cache(model).layers)
    kinds = {kind for kind, layer in cached if not isinstance(layer, DummyLayer)}
    if kinds == {LINEAR}:
        raise UserError(
            "this target's layers are all linear attention: transformers' cache counts the positions it holds on "
            "attention layers, which the eval loop reads"
        )
    other = sorted(kinds - set(ROLLED_BACK))
    if other:
        raise UserError(
            "the eval loop verifies drafts on attention, linear-attention, convolution and compressed-attention layers "
            f"only (whose keys or states it can roll back); this target also has {other} layers"
        )
    if not returns_cache(model):
        raise UserError(
            f"{type(model).__name__}'s forward returns no cache (it keeps its recurrent state in its own modules): "
            "the eval loop, which rolls a rejected draft back in the cache, cannot verify drafts on it"
        )
    if tree and reads_in_order(model.config):
        raise UserError(
            "a target with linear-, compressed-, block-sparse or convolved attention layers verifies chains only (they "
            "read a draft's tokens in order, so a tree's branches would see each other): set eval.tree=0"
        )
    if (tree or batch) and not reads_in_order(model.config):  # such a target decodes chains, its rows one at a time
        check_explicit_masks(model, length)


@torch.no_grad()
def check_finite_logits(model) -> None:
    """A target whose logits are not finite (NaN or inf in its weights: a damaged file) is refused, proven once per
    model on a few tokens: the loop would decode its argmax of NaN as lossless, and the checks below would fail on
    their own arithmetic."""
    if model in _FINITE:
        return
    ids = probe_ids(model)
    try:
        with scan_chunks(model, ids.shape[1]):  # as the loop's forwards scan
            finite = run_target(model, ids).logits.isfinite().all()
    except Exception as err:  # noqa: BLE001 - bad input only where transformers' own forward fails too
        require_own_forward(model, ids, err)
        raise
    if not finite:
        raise UserError(
            f"the target ({type(model).__name__}) computes non-finite logits (NaN or inf) on a 4-token probe: its "
            "weights hold non-finite values (a damaged file), or its dtype cannot hold what it computes"
        )
    _FINITE.add(model)


def returns_cache(model) -> bool:
    """Whether the model's forward returns the cache it is given, proven once per model on a few tokens: RecurrentGemma
    keeps its states in its own modules and returns none."""
    if model not in _RETURNS_CACHE:
        ids = probe_ids(model)
        with scan_chunks(model, ids.shape[1]):
            _RETURNS_CACHE[model] = run_target(model, ids, cache=new_cache(model), use_cache=True).cache is not None
    return _RETURNS_CACHE[model]


def probe_ids(model) -> torch.Tensor:
    """[1, 4] tokens the checks' probes run: 1..4, within the vocabulary, on the model's device."""
    device = model.get_output_embeddings().weight.device
    return torch.arange(1, 5, device=device)[None] % (model.config.get_text_config().vocab_size - 1) + 1


def require_own_forward(model, ids: torch.Tensor, err: Exception) -> None:
    """A probe's forward that failed with `err` is the target's config where transformers' own forward of the model,
    on the same tokens and outside draftsmith's settings, fails as well (attention heads that its key-value heads do
    not divide: a hand-made config): one line. Else, and for a model of draftsmith's classes (a wrapper's language
    model) or memory exhausted, the failure is raised by the caller as it was."""
    if out_of_memory(err) or not type(model).__module__.startswith("transformers."):
        return
    try:
        model(input_ids=ids)
    except Exception as own:  # noqa: BLE001 - whatever transformers' own model raises is the model's
        if out_of_memory(own):
            return
        raise UserError(
            f"the target ({type(model).__name__}) fails transformers' own forward on a 4-token probe "
            f"({one_line(own, with_type=True)}): its config.json describes a model transformers cannot run"
        ) from None


@torch.no_grad()
def check_explicit_masks(model, length: int = 4) -> None:
    """Prove, once per model and context, that the target computes a token by the mask and position the eval loop
    gives it, not by its index among the keys: after a prefix of `length` - 2 tokens (the longest context the run
    decodes), two sibling nodes at one position, the second behind the first in the verify forward but not seeing it,
    must give the second the logits it gets alone. A target biasing attention by key index (ALiBi: MPT, Bloom) would
    verify a tree's later branches, and a left-padded row, against other logits (measured: MPT's tree parted from plain
    decoding; Bloom's forward takes no 4D mask); one whose sparse attention picks keys by their index (its newest, its
    blocks) once a query sees more than a budget does so past that budget only (Kolibri-1.1's indexer: its trees
    parted from plain decoding on a 70-token prompt with a pool of 32 keys)."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    length = min(length, int(context or length))  # the eval keeps a longer prompt's last tokens only
    if _PROVEN.get(model, 0) >= length:
        return
    device = model.get_output_embeddings().weight.device
    prefix = max(length - 2, 2)
    ids = torch.arange(prefix + 2, device=device)[None] % (model.config.get_text_config().vocab_size - 1) + 1
    positions = torch.arange(prefix + 2, device=device)[None].clamp(max=prefix)  # the siblings both at `prefix`
    sees = torch.ones(1, 2, prefix + 2, dtype=torch.bool, device=device)
    sees[0, 0, prefix + 1] = sees[0, 1, prefix] = False  # each sibling sees the prefix and itself
    cache = new_cache(model)
    try:
        run_target(model, ids[:, :prefix], None, FeatureRequest(), positions[:, :prefix], cache, use_cache=True)
        mask = attention_masks(model, sees, positions[:, prefix:], positions)
        tree = run_target(model, ids[:, prefix:], mask, FeatureRequest(), positions[:, prefix:], cache, use_cache=True)
        cut_keys(cache, prefix)
        path = run_target(model, ids[:, -1:], None, FeatureRequest(), positions[:, -1:], cache, use_cache=True)
        theirs, ours = tree.logits[0, 1].float(), path.logits[0, 0].float()
    except Exception as err:  # the model's own code refusing the mask
        differs = f"its forward refuses them ({one_line(err, with_type=True)})"
    else:
        # the two forwards' kernels sum in other orders; a position or bias of its own moves logits far more
        if equal_but_rounding(model, theirs, ours):
            _PROVEN[model] = length
            return
        gap = (theirs - ours).abs().max().item()
        differs = (
            f"after {prefix} tokens, a tree's second sibling differs from its logits alone by {gap:.3g}: attention "
            "by key index"
        )
    raise UserError(
        f"eval.tree / eval.batch_size: {type(model).__name__} does not compute a token by the explicit mask and "
        f"position the eval loop gives a tree's nodes and a batch's padded rows ({differs}): set eval.tree=0 "
        "eval.batch_size=1 eval.batch_sizes=[]"
    )


@torch.no_grad()
def keeps_each_position(model) -> bool:
    """Whether the target's transformers code keeps its linear-attention states at every position of a forward when
    the cache asks it to (`RecordedStates`), proven once per model: after a token, a forward of three more recording
    their positions, cut back by one, must give the last token fed again alone the logits the forward gave it (code
    keeping the last state alone would put back the state before the forward). Where it does not, or where
    transformers cannot cut the cache's layers (`recordable_layers`), the loop puts the states back from a copy and
    feeds the accepted tokens again."""
    if model not in _RECORDS:
        cache = new_cache(model)
        layers = recordable_layers(cache)
        _RECORDS[model] = bool(layers) and _records_each_position(model, cache, layers)
        if layers:  # which of the two the eval's speeds come from
            log.info(
                "the target's linear-attention states: %s",
                f"{STATES_KEPT}, as engines keep them"
                if _RECORDS[model]
                else f"{STATES_FED_AGAIN} (its transformers code does not keep them per position)",
            )
    return _RECORDS[model]


# What the loop does after a rejected draft on a target whose layers read tokens in order (`rollback`)
STATES_KEPT = "kept at each verify position"
STATES_FED_AGAIN = "put back from a copy after a rejected draft, the accepted tokens fed again"


def rollback(model) -> str | None:
    """How the eval loop undoes a rejected draft in the layers that read tokens in order (`rollback` in report.json's
    target section: which of the two the speeds come from): STATES_KEPT or STATES_FED_AGAIN; None where keys alone are
    cut."""
    if not reads_in_order(model.config):
        return None
    return STATES_KEPT if keeps_each_position(model) else STATES_FED_AGAIN


def _records_each_position(model, cache, layers: list) -> bool:
    device = model.get_output_embeddings().weight.device
    ids = torch.arange(1, 5, device=device)[None] % (model.config.get_text_config().vocab_size - 1) + 1
    positions = torch.arange(4, device=device)[None]
    run_target(model, ids[:, :1], None, FeatureRequest(), positions[:, :1], cache, use_cache=True)
    recorded = RecordedStates(layers, 3)
    with scan_chunks(model, 3):  # as the loop's forwards scan
        three = run_target(model, ids[:, 1:], None, FeatureRequest(), positions[:, 1:], cache, use_cache=True)
    try:
        recorded.put_back(1)
    except (IndexError, TypeError, RuntimeError):  # the layers' code kept fewer states than it was asked to
        return False
    cut_keys(cache, 3)
    alone = run_target(model, ids[:, 3:], None, FeatureRequest(), positions[:, 3:], cache, use_cache=True)
    theirs, ours = three.logits[0, 2].float(), alone.logits[0, 0].float()
    return equal_but_rounding(model, theirs, ours)  # a forward of 3 and one of 1 sum in other orders


def equal_but_rounding(model, theirs: torch.Tensor, ours: torch.Tensor) -> bool:
    """Whether two logit rows the model computed in forwards of other shapes differ by no more than its format's
    rounding (relative to the largest logit)."""
    rounding = 1e-4 if model.dtype == torch.float32 else 0.016
    return torch.allclose(theirs, ours, rtol=rounding, atol=rounding * ours.abs().max().item())
