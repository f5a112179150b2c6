"""DFlash: a training block computes exactly what a decoding block computes (same context, positions,
anchor and masks), the loss scores block position k against x_{a+k} with the decaying weights and
only at anchors whose token and next token bear loss, DDTree keeps exactly the best prefixes, and
speculative decoding is lossless (chain and DDTree), rolls its context cache back consistently,
samples exactly, and costs one draft forward per cycle. The real trainer (online, and from captured
shards with the same losses) lowers the loss with the target frozen and ends with the eval report."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data_prep.capture import capture
from draftsmith.data_prep.collate import Collator, PackingCollator
from draftsmith.errors import UserError
from draftsmith.eval.loop import generate, prefill, propose, verify_step
from draftsmith.eval.sampling import Sampling
from draftsmith.heads import drafter_class
from draftsmith.heads.base import TargetShape, load_drafter
from draftsmith.heads.dflash import ROW_BLOCKS
from draftsmith.heads.dflash_config import default_target_layers
from draftsmith.heads.dflash_proposer import best_first_tree
from draftsmith.heads.packing import causal_lm_inputs, conversation_rand, documents, num_documents
from draftsmith.heads.proposer import DynamicTree
from draftsmith.recipe import load_recipe
from draftsmith.target import run_target
from tests.helpers import DFLASH_TINY as TINY
from tests.helpers import (
    SAMPLES,
    TINY_VOCAB,
    VOCAB,
    assert_greedy_equals_plain,
    assert_one_line_error,
    exact_conditionals,
    exact_joint,
    exactness_pvalues,
    first_records,
    fitted_eagle,
    greedy_text,
    read_log,
    reweighted,
    run_entry_in_process,
    speculative_samples,
    tiny_llama,
    train_args,
    train_in_process,
)

DFlash = drafter_class("dflash")

pytestmark = pytest.mark.usefixtures("one_thread")


def fitted_dflash(model, steps: int, **config):
    return fitted_eagle(model, steps, drafter_type="dflash", **{**TINY, **config})


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=TINY_VOCAB, logit_scale=4.0)


@pytest.fixture(scope="module")
def drafter(model):
    return fitted_dflash(model, steps=40)  # right often enough for the tests below: 100 steps took 1.2 s more


@pytest.fixture(scope="module")
def prompts():
    """Random prompts of 5, 11 and 17 tokens (the target's own text follows them)."""
    rows = torch.randint(3, TINY_VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    return [row[:length].tolist() for row, length in zip(rows, (5, 11, 17))]


# -- training computes what decoding computes -------------------------------------------------------
@torch.no_grad()
def test_training_blocks_equal_decoding_blocks(model, drafter):
    """Several anchors of two sequences in one teacher-forced pass (each block sees only context
    before its anchor, among other blocks) give the logits of a decoding block after committing
    x_0..x_a, which sees nothing but its own context cache."""
    ids = greedy_text(model, rows=2, length=24, seed=3)
    anchors = torch.tensor([[1, 4, 9, 20], [2, 3, 15, 22]])
    out = run_target(model, ids, request=drafter.request)
    trained = drafter.logits(drafter.blocks(ids, out.layers, anchors))[:, :, 1:]
    for row, column in itertools.product(range(2), range(4)):
        a = int(anchors[row, column])
        state = prefill(model, [ids[row, : a + 1].tolist()], drafter.request).rows[0].draft_state()
        decoded = drafter.proposer().block_logits(state)
        torch.testing.assert_close(trained[row, column], decoded, rtol=1e-4, atol=1e-4)


def test_loss_scores_block_position_k_against_x_a_plus_k(model, drafter):
    """The loss (loss_weighting=decay), recomputed by hand from the same anchors: CE of block position k to
    x_{a+k} with weight exp(-(k-1)/decay), only where x_{a+k} exists and bears loss, anchors only where x_a
    and x_{a+1} bear loss."""
    drafter = reweighted(drafter, model, loss_weighting="decay")
    ids = greedy_text(model, rows=3, length=30, seed=4)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[0, 10:] = True
    loss_mask[1, 5:12] = True
    loss_mask[1, 20:26] = True
    loss_mask[2, 27:] = True  # three loss tokens: anchors 27 and 28, blocks running past the end
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    batch |= drafter.host_fields(batch)
    out = run_target(model, ids, request=drafter.request)
    loss, count, stats = drafter(batch, out)
    draws = conversation_rand(batch, (), ids.device, drafter.optimizer_step)
    anchors, real = drafter.sample_anchors(loss_mask, draws, batch[ROW_BLOCKS])
    assert anchors.shape[1] == int(real.sum(1).max())  # the host's count: as wide as the fullest row, no wider
    for row in range(3):
        picked = anchors[row][real[row]].tolist()
        assert picked == sorted(picked) and all(loss_mask[row, a] and loss_mask[row, a + 1] for a in picked)
        assert len(picked) == min(drafter.config.anchors, int((loss_mask[row, :-1] & loss_mask[row, 1:]).sum()))
    with torch.no_grad():
        logits = drafter.logits(drafter.blocks(ids, out.layers, anchors))
    weighted = weights = 0.0
    for row, column, k in itertools.product(range(3), range(anchors.shape[1]), range(1, drafter.config.block_size)):
        a = int(anchors[row, column])
        if real[row, column] and a + k < ids.shape[1] and loss_mask[row, a + k]:
            weight = math.exp(-(k - 1) / drafter.config.loss_decay)
            weighted += weight * float(-logits[row, column, k].log_softmax(-1)[ids[row, a + k]])
            weights += weight
    # A sum over blocks, each block's weights normalised to sum 1 over a whole block (heads/base.py, "The
    # loss contract"), over the number of blocks: per complete block its weighted mean.
    block = sum(math.exp(-(k - 1) / drafter.config.loss_decay) for k in range(1, drafter.config.block_size))
    assert loss.item() == pytest.approx(weighted / block, rel=1e-4)
    assert int(count) == int(real.sum()) == int(drafter.loss_tokens(batch))
    assert stats["block4/top1"][2, 1] == 0  # row 2's blocks reach x_{a+4} past the sequence: never scored
    assert stats["accepted"][:, 1].tolist() == real.sum(1).tolist()  # one value per real anchor


def test_host_fields_count_a_micro_batchs_blocks_once_for_the_loss_and_its_normaliser(drafter, monkeypatch):
    """`host_fields` counts the blocks per row once; the loss's width and `loss_tokens` (what the trainer sums
    over a step before its first forward) both read that count, and a batch without it is refused by name."""
    ids = torch.arange(48).view(2, 24) % VOCAB
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    counted = []
    row_blocks = drafter.row_blocks
    monkeypatch.setattr(drafter, "row_blocks", lambda batch: counted.append(1) or row_blocks(batch))
    with pytest.raises(KeyError, match=r"dflash_blocks.*drafter.host_fields\(batch\)"):
        drafter.loss_tokens(batch)
    batch |= drafter.host_fields(batch)
    assert int(drafter.loss_tokens(batch)) == int(row_blocks(batch).sum()) == 2 * drafter.config.anchors
    assert batch[ROW_BLOCKS] == drafter.config.anchors and len(counted) == 1


def test_dpace_weighs_each_position_by_the_accepted_length_riding_on_it(model, drafter):
    """D-PACE (loss_weighting=dpace, the default): each block's weights from the draft's own confidence,
    recomputed by hand: c_k = exp(-CE_k), s_k = (1-α)c_k + α, w_k ∝ sum_{j>=k} prod_{i<=j} s_i over the
    positions the block scores, summing to 1; with the decay weights a block's loss differs. Refused with
    the soft cross-entropy (no label)."""
    dpace = reweighted(drafter, model, loss_weighting="dpace", dpace_alpha=0.3)
    ids = greedy_text(model, rows=1, length=30, seed=4)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    batch |= dpace.host_fields(batch)
    out = run_target(model, ids, request=dpace.request)
    loss, count, _ = dpace(batch, out)
    draws = conversation_rand(batch, (), ids.device, dpace.optimizer_step)
    anchors, real = dpace.sample_anchors(loss_mask, draws, batch[ROW_BLOCKS])
    with torch.no_grad():
        logits = dpace.logits(dpace.blocks(ids, out.layers, anchors))
    total = 0.0
    for column in range(anchors.shape[1]):
        a = int(anchors[0, column])
        ks = [k for k in range(1, dpace.config.block_size) if real[0, column] and a + k < ids.shape[1]]
        ce = [float(-logits[0, column, k].log_softmax(-1)[ids[0, a + k]]) for k in ks]
        reach = list(itertools.accumulate((0.7 * math.exp(-c) + 0.3 for c in ce), lambda x, y: x * y))
        weights = [sum(reach[i:]) for i in range(len(reach))]
        total += sum(w * c for w, c in zip(weights, ce)) / sum(weights) if weights else 0.0
    assert loss.item() == pytest.approx(total, rel=1e-4) and int(count) == int(real.sum())
    decay = reweighted(drafter, model, loss_weighting="decay")
    assert decay(batch, out)[0].item() != pytest.approx(loss.item(), rel=1e-3)
    with pytest.raises(UserError, match="loss_weighting=dpace reads each position's confidence .* set drafter.loss=ce"):
        replace(drafter.config, loss_weighting="dpace", loss="soft_ce").check()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_dpace_gradients_are_those_of_the_weighted_cross_entropies(model, drafter, packed):
    """D-PACE's gradient, every trained weight's, is the straightforward loss's: per block the sum over the
    positions it scores of the detached weight (recomputed by hand as above) times the position's
    cross-entropy from the full logits' log_softmax, over the block's weights. Padded rows, and packed ones
    where a block stops at its document's end."""
    dpace = reweighted(drafter, model, loss_weighting="dpace", dpace_alpha=0.3).train()
    ids = greedy_text(model, rows=3, length=24, seed=6)
    conversations = [
        {"input_ids": row[:length].tolist(), "loss_mask": [0] * 3 + [1] * (length - 3)}
        for row, length in zip(ids, (24, 17, 11))
    ]
    batch = (PackingCollator(0, 32) if packed else Collator(0))(conversations)
    assert num_documents(batch) == 3 and documents(batch).shape[0] == (2 if packed else 3)
    batch |= dpace.host_fields(batch)
    ids, loss_mask, docs = batch["input_ids"], batch["loss_mask"].bool(), documents(batch)
    with torch.no_grad():
        out = run_target(model, ids, request=dpace.request, **causal_lm_inputs(batch))
    trained = [parameter for parameter in dpace.parameters() if parameter.requires_grad]
    got = torch.autograd.grad(dpace(batch, out)[0], trained)

    draws = conversation_rand(batch, (), ids.device, dpace.optimizer_step)
    anchors, real = dpace.sample_anchors(loss_mask, draws, batch[ROW_BLOCKS], docs)
    log_q = dpace.logits(dpace.blocks(ids, out.layers, anchors, batch)).log_softmax(-1)
    total, blocks = 0.0, 0
    for row, column in itertools.product(range(anchors.shape[0]), range(anchors.shape[1])):
        a = int(anchors[row, column])
        scored = [
            k
            for k in range(1, dpace.config.block_size)
            if real[row, column] and a + k < ids.shape[1] and loss_mask[row, a + k] and docs[row, a + k] == docs[row, a]
        ]
        ce = [-log_q[row, column, k, ids[row, a + k]] for k in scored]
        reach = list(itertools.accumulate((0.7 * math.exp(-c.item()) + 0.3 for c in ce), lambda x, y: x * y))
        weights = [sum(reach[i:]) for i in range(len(reach))]  # floats: constants of the loss
        if weights:
            total = total + sum(w * c for w, c in zip(weights, ce)) / sum(weights)
            blocks += 1
    assert blocks > 3
    expected = torch.autograd.grad(total, trained)
    for got_grad, expected_grad in zip(got, expected):
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-4, atol=1e-6)
    assert any(grad.abs().sum() > 0 for grad in got)


def test_soft_loss_reads_the_targets_distribution(model):
    soft = fitted_dflash(model, steps=0, loss="soft_ce", loss_weighting="decay")
    assert soft.request.logits and not DFlash.features(DFlash.Config(**TINY), soft.target).logits
    ids = greedy_text(model, rows=2, length=20, seed=5)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    batch |= soft.host_fields(batch)
    out = run_target(model, ids, request=soft.request)
    hard = DFlash(replace(soft.config, loss="ce"), soft.target)
    hard.load_state_dict(soft.state_dict())
    hard.attach_target(model)
    hard.train(soft.training)  # the same anchors: each conversation's own draw in the same mode
    # The target's distribution of x_{t+1} (its logits at t) made one-hot on the data's token: soft CE
    # to it is CE to the data. The real distribution gives another loss.
    one_hot = torch.full_like(out.logits, -1e4).scatter(-1, ids.roll(-1, dims=1)[..., None], 0.0)
    losses = []
    for drafter, target_out in [
        (soft, type(out)(logits=one_hot, final=out.final, layers=out.layers)),
        (hard, out),
        (soft, out),
    ]:
        losses.append(drafter(batch, target_out)[0].item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-4) and losses[2] != pytest.approx(losses[1], rel=1e-3)


# -- DDTree -----------------------------------------------------------------------------------------
def test_ddtree_keeps_exactly_the_best_prefixes():
    generator = torch.Generator().manual_seed(0)
    log_q = (3 * torch.randn(4, 10, generator=generator)).log_softmax(-1)
    topk, nodes = 3, 17
    tree = best_first_tree(log_q, nodes, topk)
    values, ids = log_q.topk(topk, dim=-1)
    every = {}
    for depth in range(1, 5):
        for ranks in itertools.product(range(topk), repeat=depth):
            every[tuple(int(ids[d, r]) for d, r in enumerate(ranks))] = sum(
                float(values[d, r]) for d, r in enumerate(ranks)
            )
    best = sorted(every.values(), reverse=True)[:nodes]
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    assert len(tree) == nodes and all(parent < node for node, parent in enumerate(parents))

    def prefix(node):
        return prefix(parents[node]) + (tokens[node],) if node >= 0 else ()

    kept = [every[prefix(node)] for node in range(nodes)]
    assert sorted(kept, reverse=True) == pytest.approx(best)
    assert best_first_tree(log_q, 4, 1).parents.tolist() == [-1, 0, 1, 2]  # topk 1: the greedy chain


# -- decoding ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [None, DynamicTree(nodes=10, depth=4, topk=3)], ids=["chain", "ddtree"])
def test_greedy_speculative_equals_plain_with_one_draft_forward_per_cycle(model, drafter, prompts, tree):
    assert_greedy_equals_plain(model, drafter, prompts, tree)
    out = generate(model, prompts[0], 30, drafter.proposer(), gamma=4, tree=tree)
    # one draft forward per cycle, but for a last cycle left with one token of the budget (a plain step)
    assert out.counts.target_forwards - 1 <= out.counts.draft_forwards <= out.counts.target_forwards


def test_context_cache_rollback_matches_a_drafter_rebuilt_from_scratch(model, drafter, prompts, tmp_path):
    drafter.save_pretrained(tmp_path / "dflash")
    saved = load_file(str(tmp_path / "dflash" / "model.safetensors"))
    assert (
        "mask_embedding" in saved
        and "fc.weight" in saved
        and not any("embed_tokens" in name or "lm_head" in name for name in saved)
    )
    fresh_drafter = load_drafter(tmp_path / "dflash", TargetShape.of(model, "tiny"), model).eval()
    state = prefill(model, [prompts[1]], drafter.request)
    row, proposer, lengths = state.rows[0], drafter.proposer(), set()
    for cycle in range(20):
        tree = DynamicTree(nodes=8, depth=4, topk=2) if cycle % 2 else None
        expected = fresh_drafter.proposer().propose(
            prefill(model, [row.tokens], drafter.request).rows[0].draft_state(), 4, tree
        )
        draft = propose(proposer, row, 4, tree, max_depth=4)
        assert torch.equal(draft.tokens, expected.tokens) and torch.equal(draft.parents, expected.parents), cycle
        assert proposer.cached() == len(row.tokens) - 1  # the context: every committed position before the root
        lengths.add(
            len(
                verify_step(
                    model, state, [draft], Sampling(), [torch.Generator().manual_seed(cycle)], request=drafter.request
                )[0].path
            )
        )
    assert len(lengths) >= 2  # accepted paths of different lengths were rolled back


@pytest.mark.slow
def test_a_mask_token_is_the_targets_embedding_row_and_adds_no_tensor(model, prompts):
    """drafter.mask_token_id: the mask queries read the target's (frozen) embedding of that token, as
    vLLM feeds them; nothing of the mask is saved. qk_norm gives a Llama layer Qwen3's q/k norms."""
    drafter = fitted_dflash(model, steps=20, mask_token_id=3)
    embedding = model.get_input_embeddings().weight
    assert torch.equal(drafter.mask_input(), embedding[3]) and not hasattr(drafter, "mask_embedding")
    names = set(drafter.state_dict())
    assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= names and not [
        n for n in names if "mask" in n
    ]
    assert_greedy_equals_plain(model, drafter, prompts, None)
    with pytest.raises(UserError, match=r"mask_token_id=32 is not a token of the target's 32-token vocabulary"):
        DFlash.Config(mask_token_id=32, **TINY).check(TargetShape.of(model, "tiny"))


@torch.no_grad()
def test_a_chain_of_gamma_runs_a_block_of_gamma_plus_one_queries(model, drafter, prompts):
    """As vLLM runs DFlash with num_speculative_tokens γ: the root and γ masks, non-causal among
    themselves, so the chain is the argmax of that block, not a truncation of the trained one."""
    state = prefill(model, [prompts[2]], drafter.request).rows[0].draft_state()
    for gamma in (1, 2, 4):
        chain = drafter.proposer().propose(state, gamma)
        assert chain.tokens.tolist() == drafter.proposer().block_logits(state, gamma + 1).argmax(-1).tolist()
    full, short = drafter.proposer().block_logits(state), drafter.proposer().block_logits(state, 3)
    assert not torch.allclose(full[:2], short)  # fewer masks attend differently


# slow tier: the rejection rule is proven in the fast tier by tests/test_eval.py; here DFlash's own q (7-10 s each)
@pytest.mark.slow
@pytest.mark.parametrize("tree", [None, DynamicTree(nodes=4, depth=2, topk=2)], ids=["sampled-chain", "ddtree"])
def test_sampling_matches_target_distribution(tree):
    """Chain: each block position's token is drawn from its own q and q goes to the exact rule.
    DDTree: deterministic nodes (q one-hot). Chi-square against the target's exact distribution."""
    small_model = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=5, logit_scale=8.0)
    sampling = Sampling(1.0)
    prompt = [1, 5, 2, 7]
    drafter = fitted_dflash(small_model, steps=30, target_layers=[-1, 0], block_size=3)
    conditionals = exact_conditionals(small_model, prompt, sampling)
    counts, accepted = speculative_samples(  # each row's draws seeded from its seed (`Proposer.start`)
        small_model,
        prompt,
        lambda: drafter.proposer(temperature=1.0),
        gamma=2,
        tree=tree,
        sampling=sampling,
    )
    assert 0.1 * SAMPLES < accepted < 1.9 * SAMPLES
    pvalues = exactness_pvalues(counts, exact_joint(conditionals))
    assert min(pvalues.values()) > 1e-3, pvalues


# -- configuration ----------------------------------------------------------------------------------
def test_target_layers_default_and_bad_values():
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]  # the reference's Qwen3-8B drafter
    assert default_target_layers(30, 3) == [1, 14, 27] and default_target_layers(12, 1) == [6]
    deep = tiny_llama(vocab=16, hidden=16, layers=12)
    drafter = DFlash.from_target(DFlash.Config(num_layers=3), deep, "deep")
    assert (
        drafter.config.target_layers == [1, 5, 9] and drafter.request.layers == (1, 5, 9) and not drafter.request.final
    )
    assert DFlash.max_chain(drafter.config) == 7
    shallow = tiny_llama(vocab=16, hidden=16, layers=4)
    with pytest.raises(UserError, match=r"default target layers .* \[1, 1\].*set drafter.target_layers"):
        DFlash.from_target(DFlash.Config(), shallow, "shallow")
    with pytest.raises(UserError, match=r"target_layers=\[0, 4\]: layer id\(s\) \[4\] out of range"):
        DFlash.from_target(DFlash.Config(target_layers=[0, 4]), shallow, "shallow")
    for bad, fragment in [
        ({"block_size": 1}, "block_size must be >= 2"),
        ({"loss": "kl"}, "drafter.loss='kl'"),
        ({"anchors": 0}, r"^drafter.anchors must be >= 1 \(got 0\)$"),
        ({"tree_topk": 0}, r"^drafter.tree_topk must be >= 1 \(got 0\)$"),  # each key its own line, not three lumped
        ({"loss_decay": 0.0}, r"^drafter.loss_decay must be > 0 \(got 0.0\)$"),
    ]:
        with pytest.raises(UserError, match=fragment):
            DFlash.Config(target_layers=[0, 1], **bad).check()


def test_chain_longer_than_the_block_is_refused_before_loading(tmp_path, capsys):
    args = ["train.py", "recipe=dflash", "eval.num_speculative_tokens=8", f"output_dir={tmp_path / 'run'}"]
    result = run_entry_in_process(args, capsys)
    assert "7" in assert_one_line_error(result, 2, prefix="error:") and not (tmp_path / "run").exists()


# -- the real trainer -------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_trainer_online_and_from_shards(tmp_path, small_data, token_cache):
    """`train.py recipe=dflash` lowers the loss, keeps the target frozen and ends with an eval report
    in which chain and DDTree are lossless at one draft forward per cycle; training from captured
    shards (float16 features) logs the same losses as training online, within float16 rounding."""
    quick = ["data.max_length=96", "drafter.anchors=16"]
    output_dir = tmp_path / "run"
    args = ["recipe=dflash", *train_args(output_dir, small_data, token_cache, "train.max_steps=16", *quick)[1:]]
    # two prompts (two domains) and no prompt-lookup baseline: the report's "all" chain and tree rows are read
    two = first_records(small_data["eval"], tmp_path / "eval.jsonl", 2)
    evaluated = [f"data.eval=[{two}]", "eval.enabled=true", "eval.max_new_tokens=24", "eval.ngram_baseline=false"]
    final, target = train_in_process([*args, *evaluated])
    assert all(not p.requires_grad for p in target.parameters())
    log = read_log(output_dir)
    assert sum(log[step]["train/loss"] for step in range(13, 17)) / 4 < 0.8 * log[1]["train/loss"]
    report = json.loads((output_dir / "eval" / "report.json").read_text())
    rows = report["domains"]["all"]
    assert set(rows) == {"chain", "tree"} and all(row["lossless"] for row in rows.values())
    for row in rows.values():  # one draft forward per cycle; a prompt's last cycle may have no room to draft
        draft_forwards = round(row["draft_forwards_per_cycle"] * row["target_forwards"])
        assert row["target_forwards"] - row["prompts"] <= draft_forwards <= row["target_forwards"]
    config = json.loads((final / "config.json").read_text())
    assert config["drafter_type"] == "dflash" and config["drafter"]["target_layers"] == [0, 1, 2]

    features = tmp_path / "features"
    # the last value of a key wins; the losses alone are read, and 3 steps of 4 rows read 24 conversations at most
    short = [*args, "train.max_steps=3", "data.eval=[]", "data.max_conversations=24"]
    capture(
        load_recipe(
            [*short, f"output_dir={tmp_path / 'c'}", "data.capture.dtype=float16", f"data.capture.output={features}"]
        )
    )
    manifest = json.loads((features / "manifest.json").read_text())
    assert manifest["layers"] == [0, 1, 2] and not manifest["final"] and manifest["logits"] == "none"
    # stored in float16, as asked: the losses below cannot tell it from bfloat16 (both within 2e-3 of online)
    assert manifest["dtype"] == "float16"
    stored = [load_file(str(shard)) for shard in sorted(features.rglob("*.safetensors"))]
    assert stored and {shard[f"layer_{i}"].dtype for shard in stored for i in (0, 1, 2)} == {torch.float16}
    train_in_process([*short, f"output_dir={tmp_path / 'offline'}", f"data.features={features}"])
    train_in_process([*short, f"output_dir={tmp_path / 'online'}"])
    offline, online = read_log(tmp_path / "offline"), read_log(tmp_path / "online")
    assert [offline[s]["train/loss"] for s in (1, 2, 3)] == pytest.approx(
        [online[s]["train/loss"] for s in (1, 2, 3)], rel=2e-3
    )


@pytest.mark.parametrize(
    "settings, key",
    [(["drafter.loss_decay=3"], "drafter.loss_decay=3.0 is read only with drafter.loss_weighting=decay"),
     (["drafter.loss_weighting=decay", "drafter.dpace_alpha=0.3"],
      "drafter.dpace_alpha=0.3 is read only with drafter.loss_weighting=dpace")],
)  # fmt: skip
def test_a_weightings_setting_given_to_the_other_weighting_is_refused(settings, key):
    """D-PACE never reads loss_decay, nor the decay weighting dpace_alpha: either was trained on without a word."""
    from draftsmith.recipe import load_recipe

    with pytest.raises(UserError, match=key):
        load_recipe(["recipe=dflash", *settings])
    decay = load_recipe(["recipe=dflash", "drafter.loss_weighting=decay", "drafter.loss_decay=3"])
    assert decay.drafter.loss_decay == 3


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_context_layer_no_engine_can_capture_is_warned_of_when_training_starts(kind, caplog):
    """vLLM, the one engine that serves DFlash and DSpark, cannot capture the target's last layer (its post-norm last
    state): a drafter reading it trains and evals here, and its export is refused; the start of training says so,
    not the export after the run."""
    from draftsmith.heads import drafter_class
    from draftsmith.target import TargetShape

    target = TargetShape("t", "llama", 256, 4096, 4)
    config = drafter_class(kind).Config(target_layers=[1, 3], mask_token_id=5)
    with caplog.at_level("WARNING"):
        config.check(target)
    assert "hold layer 3, the target's post-norm last state, which vLLM cannot capture" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        drafter_class(kind).Config(target_layers=[1, 2], mask_token_id=5).check(target)
    assert "post-norm" not in caplog.text
