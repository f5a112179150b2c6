"""Sequence packing (`data.pack`): the packing collator lays a micro-batch's conversations into rows
without losing or moving a token; the target's forward over packed rows gives every conversation the
outputs it gets alone; every drafter's loss and per-conversation statistics over a packed batch equal
those over the same conversations padded (float32, rtol 1e-4 / atol 1e-5) — and differ when the
packed rows are read as plain rows, so the comparison would catch a leak; the real train.py trains
packed into the same losses as padded, and resumes exactly."""

from __future__ import annotations

import pytest
import torch

from draftsmith.data_prep.bin_packing import pack_rows
from draftsmith.data_prep.collate import Collator, PackingCollator
from draftsmith.errors import UserError
from draftsmith.heads import drafter_class
from draftsmith.heads.packing import causal_lm_inputs, documents, require_packed_attention, same_document
from draftsmith.target import FeatureRequest, run_target
from tests.helpers import assert_one_line_error, read_log, run_entry_in_process, tiny_llama, train_args

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
LENGTHS = (30, 7, 12, 25, 9, 18, 5, 14, 21, 11)
PACK = 40
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def conversations(lengths=LENGTHS, seed: int = 0) -> list[dict]:
    """Rows as the tokenized data set has them: a prompt without loss (a third of the tokens, none,
    or one token, so that loss-bearing tokens sit at or near a conversation's start and a label,
    anchor or block taken across a boundary would land on one), then an assistant span with loss
    (up to the end, or a few tokens before it), a domain and a sample name each."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i, length in enumerate(lengths):
        ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        prompt = (length // 3, 0, 1)[i % 3]
        end = length - (i % 3)  # some conversations end with tokens that bear no loss
        mask = [0] * prompt + [1] * (end - prompt) + [0] * (length - end)
        rows.append(
            {
                "input_ids": ids,
                "loss_mask": mask,
                "length": length,
                "domain": ("code", "math", "docs")[i % 3],
                "sample": f"conv:{i}",
            }
        )
    return rows


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, hidden=32, layers=3, logit_scale=4.0)


@pytest.fixture(scope="module")
def batches():
    rows = conversations()
    return rows, Collator(0)(rows), PackingCollator(0, PACK)(rows)


# -- the collator ---------------------------------------------------------------------------------
def test_collator_packs_every_conversation_whole_in_order_with_positions_restarting(batches):
    rows, padded, packed = batches
    assert packed["input_ids"].shape[0] < len(rows) and packed["input_ids"].shape[1] <= PACK
    assert (
        packed["domain"] == padded["domain"] and packed["sample"] == padded["sample"]
    )  # one entry per conversation, same order
    for i, row in enumerate(rows):
        r, columns = (packed["document_ids"] == i).nonzero(as_tuple=True)
        assert len(set(r.tolist())) == 1, "a conversation is split over rows"
        assert columns.tolist() == list(range(int(columns[0]), int(columns[0]) + len(row["input_ids"]))), (
            "not contiguous"
        )
        where = (r[0], columns)
        assert packed["input_ids"][where].tolist() == row["input_ids"]
        assert packed["loss_mask"][where].tolist() == row["loss_mask"]  # the loss mask is each conversation's own
        assert packed["position_ids"][where].tolist() == list(range(len(row["input_ids"])))
        assert packed["attention_mask"][where].all()
    padding = packed["document_ids"] == -1
    assert int((~padding).sum()) == sum(LENGTHS)  # no token lost, none duplicated
    assert not packed["attention_mask"][padding].any() and not packed["loss_mask"][padding].any()
    for r in range(
        packed["input_ids"].shape[0]
    ):  # padding restarts its positions: a sequence of its own for transformers
        pad = padding[r].nonzero()[:, 0]
        assert packed["position_ids"][r, pad].tolist() == list(range(len(pad)))
        assert padding[r, pad.min() :].all() if len(pad) else True  # padding only at the row's end


def test_collator_lays_out_captured_feature_tensors_and_refuses_a_conversation_longer_than_a_row():
    rows = conversations((6, 9, 4))
    generator = torch.Generator().manual_seed(0)
    for row in rows:
        row["final"] = torch.randn(row["length"], 5, generator=generator)
        row["topk_ids"] = torch.randint(0, VOCAB, (row["length"], 3), generator=generator)
    packed = PackingCollator(0, 16)(rows)
    assert packed["final"].shape[-1] == 5 and packed["topk_ids"].dtype == torch.long
    for i, row in enumerate(rows):
        where = packed["document_ids"] == i
        assert torch.equal(packed["final"][where], row["final"]) and torch.equal(
            packed["topk_ids"][where], row["topk_ids"]
        )
    assert not packed["final"][packed["document_ids"] == -1].any()
    with pytest.raises(UserError, match=r"conv:1 has 9 tokens, more than data.pack_length=8"):
        PackingCollator(0, 8)(rows)


def test_first_fit_decreasing_is_deterministic_and_respects_the_capacity():
    lengths = [30, 7, 12, 25, 9, 18, 5, 14, 21, 11]
    packed = pack_rows(lengths, 40)
    assert packed == pack_rows(lengths, 40)
    assert sorted(i for row in packed for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 40 for row in packed)
    assert len(packed) == 4  # 152 tokens: the fewest rows of 40 that can hold them
    assert pack_rows([5, 5, 5], 5) == [[0], [1], [2]]


def test_same_document_and_documents_of_a_padded_batch(batches):
    _, padded, packed = batches
    docs = documents(padded)
    assert docs[1].tolist() == [1] * LENGTHS[1] + [-1] * (max(LENGTHS) - LENGTHS[1])
    row = packed["document_ids"][0]
    same = same_document(packed["document_ids"], 2)[0]
    for t in range(len(same)):
        assert bool(same[t]) == (int(row[t]) == int(row[t + 2]) >= 0)
    assert same_document(packed["document_ids"], 5, width=packed["input_ids"].shape[1])[:, -5:].eq(False).all()


# -- the target's forward -------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_target_forward_over_packed_rows_equals_each_conversation_alone(batches, attn):
    rows, padded, packed = batches
    model = tiny_llama(vocab=VOCAB, hidden=32, layers=3, attn=attn, logit_scale=4.0)
    request = FeatureRequest(final=True, layers=(0, 1), logits=True)
    alone = run_target(model, padded["input_ids"], padded["attention_mask"], request)
    together = run_target(model, packed["input_ids"], request=request, **causal_lm_inputs(packed))
    leaking = run_target(
        model, packed["input_ids"], packed["attention_mask"], request, packed["position_ids"]
    )  # a 2-D mask: no packing
    leaked = False
    for i, row in enumerate(rows):
        n, where = len(row["input_ids"]), packed["document_ids"] == i
        for name in ("logits", "final"):
            torch.testing.assert_close(getattr(together, name)[where], getattr(alone, name)[i, :n], **TOLERANCE)
        for layer in request.layers:
            torch.testing.assert_close(together.layers[layer][where], alone.layers[layer][i, :n], **TOLERANCE)
        leaked |= not torch.allclose(leaking.logits[where], alone.logits[i, :n], **TOLERANCE)
    assert leaked, "the comparison cannot tell packed attention from a leak"
    require_packed_attention(model, "the tiny target")


class IgnoresPacking(torch.nn.Module):
    """A causal LM whose code always builds its own 2-D mask: packed position_ids do not separate documents."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)


def test_a_model_that_ignores_packing_is_refused_in_one_line(target):
    with pytest.raises(UserError, match="does not keep packed documents apart") as info:
        require_packed_attention(IgnoresPacking(target), "the target x")
    assert "\n" not in str(info.value) and "data.pack=false" in str(info.value)


# -- every drafter: packed loss == padded loss -------------------------------------------------------
DRAFTERS = {
    "medusa": {"num_heads": 3},
    "medusa2": {
        "num_heads": 2,
        "heads_warmup": 0,
        "heads_weight": 0.5,
        "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]},
    },
    "eagle": {},  # its feature noise (recipe default) is each conversation's own: the same packed or not
    "eagle3": {"aux_layers": [0, 1], "draft_vocab_size": 40, "ttt_steps": 4},
    # the window counts positions within a conversation, not within the packed row
    "eagle3_windowed": {
        "type": "eagle3",
        "aux_layers": [0, 1],
        "draft_vocab_size": 40,
        "ttt_steps": 4,
        "sliding_window": 5,
    },
    "dflash": {
        "num_layers": 2,
        "target_layers": [0, 1],
        "block_size": 4,
        "anchors": 3,
    },  # fewer anchors than a conversation has: the draw is each conversation's own, the same packed or not
    "dflash_soft": {
        "type": "dflash",
        "num_layers": 1,
        "target_layers": [1],
        "block_size": 3,
        "anchors": 64,
        "loss": "soft_ce",
        "loss_weighting": "decay",  # D-PACE needs the data's token
        # without q/k norms (the dflash case has them): normalised queries and keys flatten this tiny
        # drafter's attention until a leak across conversations moves the soft loss by < 1e-4
        "qk_norm": False,
    },
    "draft_model": {"num_layers": 1, "loss": "mix", "ce_weight": 0.5},
    "draft_model_lora": {"type": "draft_model", "num_layers": 2, "loss": "tvd", "lora": {"r": 2, "alpha": 4}},
}


def fresh_drafter(name: str, target, rows):
    settings = dict(DRAFTERS[name])
    kind = settings.pop("type", name)
    cls = drafter_class(kind)
    torch.manual_seed(1)
    drafter = cls.from_target(cls.Config(**settings), target, "tiny")
    drafter.prepare(rows)
    # Move every trained weight off its initialisation (zero blocks, zero LoRA B, ...), so each part
    # of the drafter shapes the loss and a leak anywhere would show.
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in drafter.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return drafter.eval()


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_packed_loss_and_per_conversation_stats_equal_padded(name, target, batches):
    rows, padded, packed = batches
    drafter = fresh_drafter(name, target, rows)
    padded, packed = (batch | drafter.host_fields(batch) for batch in (padded, packed))  # as the trainer adds them
    request = drafter.request
    with torch.no_grad():
        padded_out = run_target(target, padded["input_ids"], padded["attention_mask"], request)
        packed_out = run_target(target, packed["input_ids"], request=request, **causal_lm_inputs(packed))
    torch.manual_seed(3)
    loss, count, stats = drafter(padded, padded_out)
    torch.manual_seed(3)
    packed_loss, packed_count, packed_stats = drafter(packed, packed_out)

    torch.testing.assert_close(packed_loss, loss, **TOLERANCE)
    assert int(packed_count) == int(count) == int(drafter.loss_tokens(padded)) == int(drafter.loss_tokens(packed))
    assert sorted(packed_stats) == sorted(stats)
    for metric, values in stats.items():
        assert values.shape == (len(rows), 2), metric  # one row per conversation: batch["domain"] names it
        assert torch.equal(packed_stats[metric][:, 1], values[:, 1]), metric  # the same positions counted
        torch.testing.assert_close(packed_stats[metric], values, **TOLERANCE, msg=metric)
    assert all(values[:, 1].sum() > 0 for values in stats.values())

    # The same packed rows read as plain rows (a row = one sequence, a 2-D mask) give another loss:
    # the comparison above would catch a leak across conversations.
    plain = {key: value for key, value in packed.items() if key not in ("position_ids", "document_ids")}
    plain |= drafter.host_fields(plain)
    with torch.no_grad():
        plain_out = run_target(target, plain["input_ids"], plain["attention_mask"], request)
    torch.manual_seed(3)
    assert not torch.allclose(drafter(plain, plain_out)[0], loss, **TOLERANCE)


def test_packed_training_step_gives_the_padded_gradients(target, batches):
    """What the optimizer sees: EAGLE-3's gradients (the training-time test's masks) are the same."""
    rows, padded, packed = batches
    drafter = fresh_drafter("eagle3", target, rows)
    grads = []
    for batch in (padded, packed):
        with torch.no_grad():
            out = run_target(target, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
        drafter.zero_grad()
        drafter(batch, out)[0].backward()
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


# -- the recipe and the real entry point ---------------------------------------------------------------
def test_pack_length_shorter_than_max_length_is_refused_before_anything_runs(tmp_path):
    from draftsmith.recipe import load_recipe

    with pytest.raises(UserError, match=r"data.pack_length=100 must be >= data.max_length=384") as info:
        load_recipe(["recipe=medusa", "data.pack=true", "data.pack_length=100", f"output_dir={tmp_path / 'run'}"])
    assert "\n" not in str(info.value)
    cfg = load_recipe(["recipe=medusa", "data.pack=true", f"output_dir={tmp_path / 'run'}"])
    assert cfg.data.pack and cfg.data.pack_length is None  # default: data.max_length


@pytest.mark.slow
def test_train_py_packed_trains_into_the_padded_losses_and_resumes_exactly(tmp_path, small_data, token_cache, capsys):
    # Conversations of up to 256 tokens (most of the slice is longer), packed into rows of 256.
    steps = ["train.max_steps=4", "train.save_every=2", "train.micro_batch_size=6", "data.max_length=256"]
    steps.append("data.eval=[]")  # nothing here reads the eval stage (0.5-2 s a run)
    packed_dir, padded_dir = tmp_path / "packed", tmp_path / "padded"
    packed = run_entry_in_process(
        ["train.py", *train_args(packed_dir, small_data, token_cache, *steps, "data.pack=true")], capsys
    )
    assert packed.returncode == 0, packed.stderr[-2000:]
    padded = run_entry_in_process(["train.py", *train_args(padded_dir, small_data, token_cache, *steps)], capsys)
    assert padded.returncode == 0, padded.stderr[-2000:]
    a, b = read_log(packed_dir), read_log(padded_dir)
    padding = [sum(log[step]["train/padding_fraction"] for step in range(1, 5)) / 4 for log in (a, b)]
    assert padding[0] < padding[1] - 0.05, padding  # it did pack
    for step in range(1, 5):
        assert a[step]["train/loss"] == pytest.approx(b[step]["train/loss"], rel=1e-4), step
        assert a[step]["train/head1/top1"] == pytest.approx(b[step]["train/head1/top1"], abs=1e-6), step

    # Resume the packed run from its step-2 checkpoint: the same data position, the same losses.
    checkpoint = packed_dir / "checkpoints" / "step_0000002"
    resumed_dir = tmp_path / "resumed"
    resumed = run_entry_in_process(
        [
            "train.py",
            *train_args(resumed_dir, small_data, token_cache, *steps, "data.pack=true", f"train.resume={checkpoint}"),
        ],
        capsys,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    c = read_log(resumed_dir)
    for step in (3, 4):
        assert c[step]["train/loss"] == pytest.approx(a[step]["train/loss"], rel=1e-5), step


@pytest.mark.slow
def test_training_from_captured_features_packs_them_into_the_padded_losses(tmp_path, small_data, token_cache, capsys):
    """Offline (`data.features`): the captured per-conversation features are laid into packed rows
    by the same collator; the losses equal the padded ones, train.py runs packed from the shards,
    and a capture holding conversations longer than data.pack_length is refused in one line."""
    from draftsmith.data_prep.capture import capture
    from draftsmith.data_prep.features import open_features
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_target
    from draftsmith.trainer.checkpoint import TrainerState
    from draftsmith.trainer.loop import micro_batches
    from tests.helpers import REFERENCE_TARGET

    features = tmp_path / "features"
    capture(
        load_recipe(
            train_args(
                tmp_path / "capture",
                small_data,
                token_cache,
                "data.capture.dtype=float16",
                f"data.capture.output={features}",
            )
        )
    )
    cfg = load_recipe(
        train_args(tmp_path / "run", small_data, token_cache, f"data.features={features}", "data.pack=true")
    )
    store, target = open_features(features), load_target(str(REFERENCE_TARGET))
    drafter = drafter_class("medusa").from_target(drafter_class("medusa").Config(), target, "demo").eval()
    padded = micro_batches(store, Collator(0), cfg, 1, 0, TrainerState())
    packed = micro_batches(store, PackingCollator(0, cfg.data.max_length), cfg, 1, 0, TrainerState())
    for _ in range(2):
        (_, _, a), (_, _, b) = next(padded), next(packed)
        assert "document_ids" in b and b["final"].shape[:2] == b["input_ids"].shape
        with torch.no_grad():
            loss_a, count_a, stats_a = drafter(a, store.to_target_output(a))
            loss_b, count_b, stats_b = drafter(b, store.to_target_output(b))
        torch.testing.assert_close(loss_b, loss_a, **TOLERANCE)
        assert int(count_b) == int(count_a)
        for metric in stats_a:
            torch.testing.assert_close(stats_b[metric], stats_a[metric], **TOLERANCE, msg=metric)

    result = run_entry_in_process(
        [
            "train.py",
            *train_args(
                tmp_path / "offline",
                small_data,
                token_cache,
                "train.max_steps=2",
                f"data.features={features}",
                "data.pack=true",
                "data.eval=[]",  # only its exit is checked: no eval stage
            ),
        ],
        capsys,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    too_short = run_entry_in_process(
        [
            "train.py",
            *train_args(
                tmp_path / "short",
                small_data,
                token_cache,
                f"data.features={features}",
                "data.pack=true",
                "data.max_length=64",
            ),
        ],
        capsys,
    )
    assert_one_line_error(
        too_short, 2, "the recipe resolves to data.max_length=64, but the features in", prefix="error"
    )
