"""The eval report's "served by": the engines the kind names for a method, less those whose export
draftsmith refuses for this drafter and this target, asked of the export's own check
(formats.Exporter.refuse): the report never names an engine the export of that drafter refuses."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from draftsmith.errors import UserError
from draftsmith.eval.methods import build_methods, serving
from draftsmith.eval.report import run_eval
from draftsmith.export.run import export_checkpoint
from draftsmith.heads import drafter_class
from draftsmith.random_target import build_model
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target
from draftsmith.tiny_config import build_config
from tests.helpers import KINDS, REFERENCE_TARGET, save_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

EAGLE31 = {"fc_norm": "true", "norm_output": "true"}
SGLANG_LACKS = "which SGLang's EAGLE-3 layer does not have"


@pytest.fixture(scope="module")
def target():
    return load_target(str(REFERENCE_TARGET))


def recipe(kind: str, *overrides: str, **config: str):
    return load_recipe([f"recipe={KINDS[kind]}", *overrides, *(f"drafter.{k}={v}" for k, v in config.items())])


def drafter_for(target, kind: str, **config: str):
    settings = OmegaConf.to_object(recipe(kind, **config).drafter)
    return drafter_class(kind).from_target(settings, target, str(REFERENCE_TARGET))


def info_of(methods, name: str) -> dict:
    return next(method.info for method in methods if method.name == name)


def test_a_plain_eagle3_is_served_by_both_engines_and_eagle31_by_vllm_alone(target):
    cfg = recipe("eagle3", "eval.tree=6")
    plain = build_methods(cfg, drafter_for(target, "eagle3"), target, target, 0.0)
    assert info_of(plain, "chain")["served_by"] == "vLLM, SGLang" and info_of(plain, "tree")["served_by"] == "SGLang"
    assert "not_served_by" not in info_of(plain, "chain")

    methods = build_methods(cfg, drafter_for(target, "eagle3", **EAGLE31), target, target, 0.0)
    chain, tree = info_of(methods, "chain"), info_of(methods, "tree")
    assert chain["served_by"] == "vLLM" and tree["served_by"] == "draftsmith eval only"
    assert SGLANG_LACKS in chain["not_served_by"]["SGLang"] and set(chain["not_served_by"]) == {"SGLang"}


@pytest.mark.parametrize(
    "kind, config, engine, fragment",
    [
        ("eagle3", {"norm_before_fc": "true"}, "sglang", SGLANG_LACKS),
        ("eagle3", {"sliding_window": "16"}, "sglang", "sliding window of 16 positions, which SGLang"),
        ("eagle3", {"norm_before_residual": "true"}, "sglang", "SGLang's EAGLE-3 layer always keeps"),
        ("eagle", {"fc_bias": "true"}, "vllm", "vLLM's EAGLE-1 skips without an error"),
        ("dflash", {"mask_token_id": "null"}, "vllm", "learned its own mask vector"),
        ("draft_model", {"parallel_drafting": "true", "mask_token_id": "5"}, "sglang", "drafts in parallel (PARD)"),
    ],
    ids=["eagle3-norm-before-fc", "eagle3-window", "eagle3-norm-before-residual", "eagle-fc-bias", "dflash-no-mask",
         "pard"],
)  # fmt: skip
def test_an_engine_whose_export_refuses_the_drafter_is_not_named(kind, config, engine, fragment, target):
    said = serving(drafter_for(target, kind, **config), target, "speculators", 0.0, None)
    name = {"vllm": "vLLM", "sglang": "SGLang"}[engine]
    assert name not in said["chain"]["served_by"] and fragment in said["chain"]["not_served_by"][name]


def test_a_target_vllm_cannot_capture_states_from_leaves_the_chain_to_the_engine_that_can():
    """vLLM reads no inner layer of a Gemma-2 target; SGLang builds Llama draft layers only."""
    gemma2 = build_model(build_config("gemma2", 96))
    for family, engines in (("llama", "SGLang"), ("qwen3", "draftsmith eval only")):
        settings = OmegaConf.to_object(recipe("eagle3", layer_family=family).drafter)
        said = serving(
            drafter_class("eagle3").from_target(settings, gemma2, "gemma2"), gemma2, "speculators", 0.0, None
        )
        assert said["chain"]["served_by"] == said["tree"]["served_by"] == engines
        assert "cannot capture the hidden states" in said["chain"]["not_served_by"]["vLLM"]


@pytest.mark.slow  # runs an entry point (the fast tier stays within its 2 minutes)
def test_the_report_says_what_the_export_refuses(target, small_data, tmp_path):
    """The report of an EAGLE-3.1 drafter names vLLM alone; its SGLang export is the refusal the report quotes."""
    checkpoint = save_drafter("eagle3", target, tmp_path / "final", **EAGLE31)
    args = [
        f"recipe={KINDS['eagle3']}", f"data.eval=[{small_data['eval']}]", "eval.max_prompts=1", "eval.max_new_tokens=8",
        "eval.tree=6", "eval.ngram_baseline=false", "eval.suffix_baseline=false", f"output_dir={tmp_path / 'run'}",
        *(f"drafter.{k}={v}" for k, v in EAGLE31.items()),
    ]  # fmt: skip
    report = run_eval(load_recipe(args), checkpoint=checkpoint, target=target)
    markdown = (tmp_path / "run" / "eval" / "report.md").read_text()
    assert "| all | chain | vLLM |" in markdown and "| all | tree | draftsmith eval only |" in markdown
    with pytest.raises(UserError) as refused:
        export_checkpoint(
            load_recipe([*args, "export.engines=[sglang]", f"export.output={tmp_path / 'export'}"]), checkpoint, target
        )
    assert report["methods"]["chain"]["not_served_by"]["SGLang"] == str(refused.value)


def test_the_vllm_layout_the_recipe_exports_is_the_one_asked(target):
    """A P-EAGLE drafter is written in vLLM's speculators layout only: with export.vllm_format=native its vLLM
    export is refused, and the report said vLLM served it (the default layout was asked)."""
    peagle = drafter_class("eagle3").from_target(
        OmegaConf.to_object(
            recipe("eagle3", "eval.tree=0", "drafter.parallel_drafting=true", "drafter.mask_token_id=5").drafter
        ),
        target,
        str(REFERENCE_TARGET),
    )
    assert (
        serving(peagle, target, "speculators", 0.0, None)["chain"]["served_by"] == "vLLM (before 0.34.0)"
    )  # 0.34 drafts in parallel no more
    native = build_methods(recipe("eagle3", "eval.tree=0", "export.vllm_format=native"), peagle, target, target, 0.0)
    chain = info_of(native, "chain")
    assert (
        "vLLM" not in chain["served_by"]
        and "P-EAGLE is written in vLLM's speculators" in chain["not_served_by"]["vLLM"]
    )
