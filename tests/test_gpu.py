"""The GPU tier, `python -m pytest -m gpu`: what only a CUDA device exercises. Every test here is
skipped without one; where a GPU is lent, one device call runs the tier (docs/tests.md).

Ran 2026-11-27 on a lent H100 (torch 2.11.0+cu130, transformers 5.24.0, accelerate 1.15.0, DeepSpeed
0.19.8): all 12 pass, after two fixes only a GPU could show (docs/tests.md, "The GPU tier").

- every drafter kind trains two bf16 steps on CUDA (the target in bfloat16, mixed precision bf16);
- a drafter trained on CUDA decodes losslessly there (greedy speculative = plain greedy);
- the frozen target sharded with FSDP2 (`target.shard=fsdp`) and the drafter under DeepSpeed ZeRO-2 and
  ZeRO-3, each launched by `accelerate launch` with one process (DeepSpeed's saving its optimizer's float32 weights:
  checked since 2026-12-06, not yet run on a GPU);
- EAGLE-3's training step on CUDA (compiled flex attention, the fused vocabulary loss, its chunk math eager and
  compiled) equals the straightforward reference, and never waits for the host;
- nor do the fixed-shape losses of Medusa, EAGLE-1, DFlash, the draft model and Medusa-2
  (tests/test_no_host_sync.py proves them on the meta device, all but the transformers forward inside the last two);
- the target's decoder layers compiled (train.compile_target) give the eager features on real micro-batches;
- EAGLE-3's draft layer compiled (train.compile_drafter), flex attention inside, trains as the eager layer does;
- the loop's agreement of a step waits for the device once.
"""

from __future__ import annotations

import functools
import json
import math
import sys

import pytest
import torch

from draftsmith.heads import drafters
from tests.helpers import REPO, demo_recipe, read_log, run_entry, train_in_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def quick(kind: str, output_dir, small_data, token_cache, *extra: str) -> list[str]:
    return [
        f"recipe={demo_recipe(kind)}", f"data.train=[{small_data['train']}]", f"data.eval=[{small_data['eval']}]",
        f"data.cache_dir={token_cache}", "data.max_conversations=16", "data.max_length=128", "data.draft_vocab=null",
        "train.micro_batch_size=2", "train.warmup_steps=0", "train.log_every=1", "eval.max_prompts=1",
        "eval.max_new_tokens=16", f"output_dir={output_dir}", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("kind", sorted(drafters()))
def test_every_kind_trains_bf16_steps_on_cuda(kind, tmp_path, small_data, token_cache):
    args = quick(
        kind,
        tmp_path / "run",
        small_data,
        token_cache,
        "train.max_steps=2",
        "train.mixed_precision=bf16",
        "target.dtype=bfloat16",
    )
    final, target = train_in_process([*args, "eval.enabled=false"])
    assert next(target.parameters()).is_cuda and next(target.parameters()).dtype == torch.bfloat16
    assert all(not p.requires_grad for p in target.parameters())
    losses = [row["train/loss"] for row in read_log(tmp_path / "run").values() if "train/loss" in row]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert (final / "model.safetensors").is_file()


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "dflash"])
def test_a_drafter_trained_on_cuda_decodes_losslessly_there(kind, tmp_path, small_data, token_cache):
    args = quick(
        kind, tmp_path / "run", small_data, token_cache, "train.max_steps=20", "eval.device=cuda", "eval.enabled=true"
    )
    train_in_process(args)
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    rows = report["domains"]["all"]
    assert rows and all(row["lossless"] is True for row in rows.values()), {
        name: row["lossless"] for name, row in rows.items()
    }


@pytest.mark.parametrize(
    "config, extra",
    [
        ("fsdp_target.yaml", ["target.shard=fsdp"]),
        # the recipe's accumulation and clipping given to DeepSpeed (trainer/launcher.py): its config leaves them out
        ("deepspeed_zero2.yaml", ["train.grad_accum=2", "train.max_grad_norm=0.5"]),
        ("deepspeed_zero3.yaml", ["train.grad_accum=2", "train.max_grad_norm=0.5"]),
    ],
    ids=["fsdp2-target", "zero2", "zero3"],
)
def test_distributed_configs_train_with_one_rank(config, extra, tmp_path, small_data, token_cache):
    if config.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    args = quick("eagle3", tmp_path / "run", small_data, token_cache, "train.max_steps=3", "eval.enabled=false", *extra)
    launch = [
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "recipes" / "accelerate" / config),
        "--num_processes",
        "1",
    ]
    result = run_entry([*launch, "train.py", *args], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [row["train/loss"] for row in read_log(tmp_path / "run").values() if "train/loss" in row]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    if config.startswith("deepspeed"):  # bf16: the optimizer's float32 weights saved, not the module's copies
        from safetensors.torch import load_file

        saved = load_file(tmp_path / "run" / "final" / "model.safetensors")
        trained = [t for t in saved.values() if t.dtype == torch.float32 and not torch.equal(t, t.bfloat16().float())]
        assert trained, "bfloat16 values saved"


EAGLE3_VARIANTS = {
    "eagle3": {},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "sliding-window": {"sliding_window": 6},
    "p-eagle": {"fc_norm": True, "parallel_drafting": True, "mask_token_id": 2},
}


# (variant, packed, the loss's chunk math compiled: train.compile_vocab_loss) for every variant eager, two compiled
REFERENCE_CASES = [(variant, packed, False) for variant in sorted(EAGLE3_VARIANTS) for packed in (False, True)]
REFERENCE_CASES += [("eagle3", False, True), ("eagle3.1", True, True)]


@pytest.mark.parametrize(
    "variant, packed, compiled_loss",
    REFERENCE_CASES,
    ids=[f"{v}-{'packed' if p else 'padded'}{'-compiled-loss' if c else ''}" for v, p, c in REFERENCE_CASES],
)
def test_eagle3_loss_on_cuda_equals_the_straightforward_reference(variant, packed, compiled_loss):
    """On CUDA the training-time test runs through compiled flex attention (drafter.ttt_attention=auto) and
    the fused vocabulary loss (its chunk math compiled too where `compiled_loss`): the loss, statistics and
    gradients equal the straightforward computation (one KV cache, one mask, materialised logits;
    tests/test_eagle3.py) on the same device, float32."""
    from draftsmith.data_prep.collate import Collator, PackingCollator
    from draftsmith.heads import drafter_class
    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.heads.vocab_loss import compiled_chunk_math
    from draftsmith.target import run_target
    from tests.helpers import TINY_VOCAB, tiny_llama
    from tests.test_eagle3 import loss_rows, reference_loss

    model = tiny_llama(vocab=TINY_VOCAB, hidden=64, logit_scale=4.0).cuda()  # heads of 16: flex's least
    cls = drafter_class("eagle3")
    torch.manual_seed(0)
    config = cls.Config(aux_layers=[-1, 0, 1], draft_vocab_size=24, ttt_steps=4, **EAGLE3_VARIANTS[variant])
    drafter = cls.from_target(config, model, "tiny").cuda()
    rows = loss_rows()
    drafter.prepare(rows)
    drafter.loss_chunk_bytes = 4 * TINY_VOCAB * 7  # several chunks
    batch = (PackingCollator(0, 40) if packed else Collator(0))(rows)
    batch = {key: value.cuda() if torch.is_tensor(value) else value for key, value in batch.items()}
    with torch.no_grad():
        target_out = run_target(model, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
    results = []
    for compute in (lambda: drafter(batch, target_out), lambda: reference_loss(drafter, batch, target_out)):
        drafter.zero_grad()
        with compiled_chunk_math(compiled_loss):
            loss, count, stats = compute()
        (loss / count).backward()
        grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
        results.append((loss.detach(), stats, grads))
    (loss, stats, grads), (expected_loss, expected_stats, expected_grads) = results
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for name, values in expected_stats.items():
        torch.testing.assert_close(stats[name], values, rtol=1e-5, atol=1e-5, msg=name)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def on_cuda(batch: dict) -> dict:
    return {key: value.cuda() if torch.is_tensor(value) else value for key, value in batch.items()}


def train_steps_without_waiting_for_the_host(drafter, target, batch: dict) -> None:
    """Three training steps of `drafter` on `batch` (on CUDA), the last under torch.cuda.set_sync_debug_mode("error"):
    its loss, backward and fused AdamW step (all of the step but the target's forward) raise if anything in them
    synchronises with the host. The first two may: compiling flex attention, cuBLAS's start, first allocations."""
    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.target import run_target

    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3, fused=True)
    for step in range(3):
        with torch.no_grad():  # the target's forward is transformers' (its mask creation may read values)
            target_out = run_target(target, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
        if step == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss, count, _ = drafter(batch, target_out)
            (loss / count).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("compiled_loss", [False, True], ids=["eager-loss", "compiled-loss"])
def test_eagle3_step_never_waits_for_the_host(compiled_loss):
    """EAGLE-3's step: compiled flex attention, the fused vocabulary loss over the draft vocabulary (its chunk
    math compiled too where `compiled_loss`: train.compile_vocab_loss)."""
    from draftsmith.data_prep.collate import Collator
    from draftsmith.heads import drafter_class
    from draftsmith.heads.vocab_loss import compiled_chunk_math
    from tests.helpers import TINY_VOCAB, tiny_llama
    from tests.test_eagle3 import loss_rows

    model = tiny_llama(vocab=TINY_VOCAB, hidden=64, logit_scale=4.0).cuda()  # heads of 16: flex's least
    cls = drafter_class("eagle3")
    drafter = cls.from_target(cls.Config(aux_layers=[-1, 0, 1], draft_vocab_size=24, ttt_steps=4), model, "tiny")
    drafter = drafter.cuda()
    rows = loss_rows()
    drafter.prepare(rows)
    with compiled_chunk_math(compiled_loss):
        train_steps_without_waiting_for_the_host(drafter, model, on_cuda(Collator(0)(rows)))


def test_the_steps_agreement_waits_for_the_device_once():
    """trainer/loop.py `agree`, the loop's one host sync a step: its host counts reach the device without a wait of
    their own (a blocking copy from pageable memory waited for the stream before the all-reduce's read did)."""
    import warnings
    from types import SimpleNamespace

    from draftsmith.trainer.loop import agree

    accelerator = SimpleNamespace(device=torch.device("cuda"), num_processes=1)
    nonfinite = torch.ones((), dtype=torch.bool, device="cuda")
    agree(accelerator, nonfinite)  # the first: the pinned allocator's start
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            agreed = agree(accelerator, nonfinite, stop=True, upcoming=SimpleNamespace(loss_tokens=7, tokens=9))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert (agreed.nonfinite, agreed.stop, agreed.loss_tokens, agreed.tokens) == (True, True, 7, 9)
    waits = [str(warning.message) for warning in caught if "synchroniz" in str(warning.message)]
    assert len(waits) == 1, waits  # the read of the agreed values


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_target_layers_compiled_on_cuda_equal_the_straightforward_reference(pack):
    """train.compile_target on CUDA: the demo recipe's real micro-batches through the target's compiled decoder
    layers give the eager target's features, in a bounded number of graphs (tests/test_compiled_layers.py)."""
    from tests.test_compiled_layers import assert_compiled_layers_equal_eager

    assert_compiled_layers_equal_eager(pack, torch.device("cuda"))


def test_compiled_draft_layer_trains_on_cuda_as_the_eager_one():
    """train.compile_drafter on CUDA: inductor compiles EAGLE-3's draft layer forward and backward with flex attention
    traced into it, at speculators' 3 steps; on two real packed micro-batches of other rows and widths the losses and
    gradients equal the eager layer's, in a bounded number of graphs, without a graph break
    (tests/test_compiled_drafter.py)."""
    from tests.test_compiled_drafter import assert_compiled_drafter_trains_as_eager

    assert_compiled_drafter_trains_as_eager(torch.device("cuda"), "flex", [0, 8], steps=3, grad_modes=(True,))


def host_waits_allowed(function):
    """`function` with torch.cuda's sync debug mode off while it runs."""

    @functools.wraps(function)
    def allowed(*args, **kwargs):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return function(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    return allowed


# transformers' mask creation, which a modelling module imports by these names
MASK_CREATION = ("create_causal_mask", "create_sliding_window_causal_mask")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("kind", ["dflash", "draft_model", "eagle", "medusa", "medusa2"])
def test_fixed_shape_losses_never_wait_for_the_host(kind, packed, monkeypatch):
    """The losses tests/test_no_host_sync.py runs on shapes alone, on CUDA: each kind's demo drafter, its loss
    (the fused vocabulary loss, every position run), backward and fused AdamW step never wait for the host. The
    draft model and Medusa-2 run a transformers model in their loss, whose mask creation reads the attention
    mask's or the positions' values (any padding? where do packed documents start?): that alone may wait."""
    from draftsmith.data_prep.collate import Collator, PackingCollator
    from tests.test_split_invariance import conversations, fresh

    target, drafter, _ = fresh(kind)
    target, drafter = target.cuda(), drafter.cuda()  # Medusa-2's adapted target shares the target's weights
    for module in {sys.modules[type(layer).__module__] for layer in drafter.modules()}:
        for name in MASK_CREATION:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, host_waits_allowed(getattr(module, name)))
    batch = (PackingCollator(0, 96) if packed else Collator(0))(conversations())
    batch |= drafter.host_fields(batch)  # on the host, as the trainer adds them (trainer/loop.py next_step)
    train_steps_without_waiting_for_the_host(drafter, target, on_cuda(batch))


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_eagle3_flex_training_on_real_batches_compiles_once_per_bucket(pack):
    """The demo recipe's real micro-batches (tests/test_ttt_flex.py's cases: padded EAGLE-3, packed P-EAGLE with
    a sliding window), trained through compiled flex attention on CUDA: the loss, statistics and gradients equal
    the dense path's on every batch, at most one compiled forward-and-backward graph per length bucket, and no
    call runs flex uncompiled (torch's silent fallback; here an error past FLEX_RECOMPILE_LIMIT)."""
    import warnings

    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.heads.ttt_attention import flat_length
    from draftsmith.target import run_target
    from tests.test_ttt_flex import CASES, compiled_graphs, real_micro_batches

    target, drafter, batches = real_micro_batches(["recipe=eagle3", *CASES[pack]], 8, pack)
    target, drafter = target.cuda(), drafter.cuda()
    before, buckets = compiled_graphs(), set()
    for batch in batches:
        batch = {key: value.cuda() if torch.is_tensor(value) else value for key, value in batch.items()}
        buckets.add(flat_length(batch["input_ids"].shape[0] * (batch["input_ids"].shape[1] - 2)))
        with torch.no_grad():
            target_out = run_target(target, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
        results = {}
        for backend in ("dense", "flex"):
            drafter.config.ttt_attention = backend
            drafter.zero_grad()
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="flex_attention called without torch.compile")
                loss, count, stats = drafter(batch, target_out)
                (loss / count).backward()
            grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
            results[backend] = (loss.detach(), stats, grads)
        (loss, stats, grads), (expected_loss, expected_stats, expected_grads) = results["flex"], results["dense"]
        torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-5)
        for name, values in expected_stats.items():
            torch.testing.assert_close(stats[name], values, rtol=1e-4, atol=1e-4, msg=name)
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)
    assert 1 <= compiled_graphs() - before <= len(buckets), (compiled_graphs() - before, sorted(buckets))
