"""`python -m draftsmith.random_target bailing_hybrid DIR` writes a Ling-3.0 release (draftsmith/text_release.py's
RELEASE_FORMS and RELEASE_CONSTANTS): config.json names vLLM's BailingMoeV3ForCausalLM, not transformers' class
(BailingHybridForCausalLM, which vLLM 0.32 has no model of and whose MTP layer it maps to Ling-2.5's model, so the
`mtp` kind refused it), and carries the fields vLLM's BailingMoeV3TextConfig reads where transformers writes others
or none: exactly those tests/test_mtp_bailing.py's release was measured with. transformers reads the folder back as
the model it wrote."""

from __future__ import annotations

import json

import pytest

from draftsmith.heads import drafter_class
from draftsmith.heads.mtp_layouts import LAYOUTS, layout_of
from draftsmith.heads.mtp_random_layer import write_random_layer
from draftsmith.target import load_target, local_target_shape
from tests.test_mtp_bailing import SHAPE, released_fields

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")


def test_random_target_writes_a_ling_3_release_the_mtp_kind_takes(tmp_path):
    """The command's folder: the release's architecture and fields (equal to the measured release's), its weights
    under the names transformers saves, read back by transformers as written; the `mtp` kind's recipe check takes it
    as Ling-3.0's layout once a layer is written beside (it refused transformers' class name in one line)."""
    from tests.helpers import random_target_command

    folder = tmp_path / "ling"
    with pytest.raises(SystemExit) as done:
        random_target_command(["bailing_hybrid", str(folder)])
    assert done.value.code == 0
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["BailingMoeV3ForCausalLM"] and config["model_type"] == "bailing_hybrid"
    assert {name: config[name] for name in released_fields(config)} == released_fields(config)
    assert config["num_experts_per_tok"] == config["num_experts_per_token"] and config["use_bias"] is False
    assert layout_of(config) == LAYOUTS["BailingMoeV3ForCausalLM"]
    write_random_layer(folder)  # a release's MTP layer, which transformers' saving leaves out
    MTP.Config().check(local_target_shape(str(folder)))
    model = load_target(str(folder))
    assert model.config.num_experts_per_token == config["num_experts_per_tok"]
    assert model.config.num_expert_group == config["n_group"]
    added = {*released_fields(config), "architectures"}  # change nothing transformers reads
    bare = type(model.config).from_dict({name: v for name, v in config.items() if name not in added}).to_dict()
    kept = set(bare) - {"_name_or_path", "architectures"}
    assert {name: model.config.to_dict()[name] for name in kept} == {name: bare[name] for name in kept}


def test_the_tests_release_is_the_written_one(tmp_path):
    """tests/test_mtp_bailing.py's release (its SHAPE, its fields put over the written config) changes nothing the
    writer wrote: the release form is random_target's own."""
    from draftsmith.random_target import write_random_target

    folder = write_random_target("bailing_hybrid", tmp_path, **SHAPE)
    config = json.loads((folder / "config.json").read_text())
    assert {**config, **released_fields(config)} == config
