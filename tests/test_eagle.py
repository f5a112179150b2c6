"""EAGLE-1/2: the real trainer lowers its loss on the reference target, the checkpoint holds the draft
model only (the target's embedding and lm_head are re-attached on load), training and decoding
agree on the feature/token alignment, and speculative decoding with its own KV cache is lossless
(chain and dynamic tree, greedy), rolls back consistently and samples exactly."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.eval.loop import prefill
from draftsmith.eval.sampling import Sampling
from draftsmith.heads.base import TargetShape, load_drafter
from draftsmith.heads.proposer import DynamicTree
from draftsmith.target import run_target
from tests.helpers import EAGLE_TREE as TREE
from tests.helpers import (
    REFERENCE_TARGET,
    SAMPLES,
    TINY_VOCAB,
    VOCAB,
    assert_cache_rollback,
    assert_greedy_equals_plain,
    exact_conditionals,
    exact_joint,
    exactness_pvalues,
    fitted_eagle,
    speculative_samples,
    tiny_llama,
    train_args,
    train_in_process,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    """Small vocabulary and sharp logits: varied greedy text that a briefly fitted drafter half learns."""
    return tiny_llama(vocab=TINY_VOCAB, logit_scale=4.0)


@pytest.fixture(scope="module")
def drafter(model):
    return fitted_eagle(model, steps=40)  # about as often accepted as after 100 steps (a fit's cost is its steps)


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, TINY_VOCAB, (length,), generator=generator).tolist() for length in (5, 11, 17)]


# -- the real trainer on the reference target -----------------------------------------------------
@pytest.mark.slow
def test_real_trainer_lowers_the_loss_and_saves_the_draft_model_only(tmp_path, small_data, token_cache):

    output_dir = tmp_path / "run"
    args = train_args(output_dir, small_data, token_cache, "train.max_steps=24", "train.lr=2e-3")
    train_in_process(["recipe=eagle", *args[1:]])  # the EAGLE recipe, with the quick-run overrides

    log = {
        row["step"]: row
        for row in map(json.loads, (output_dir / "log.jsonl").read_text().splitlines())
        if "train/loss" in row
    }
    last = sum(log[step]["train/loss"] for step in range(19, 25)) / 6  # per-step losses are noisy
    assert last < 0.85 * log[1]["train/loss"]
    table = json.loads((output_dir / "eval_accuracy.json").read_text())
    trained, untrained = table["trained"]["all"], table["untrained"]["all"]
    assert trained["feature_loss"] < untrained["feature_loss"] and trained["token_loss"] < 0.8 * untrained["token_loss"]
    assert trained["step1/top1"] > untrained["step1/top1"] + 0.1

    final = output_dir / "final"
    weights = load_file(str(final / "model.safetensors"))
    assert "fc.bias" not in weights  # vLLM's EAGLE-1 fc has no bias: the recipe trains none
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.post_attention_layernorm.weight"} <= set(weights)
    # vLLM/SGLang names; the target's embedding and lm_head are shared, layer 0 has no input norm.
    assert not [
        name for name in weights if "embed" in name or "lm_head" in name or name.startswith("layers.0.input_layernorm")
    ]

    from draftsmith.target import load_target

    target = load_target(str(REFERENCE_TARGET))
    loaded = load_drafter(final, TargetShape.of(target, str(REFERENCE_TARGET)), target)
    assert loaded.target_modules() == (target.get_input_embeddings(), target.get_output_embeddings())
    assert not any(p.requires_grad for p in target.parameters())


# -- checkpoint contract --------------------------------------------------------------------------
def test_checkpoint_leaves_out_the_target_modules_and_reattaches_them(model, drafter, tmp_path):
    drafter.save_pretrained(tmp_path / "eagle")
    saved = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    assert set(saved) == set(drafter.state_dict())
    assert all(name.startswith(("fc.", "layers.")) for name in saved) and "layers.0.input_layernorm.weight" not in saved
    assert sum(t.numel() for t in saved.values()) == sum(p.numel() for p in drafter.parameters())

    detached = load_drafter(tmp_path / "eagle", TargetShape.of(model, "tiny"))
    with pytest.raises(RuntimeError, match="target_model"):
        detached.proposer().propose(prefill(model, [[5, 6, 7]]).rows[0].draft_state(), 2)
    loaded = load_drafter(tmp_path / "eagle", TargetShape.of(model, "tiny"), model)
    assert loaded.target_modules() == (model.get_input_embeddings(), model.get_output_embeddings())
    state = prefill(model, [[5, 6, 7, 8]]).rows[0].draft_state()
    assert torch.equal(
        loaded.proposer().propose(state, 3, TREE).tokens, drafter.proposer().propose(state, 3, TREE).tokens
    )

    foreign = tiny_llama(vocab=64, hidden=48, layers=1)
    with pytest.raises(UserError, match=f"vocab_size={TINY_VOCAB}"):
        load_drafter(tmp_path / "eagle", TargetShape.of(foreign, "foreign"), foreign)


# -- alignment: the loss supervises exactly what decoding computes ---------------------------------
def test_loss_supervises_the_feature_that_decoding_computes(model):
    """After committing x_0..x_{n-1} the decoder's feature f̂ drafts x_n; the loss must score that same
    f̂ against the target's feature and distribution at n-1 (which predict x_n) when x_n is supervised."""
    drafter = fitted_eagle(model, steps=0, noise_std=0.0)
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(3, TINY_VOCAB, (1, 20), generator=generator)
    n = 13
    decoded = drafter.proposer().catch_up(prefill(model, [ids[0, :n].tolist()]).rows[0].draft_state())

    target_out = run_target(model, ids, request=drafter.request)
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, n] = 1
    loss, count, stats = drafter({"input_ids": ids, "loss_mask": loss_mask}, target_out)
    assert int(count) == 1  # one supervised token: the loss sum is its loss
    feature = F.smooth_l1_loss(decoded, target_out.final[0, n - 1]).item()
    token = -(target_out.logits[0, n - 1].softmax(-1) * drafter.logits(decoded).log_softmax(-1)).sum().item()
    assert loss.item() == pytest.approx(feature + 0.1 * token, rel=1e-4)
    assert stats["token_loss"][0].tolist() == pytest.approx([token, 1.0], rel=1e-4)


# -- decoding -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "dynamic-tree"])
def test_greedy_speculative_equals_plain(model, drafter, prompts, tree):
    assert_greedy_equals_plain(model, drafter, prompts, tree)


def test_dynamic_tree_shape(model, drafter):
    state = prefill(model, [[5, 9, 2, 7]]).rows[0].draft_state()
    proposer = drafter.proposer()
    draft = proposer.propose(state, 3, DynamicTree(nodes=12, depth=4, topk=3))
    parents = draft.parents.tolist()
    assert len(draft) == 12 and all(parent < node for node, parent in enumerate(parents))
    depth = [0] * len(parents)
    for node, parent in enumerate(parents):
        depth[node] = 1 if parent < 0 else depth[parent] + 1
    assert max(depth) <= 4 and depth.count(1) <= 3
    for parent in set(parents):
        siblings = [int(draft.tokens[node]) for node, p in enumerate(parents) if p == parent]
        assert len(siblings) == len(set(siblings)) <= 3
    chain = proposer.propose(state, 3)
    assert chain.parents.tolist() == [-1, 0, 1] and chain.probs is None
    assert draft.tokens[0] == chain.tokens[0]  # the best first token heads both


def sequential_top_tokens(drafter, model, committed: list[int], path: list[int], topk: int) -> set[int]:
    """Reference without cache or tree mask: the drafter's top-k tokens after `committed` + `path`,
    running its whole sequence from scratch with the target's features for committed positions and
    its own predictions after them."""
    features = prefill(model, [committed]).rows[0].new_final  # f_0 .. f_{n-2}
    tokens = committed[1:]  # entry p reads x_{p+1}
    for step in range(len(path) + 1):
        ids = torch.tensor([tokens])
        predicted = drafter.draft(ids, features[None], torch.arange(len(tokens))[None])[0, -1]
        if step < len(path):
            tokens, features = tokens + [path[step]], torch.cat([features, predicted[None]])
    return set(drafter.logits(predicted).topk(topk).indices.tolist())


def test_dynamic_tree_matches_a_sequential_reference(model, drafter, prompts):
    """Every node's children are among the top-k tokens the drafter predicts, run step by step
    without cache, after the node's path: the tree mask, positions and cache entries are right."""
    committed = prompts[1]
    tree = DynamicTree(nodes=30, depth=4, topk=3)  # a budget that reaches the full depth
    draft = drafter.proposer().propose(prefill(model, [committed]).rows[0].draft_state(), 3, tree)
    paths: list[list[int]] = []
    for node, parent in enumerate(draft.parents.tolist()):
        paths.append((paths[parent] if parent >= 0 else []) + [int(draft.tokens[node])])
    assert max(map(len, paths)) == tree.depth
    for node in range(-1, len(draft)):
        children = {int(draft.tokens[c]) for c, p in enumerate(draft.parents.tolist()) if p == node}
        if children:
            path = paths[node] if node >= 0 else []
            assert children <= sequential_top_tokens(drafter, model, committed, path, tree.topk), path


def test_cache_rollback_matches_a_drafter_rebuilt_from_scratch(model, drafter, prompts, tmp_path):
    assert_cache_rollback(model, drafter, prompts[2], tmp_path)


@pytest.mark.slow  # the rejection rule is proven in the fast tier by tests/test_eval.py; here EAGLE's own q (7 s)
def test_sampling_matches_target_distribution():
    """Exact speculative sampling with EAGLE's deterministic drafts, chi-square against the target's
    exact distribution (the helpers in tests/helpers.py). A dynamic tree with siblings: the chain
    is the same code with one child per node, and the loop's rule is tested on chains already."""
    small_model = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=5, logit_scale=8.0)
    sampling = Sampling(1.0)
    prompt = [1, 5, 2, 7]
    drafter = fitted_eagle(small_model, steps=40)
    conditionals = exact_conditionals(small_model, prompt, sampling)
    counts, accepted = speculative_samples(
        small_model,
        prompt,
        drafter.proposer,
        tree=DynamicTree(nodes=4, depth=2, topk=2),
        sampling=sampling,
    )
    assert 0.1 * SAMPLES < accepted < 1.9 * SAMPLES
    pvalues = exactness_pvalues(counts, exact_joint(conditionals))
    assert min(pvalues.values()) > 1e-3, pvalues


def test_checkpoint_cannot_name_code_outside_transformers():
    from draftsmith.errors import UserError
    from draftsmith.heads.eagle_base import import_qualified

    with pytest.raises(UserError, match="only classes from transformers"):
        import_qualified("os.system")
    assert (
        import_qualified("transformers.models.llama.modeling_llama.LlamaDecoderLayer").__name__ == "LlamaDecoderLayer"
    )
