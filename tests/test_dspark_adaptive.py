"""DSpark under vLLM's adaptive verification (heads/dspark_proposer.py): the chain is cut to the drafts whose survival,
the running product of the previous cycle's confidences, pays for their step cost, so the verified length follows
the confidence head as vLLM's rule says (checked against vLLM's own code); greedy decoding stays plain greedy and
sampling stays exact; the eval profiles the costs and reports them; the setting needs the confidence head and is
written into the served speculative config, which vLLM's config class takes."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate, prefill
from draftsmith.eval.sampling import Sampling
from draftsmith.eval.step_costs import priced, profile_costs
from draftsmith.heads.base import TargetShape
from draftsmith.heads.dspark_proposer import draft_budget
from draftsmith.heads.proposer import StepCosts
from draftsmith.target import load_target
from tests import test_dspark
from tests.helpers import DFLASH_TINY as TINY
from tests.helpers import (
    REFERENCE_TARGET,
    SAMPLES,
    VOCAB,
    assert_one_line_error,
    exact_conditionals,
    exact_joint,
    exactness_pvalues,
    reweighted,
    run_entry_in_process,
    save_drafter,
    speculative_samples,
    tiny_llama,
    vllm_script,
)
from tests.test_dspark import DSpark, fitted_dspark

pytestmark = pytest.mark.usefixtures("one_thread")

LINEAR = StepCosts(draft_ms=1.0, verify_ms=(1.0, 2.0, 3.0, 4.0, 5.0))  # V[n] = n: each draft costs a root's forward


# test_dspark.py's module fixtures, found by their names here (an import would trip ruff's F811 on every parameter)
model, drafter, prompts = test_dspark.model, test_dspark.drafter, test_dspark.prompts


def costed(drafter, costs: StepCosts, temperature: float = 0.0):
    """A proposer given step costs, as the eval gives them where the drafter is served with adaptive verification."""
    proposer = drafter.proposer(temperature)
    proposer.step_costs = costs
    return proposer


def constant_confidence(drafter, model, value: float):
    """The same drafter, its confidence head saying `value` at every position."""
    other = reweighted(drafter, model)
    with torch.no_grad():
        other.confidence_head.proj.weight.zero_()
        other.confidence_head.proj.bias.fill_(math.log(value / (1 - value)))
    return other


def test_the_budget_is_vllms_argmax_of_expected_tokens_per_cost():
    """(1 + the k best survivals) / (D + V[1 + k]), the first maximum: with V[n] = n and D = 1, confidences 0.9 buy
    3 of 4 drafts (1 + .9 + .81 + .729 over 5 beats 4.0951 over 6), 0.5 buys none (a tie of 1/2 at k = 0 and 1),
    a new request's (None: 1.0 each) all 4; a flat verify cost buys every draft of any positive survival."""
    assert draft_budget(torch.full((4,), 0.9), 4, LINEAR) == 3
    assert draft_budget(torch.full((4,), 0.5), 4, LINEAR) == 0
    assert draft_budget(None, 4, LINEAR) == 4
    assert draft_budget(torch.full((4,), 0.9), 2, LINEAR) == 2  # at most the drafts scheduled
    assert draft_budget(torch.full((4,), 0.01), 4, StepCosts(1.0, (1.0,) * 5)) == 4


@pytest.mark.slow
def test_the_verified_length_follows_the_previous_cycles_confidence(model, drafter, prompts):
    """A new sequence verifies all γ (its stale confidences are 1.0), then each cycle the k its previous drafts'
    confidences buy; the chain kept is the first k of the chain drafted; a new sequence starts afresh."""
    state = prefill(model, [prompts[2]], drafter.request).rows[0].draft_state()
    full = drafter.proposer().propose(state, 4).tokens
    for value, lengths in [(0.9, [4, 3, 3]), (0.5, [4, 0, 0])]:
        proposer = costed(constant_confidence(drafter, model, value), LINEAR)
        chains = [proposer.propose(state, 4).tokens for _ in lengths]
        assert [len(chain) for chain in chains] == lengths
        assert all(torch.equal(chain, full[: len(chain)]) for chain in chains)
        proposer.start(1)
        assert len(proposer.propose(state, 4)) == 4


def test_greedy_with_cut_chains_is_plain_greedy(model, drafter, prompts):
    """The trained confidence head cutting the chains (and one that cuts every chain after the first to nothing,
    a plain step): the output is plain greedy's token for token, at one draft forward per cycle, as vLLM drafts."""
    nothing_after_first = constant_confidence(drafter, model, 0.5)
    for new_proposer, trained in [(lambda: costed(drafter, LINEAR), True),
                                  (lambda: costed(nothing_after_first, LINEAR), False)]:  # fmt: skip
        drafted = accepted = cycles = 0
        for number, prompt in enumerate(prompts):
            plain = generate(model, prompt, 40)
            spec = generate(model, prompt, 40, new_proposer(), gamma=4)
            assert spec.tokens == plain.tokens, f"differs from plain greedy on prompt {number}"
            # the drafter drafts a whole block each cycle, however much of it is verified; not for the last token
            assert spec.counts.target_forwards - 1 <= spec.counts.draft_forwards <= spec.counts.target_forwards
            drafted, accepted = drafted + spec.counts.drafted, accepted + spec.counts.accepted
            cycles += spec.counts.target_forwards
        assert drafted < 4 * cycles  # chains were cut
        assert 0 < accepted < drafted if trained else drafted == 4 * len(prompts)


def test_the_eval_profiles_the_costs_it_cuts_by(model, drafter):
    """One request's draft step and verify forwards of 1 .. γ+1 tokens, timed, the verify curve non-decreasing; the
    eval profiles them for a drafter served with adaptive verification only, and gives them to its every proposer."""
    costs = profile_costs(model, drafter.proposer(), 3, 40)
    assert costs.draft_ms > 0 and len(costs.verify_ms) == 4 and 0 < costs.verify_ms[0]
    assert list(costs.verify_ms) == sorted(costs.verify_ms)
    plain_proposers = drafter.proposer
    assert priced(plain_proposers, model, 3, 40) == (plain_proposers, None)
    adaptive = DSpark(replace(drafter.config, adaptive_verification=True), drafter.target)
    adaptive.load_state_dict(drafter.state_dict())
    adaptive.attach_target(model)
    new_proposer, costs = priced(adaptive.proposer, model, 3, 40)
    assert len(costs.verify_ms) == 4 and new_proposer().step_costs is costs


def test_adaptive_verification_needs_the_confidence_head(model):
    with pytest.raises(UserError, match="adaptive_verification needs confidence_head: true"):
        DSpark.Config(**TINY, confidence_head=False, adaptive_verification=True).check(TargetShape.of(model, "tiny"))


@pytest.mark.parametrize("setting", [{"confidence_weight": 2.0}, {"confidence_decay": 2.0}])
def test_the_confidence_heads_settings_without_the_head_are_refused(model, setting):
    """The confidence head's loss settings were accepted for a drafter without the head, and recorded in its export as
    if used."""
    with pytest.raises(UserError, match=f"drafter.{next(iter(setting))}=2.0 is read only with drafter.confidence_head"):
        DSpark.Config(**TINY, confidence_head=False, **setting).check_read()


def test_a_bad_value_is_refused_in_one_line(tmp_path, capsys):
    args = ["train.py", "recipe=dspark", "drafter.adaptive_verification=maybe", f"output_dir={tmp_path / 'run'}"]
    assert "adaptive_verification" in assert_one_line_error(run_entry_in_process(args, capsys), 2, prefix="error:")
    args = ["train.py", "recipe=dspark", "drafter.adaptive_verification=true", "drafter.confidence_head=false",
            f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert "needs confidence_head" in assert_one_line_error(run_entry_in_process(args, capsys), 2, prefix="error:")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_eval_of_a_drafter_served_with_adaptive_verification_reports_its_costs_and_stays_lossless(tmp_path, capsys):
    target = load_target(str(REFERENCE_TARGET))
    checkpoint = save_drafter("dspark", target, tmp_path / "ckpt", markov_rank=8, adaptive_verification=True)
    args = ["-m", "eval", "recipe=dspark", f"checkpoint={checkpoint}", "eval.max_prompts=1", "eval.max_new_tokens=16",
            "data.max_length=128", "eval.num_speculative_tokens=4", f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert run_entry_in_process(args, capsys).returncode == 0
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    costs = report["methods"]["chain"]["step_costs"]
    assert costs["requests"] == 1 and costs["context"] == 123 and len(costs["verify_ms"]) == 5
    chain = report["domains"]["all"]["chain"]
    assert chain["lossless"] and chain["drafted"] <= 4 * chain["target_forwards"]


@pytest.mark.slow
def test_sampling_with_cut_chains_matches_target_distribution():
    """A chain cut to its first k only shortens what the exact rule reads: chi-square against the target, the first
    cycle drafting 2 and the second's (at most 1) cut to nothing by its low confidences."""
    small_model = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=5, logit_scale=8.0)
    sampling = Sampling(1.0)
    prompt = [1, 5, 2, 7]
    drafter = fitted_dspark(small_model, steps=30, target_layers=[-1, 0], block_size=3, markov_rank=4)
    with torch.no_grad():  # a strong Markov head; a confidence head saying 0.14 for the first draft
        drafter.markov_head.markov_w2.weight.normal_(std=20.0)
        drafter.confidence_head.proj.weight.normal_(std=2.0)
        drafter.confidence_head.proj.bias.fill_(-7.0)
    costs = StepCosts(1.0, (1.0, 2.0, 3.0))  # a draft is worth verifying at survival 1/2 and over
    proposer = costed(drafter, costs, 1.0)
    state = prefill(small_model, [prompt], drafter.request).rows[0].draft_state()
    assert len(proposer.propose(state, 2)) == 2 and draft_budget(proposer.confidences, 1, costs) == 0
    conditionals = exact_conditionals(small_model, prompt, sampling)
    counts, accepted = speculative_samples(
        small_model, prompt, lambda: costed(drafter, costs, 1.0), gamma=2, sampling=sampling
    )
    assert 0.1 * SAMPLES < accepted < 1.9 * SAMPLES
    pvalues = exactness_pvalues(counts, exact_joint(conditionals))
    assert min(pvalues.values()) > 1e-3, pvalues


# vLLM's AdaptiveVerificationManager.get_num_tokens for one decoding request, run on its host-side state alone (the
# manager's constructor needs CUDA streams): the budget it chooses for each case's stale confidences and cost curves
VLLM_BUDGET = """
import json, sys
from types import SimpleNamespace
import numpy as np
from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av

budgets = []
for case in json.load(open(sys.argv[1])):
    steps = len(case["confidences"])
    verify = list(enumerate(case["verify_ms"], 1))  # (target tokens, ms)
    tables = av.build_cost_tables_from_curves([(1, case["draft_ms"])], verify, 1, steps + 1)
    state = SimpleNamespace(req_id_to_index={"r": 0}, num_computed_tokens_np=np.array([100]),
                            prefill_len=SimpleNamespace(np=np.array([10])))
    manager = SimpleNamespace(cost_tables=tables, req_states=state, num_speculative_steps=steps, num_bonus_tokens=1,
                              _stale_confidences=[SimpleNamespace(np=np.array([case["confidences"]], np.float32))],
                              _stale_idx=0, _max_total_logits=1 << 20)
    scheduled = case["scheduled"]
    av.AdaptiveVerificationManager.get_num_tokens(manager, {"r": 1 + scheduled}, {"r": [0] * scheduled})
    budgets.append(manager._batch_budget[2])
print(json.dumps(budgets))
"""


@pytest.mark.slow
@pytest.mark.engine
def test_the_budget_is_the_one_vllms_code_chooses(tmp_path, vllm_python):
    generator = torch.Generator().manual_seed(0)
    cases = []
    for number in range(200):
        steps = 1 + number % 8
        confidences = torch.rand(steps, generator=generator) ** (1 + number % 3)
        verify = torch.cumsum(torch.rand(steps + 1, generator=generator), 0) + 2.0 * (number % 2)
        scheduled = 1 + int(torch.randint(steps, (1,), generator=generator))
        draft_ms = float(torch.rand(1, generator=generator))
        cases.append({"confidences": confidences.tolist(), "draft_ms": draft_ms, "verify_ms": verify.tolist(),
                      "scheduled": scheduled})  # fmt: skip
    given, script = tmp_path / "cases.json", tmp_path / "budget.py"
    given.write_text(json.dumps(cases))
    script.write_text(VLLM_BUDGET)
    done = vllm_script(vllm_python, [str(script), str(given)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [
        draft_budget(torch.tensor(c["confidences"]), c["scheduled"], StepCosts(c["draft_ms"], tuple(c["verify_ms"])))
        for c in cases
    ]
    assert ours == theirs and len(set(ours)) > 3


@pytest.mark.slow
@pytest.mark.engine
def test_the_export_serves_it_in_the_speculative_config_vllm_takes(tmp_path, capsys, vllm_python):
    target = load_target(str(REFERENCE_TARGET))
    checkpoint = save_drafter("dspark", target, tmp_path / "ckpt", markov_rank=8, adaptive_verification=True)
    args = ["-m", "export", "recipe=dspark", f"checkpoint={checkpoint}", f"export.output={tmp_path / 'export'}",
            "export.engines=[vllm]", f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert run_entry_in_process(args, capsys).returncode == 0
    folder = tmp_path / "export" / "vllm"
    info = json.loads((folder / "draftsmith_export.json").read_text())
    served = info["speculative_config"]
    assert served["method"] == "dspark" and served["enable_adaptive_verification"] is True
    assert "enable_adaptive_verification" not in json.loads((folder / "config.json").read_text())
    script = tmp_path / "spec.py"
    script.write_text(
        "import json, sys\nfrom vllm.engine.arg_utils import EngineArgs\n"
        "target, folder, served = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])\n"
        "config = EngineArgs(model=target, dtype='float32', max_model_len=256).create_engine_config()\n"
        "spec = EngineArgs(model=target, speculative_config={**served, 'model': folder}).create_speculative_config(\n"
        "    config.model_config, config.parallel_config)\n"
        "print(json.dumps([spec.method, spec.enable_adaptive_verification]))\n"
    )
    done = vllm_script(vllm_python, [str(script), str(REFERENCE_TARGET), str(folder), json.dumps(served)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["dspark", True]


def test_a_step_costs_clock_starts_after_the_devices_queue_is_drained(monkeypatch):
    """On CUDA the fresh input (a deepcopy of the KV cache: device copies) and the warm-up run asynchronously: the
    clock started with them queued and timed them with the verify forward. The order of calls, with
    torch.cuda.synchronize recorded in place of a GPU's (none here)."""
    from draftsmith.eval import step_costs

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("drain"))
    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: events.append("clock") or 0.0)
    step_costs._median_ms(lambda _: events.append("run"), torch.device("cuda"), lambda: events.append("given"))
    timed = events[events.index("run") + 1 :]  # after the untimed warm-up
    assert timed[:5] == ["given", "drain", "clock", "run", "drain"] and timed.count("clock") == 2 * step_costs.REPLAYS
