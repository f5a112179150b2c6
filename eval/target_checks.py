"""What draftsmith's eval loop needs of a target, checked before it decodes (and by a training run before it trains,
where the run's eval stage will decode): a cache it can roll back, and, where the loop gives the target explicit masks
and positions (a tree's nodes, a batch's padded rows), a target that computes by them."""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import DummyLayer

from draftsmith.caches import new_cache
from draftsmith.errors import UserError, one_line
from draftsmith.eval.trees import attention_masks
from draftsmith.families import LINEAR, ROLLED_BACK, layer_types, reads_in_order
from draftsmith.target import FeatureRequest, run_target

# models proven to compute by explicit masks and positions (check_explicit_masks), each proven once
_FOLLOWS_MASKS: weakref.WeakSet = weakref.WeakSet()


def check_target(model, tree: bool = False, batch: bool = False) -> None:
    """Tree verification (`tree`) needs a backend that takes a custom 4D mask; rolling a rejected draft back
    needs layers whose keys can be cut and gathered (full or sliding-window attention: a sliding-window
    layer keeps every key in the loop's cache, and its mask hides those out of the window) or whose
    state can be kept and put back (linear and compressed attention, for chains: they read tokens in order). A tree,
    or a batch of rows (`batch`), is verified under explicit masks and positions (`check_explicit_masks`)."""
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
    if tree and reads_in_order(model.config):
        raise UserError(
            "a target with linear-, compressed-, block-sparse or convolved attention layers verifies chains only (they "
            "read a draft's tokens in order, so a tree's branches would see each other): set eval.tree=0"
        )
    if (tree or batch) and not reads_in_order(model.config):  # such a target decodes chains, its rows one at a time
        check_explicit_masks(model)


@torch.no_grad()
def check_explicit_masks(model) -> None:
    """Prove, once per model, that the target computes a token by the mask and position the eval loop gives it, not
    by its index among the keys: of two sibling nodes at one position, the second, behind the first in the forward but
    not seeing it, must get the logits it gets alone. A target biasing attention by key index (ALiBi: MPT, Bloom)
    would verify a tree's later branches, and a left-padded row, against other logits (measured: MPT's tree parted
    from plain decoding; Bloom's forward takes no 4D mask)."""
    if model in _FOLLOWS_MASKS:
        return
    device = model.get_output_embeddings().weight.device
    ids = torch.arange(4, device=device)[None] % model.config.get_text_config().vocab_size + 1
    positions = torch.tensor([[0, 1, 2, 2]], device=device)
    sees = torch.tril(torch.ones(1, 4, 4, dtype=torch.bool, device=device))
    sees[0, 3, 2] = False  # the second sibling sees the prompt, not the first
    alone = [0, 1, 3]
    try:
        tree = run_target(model, ids, attention_masks(model, sees, positions, positions), FeatureRequest(), positions)
        path = run_target(model, ids[:, alone], None, FeatureRequest(), positions[:, alone])
        theirs, ours = tree.logits[0, 3].float(), path.logits[0, 2].float()
    except Exception as err:  # the model's own code refusing the mask
        differs = f"its forward refuses them ({one_line(err, with_type=True)})"
    else:
        # the two forwards' kernels sum in other orders; a position or bias of its own moves logits far more
        rounding = 1e-4 if model.dtype == torch.float32 else 0.016
        if torch.allclose(theirs, ours, rtol=rounding, atol=rounding * ours.abs().max().item()):
            _FOLLOWS_MASKS.add(model)
            return
        gap = (theirs - ours).abs().max().item()
        differs = f"a tree's second sibling differs from its logits alone by {gap:.3g}: attention biased by key index"
    raise UserError(
        f"eval.tree / eval.batch_size: {type(model).__name__} does not compute a token by the explicit mask and "
        f"position the eval loop gives a tree's nodes and a batch's padded rows ({differs}): set eval.tree=0 "
        "eval.batch_size=1 eval.batch_sizes=[]"
    )
