"""The training losses keep fixed shapes: nothing in a loss or its backward reads a tensor's values on the
host (`.item()`, `int(...)`) or makes a shape from them (boolean-mask indexing, `nonzero`), each of which is a
device->host sync on an accelerator, once a micro-batch. Proved on the meta device, where every such operation
raises: the loss and its backward run there on shapes alone. What a shape needs of the data is counted on the
host with the batch (heads/base.py `host_fields`: DFlash's blocks per row); a DFlash batch without it is refused.
(EAGLE-3's fixed-shape loss is proved on CUDA in tests/test_gpu.py. Medusa-2 and the draft model run a
transformers model inside their loss, whose mask creation reads values, so they are not run here; what follows
that forward, the chunked loss over its logits (heads/vocab_loss.py rows_loss), is run on the meta device below.)

And the fixed-shape Medusa loss, which weighs every position instead of selecting the supervised ones and runs
the fused vocabulary loss (heads/vocab_loss.py) on one-hot teachers, equals the selecting one it replaced."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from draftsmith.data_prep.collate import Collator, PackingCollator
from draftsmith.heads.distill import forward_kl
from draftsmith.heads.packing import causal_lm_inputs, documents, num_documents, same_document
from draftsmith.heads.vocab_loss import at_rows, rows_loss
from draftsmith.target import TargetOutput, run_target
from tests.test_split_invariance import conversations, fresh

pytestmark = pytest.mark.usefixtures("one_thread")


def on_meta(value):
    return value.to("meta") if torch.is_tensor(value) else value


@pytest.mark.parametrize("kind", ["eagle", "medusa", "dflash", "dflash_soft"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_loss_and_backward_run_on_shapes_alone(kind, packed, monkeypatch):
    autocast = torch.autocast  # which has no meta device: the fused loss turns it off around a float32 product
    monkeypatch.setattr(
        torch, "autocast", lambda device, **kw: contextlib.nullcontext() if device == "meta" else autocast(device, **kw)
    )
    # EAGLE's feature noise, DFlash's anchors: a generator per conversation seeded on the host (heads/packing.py
    # conversation_rand), which reads no value; the meta device has no generator, so its draws are made there
    # without one
    for module in ("eagle", "dflash"):
        monkeypatch.setattr(
            f"draftsmith.heads.{module}.conversation_rand",
            lambda batch, tail, device, step: torch.rand((*batch["input_ids"].shape, *tail), device=device),
        )
    target, drafter, _ = fresh(kind.removesuffix("_soft"))
    if kind == "dflash_soft":  # the soft cross-entropy reads the target's logits
        drafter = reconfigured(drafter, target, loss="soft_ce", loss_weighting="decay")
    batch = (PackingCollator(0, 96) if packed else Collator(0))(conversations())
    batch |= drafter.host_fields(batch)  # on the host, as the trainer adds them (trainer/loop.py next_step)
    with torch.no_grad():
        out = run_target(target, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
    fake_out = TargetOutput(
        logits=on_meta(out.logits) if drafter.request.logits else None,
        final=on_meta(out.final),
        layers={layer: on_meta(h) for layer, h in out.layers.items()},
    )
    target.to("meta")  # what a drafter reads of it (EAGLE's embedding and lm_head, Medusa-2's frozen weights)
    drafter.to("meta")
    loss, count, stats = drafter({key: on_meta(value) for key, value in batch.items()}, fake_out)
    loss.backward()
    assert loss.device.type == "meta" and loss.shape == () and stats
    assert any(p.grad is not None and p.grad.device.type == "meta" for p in drafter.parameters())


def reconfigured(drafter, target, **settings):
    """The same drafter's weights under other loss settings."""
    other = type(drafter)(replace(drafter.config, **settings), drafter.target)
    other.load_state_dict(drafter.state_dict())
    other.attach_target(target)
    return other.train()


def test_a_dflash_batch_without_its_host_count_is_refused():
    target, drafter, _ = fresh("dflash")
    batch = Collator(0)(conversations())
    with torch.no_grad():
        out = run_target(target, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
    with pytest.raises(KeyError, match=r"dflash_row_blocks.*drafter.host_fields\(batch\)"):
        drafter(batch, out)


def test_the_chunked_loss_over_a_models_logits_runs_on_shapes_alone():
    """The draft model's and Medusa-2's divergences, chunk by chunk over logits a model produced."""
    logits = torch.empty(2, 9, 50, device="meta", requires_grad=True)
    teacher = torch.empty(2, 8, 50, device="meta")

    def per_row(rows, index, stats):
        kl = forward_kl(rows.float(), at_rows(teacher, index).float())
        return kl, {"kl": kl} if stats else {}

    loss, values = rows_loss(logits[:, :-1], torch.empty(2, 8, dtype=torch.bool, device="meta"), per_row, 3)
    loss.backward()
    assert loss.shape == () and values["kl"].shape == (2, 8) and logits.grad.device.type == "meta"


def selecting_medusa_loss(drafter, batch, hidden):
    """Medusa's loss as it was: only the supervised positions reach each head's vocabulary projection."""
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
    docs, total, stats = documents(batch), 0.0, {}
    for k, weight in enumerate(drafter.loss_weights()):
        shift = k + 2
        mask = loss_mask[:, shift:] & same_document(docs, shift)
        logits = drafter.head_logits(k, hidden[:, :-shift][mask]).float()
        labels = input_ids[:, shift:][mask]
        token_loss = F.cross_entropy(logits, labels, reduction="none")
        total = total + weight * token_loss.sum()
        top5 = logits.topk(5, dim=-1).indices.detach()
        for name, value in (
            ("loss", token_loss),
            ("top1", top5[:, 0] == labels),
            ("top5", (top5 == labels[:, None]).any(-1)),
        ):
            per_doc = torch.zeros(num_documents(batch)).index_add_(0, docs[:, :-shift][mask], value.detach().float())
            stats[f"head{k + 1}/{name}"] = per_doc
    return total, stats


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("chunk_rows", [7, 100_000], ids=["chunked", "one-chunk"])
def test_fixed_shape_medusa_loss_equals_the_selecting_one(packed, chunk_rows):
    target, drafter, _ = fresh("medusa")
    drafter.loss_chunk_bytes = 4 * target.config.vocab_size * chunk_rows
    batch = (PackingCollator(0, 96) if packed else Collator(0))(conversations())
    with torch.no_grad():
        hidden = run_target(target, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch)).final
    results = []
    for compute in (drafter.heads_loss, lambda b, h: selecting_medusa_loss(drafter, b, h)):
        drafter.zero_grad(set_to_none=True)
        loss, stats = compute(batch, hidden)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
        results.append((loss.detach(), stats, grads))
    (loss, stats, grads), (expected_loss, expected_stats, expected_grads) = results
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    for name, values in expected_stats.items():
        torch.testing.assert_close(stats[name][:, 0], values, rtol=1e-6, atol=1e-6, msg=name)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        # relative to the norm: an element summed from many cancelling token terms rounds differently
        assert (grads[name] - grad).norm() <= 1e-5 * grad.norm(), name
