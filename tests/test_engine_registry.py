"""What shared code asks of an engine instead of its name: the serving engines' descriptions
(draftsmith/engines.py SERVING_ENGINES) give each engine's Hub repo, model-card wording, speculative config and
monitor reading; the regeneration engines (data_prep/answer_engines.py ANSWER_ENGINES) what the parts record and what
each refuses; a drafter kind its own model-card lines."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from draftsmith.data_prep.answer_engines import ANSWER_ENGINES
from draftsmith.data_prep.regenerate import regenerate
from draftsmith.engines import ENGINE_NAMES, SERVING_ENGINES
from draftsmith.errors import UserError
from draftsmith.export.card import served_note
from draftsmith.export.push import repo_id_for
from draftsmith.heads import drafter_class, drafters
from draftsmith.heads.eagle3 import COVERAGE
from draftsmith.monitor.metrics import require_spec_decode
from draftsmith.recipe import load_recipe
from draftsmith.recipe_schema import CHOICES
from tests.helpers import REFERENCE_TARGET, stand_in_vllm


def test_every_engine_a_recipe_names_is_described_once():
    assert tuple(ANSWER_ENGINES) == CHOICES["data.regenerate.engine"]
    assert ENGINE_NAMES == {"vllm": "vLLM", "sglang": "SGLang"}
    recipe = load_recipe(["recipe=draft", "export.engines=[vllm,sglang]"])
    assert list(recipe.export.engines) == list(SERVING_ENGINES)


def test_each_engine_folder_is_pushed_to_its_own_repo():
    cfg = OmegaConf.create({"export": {"push": {"repo_id": "acme/demo"}}})
    assert [repo_id_for(cfg, engine) for engine in SERVING_ENGINES] == ["acme/demo", "acme/demo-sglang"]


@pytest.mark.parametrize(
    "engine, opening",
    [
        ("vllm", "Checked against vLLM's loader (names, shapes, conventions); not loaded in the engine at export (set "
                 "export.vllm_python to do so)."),
        ("sglang", "Checked against SGLang's loader source (names, shapes, layer-id convention); not run in SGLang by "
                   "draftsmith."),
    ],
)  # fmt: skip
def test_the_card_of_an_unchecked_folder_says_what_was_checked(engine, opening):
    assert served_note(engine, None, "float32") == (
        f"{opening} The command serves the target in float32, the dtype draftsmith loaded it in (`target.dtype`), as "
        "its eval does."
    )


def test_a_drafter_kind_writes_its_own_card_lines():
    """EAGLE-3's pruned vocabulary coverage; a kind that learns nothing the card shows, none."""
    assert drafter_class("eagle3").learned_card_lines({COVERAGE: 0.8125}) == [
        "- draft vocabulary covers 81.2% of the training data's assistant tokens"
    ]
    assert drafter_class("eagle3").learned_card_lines({}) == []
    others = [kind for kind in drafters() if kind != "eagle3"]
    assert others and all(drafter_class(kind).learned_card_lines({COVERAGE: 0.5}) == [] for kind in others)


def test_an_engine_that_counts_drafts_needs_all_its_counters_and_one_with_levels_either_gauge():
    with pytest.raises(UserError, match="not the /metrics of vLLM serving"):
        require_spec_decode({"drafts|u|": 1.0}, "text", "u", "vllm")
    require_spec_decode({"sglang:spec_accept_rate|u|": 0.5}, "text", "u", "sglang")
    with pytest.raises(UserError, match="not the /metrics of SGLang serving"):
        require_spec_decode({}, "", "u", "sglang")


def test_the_parts_record_the_dtype_vllm_ran_in_and_nothing_more_for_transformers(tmp_path):
    cfg = load_recipe(["recipe=draft", f"target.name_or_path={REFERENCE_TARGET}", f"output_dir={tmp_path}"])
    assert ANSWER_ENGINES["transformers"].recorded(cfg) == {}
    assert ANSWER_ENGINES["vllm"].recorded(cfg) == {"vllm_dtype": "float32"}  # target.dtype auto, on CPU


def test_vllm_regeneration_refuses_a_sharded_target_before_any_engine_starts(tmp_path, small_data):
    cfg = load_recipe([
        "recipe=eagle3", f"target.name_or_path={REFERENCE_TARGET}", f"data.train=[{small_data['train']}]",
        "data.regenerate.engine=vllm", "target.shard=fsdp", f"output_dir={tmp_path}",
    ])  # fmt: skip
    with pytest.raises(UserError) as refused:
        regenerate(cfg)
    assert str(refused.value) == (
        "data.regenerate.engine=vllm with target.shard=fsdp: vLLM shards the target itself; "
        "set data.regenerate.vllm.tensor_parallel_size instead"
    )
    assert not (tmp_path / "regenerated").exists()


def test_a_vllm_python_given_by_a_relative_path_is_that_file_not_a_program_on_path(tmp_path, monkeypatch):
    """`./vpy` (which a path prints as `vpy`) is the file in the working directory, run by its absolute path: a bare
    name would be looked up on PATH ("No such file"); a venv's python is not resolved through its link either."""
    from draftsmith.engines import vllm_python

    stub = stand_in_vllm(tmp_path)
    monkeypatch.chdir(stub.parent)
    link = stub.parent / "vpy"
    link.symlink_to(stub)
    assert vllm_python("./vpy", "data.capture.vllm.python") == str(link)
