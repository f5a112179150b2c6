"""HY-V4's MTP depths' MLP kind as vLLM 0.32 reads it (models/hy_v4/nvidia/mtp.py): depth j is layer N + j, and
`_extend_layer_types` pads `mlp_layer_types` (and `layer_types`) with the list's last entry where it does not reach
N + j, so HYV4DecoderLayer builds depth j's MLP as entry N + j of a list the release extends past the decoder's
layers, else as the last decoder layer's. A release's list of N entries: every depth takes the last entry's kind, as
draftsmith builds it (mtp_layer.layer_config). A list past N: transformers refuses the config (`validate_layer_type`,
here 5.24; vLLM's own HYV4Config under its transformers 5.19 too wherever the config has `layer_types`, which
transformers' HY-V4 class always writes), so draftsmith cannot run the target at all: one line, exit 2, before
anything loads (was an internal error, exit 70)."""

from __future__ import annotations

import json

import pytest

from draftsmith.heads import drafter_class, mtp_depths
from draftsmith.target import load_target
from tests.helpers import assert_one_line_error, run_entry_in_process
from tests.test_mtp import mtp_args
from tests.test_mtp_depths_layouts import release_with_depths

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")


@pytest.mark.parametrize("last", ["dense", "sparse"])
def test_every_depth_takes_the_last_entrys_mlp_kind_as_vllm_pads_the_list(last, tmp_path):
    """A two-depth release whose N entries end in `last`: vLLM pads the list to N + 2 with that entry, so both depths'
    MLPs are of its kind (experts where sparse), and so are draftsmith's, their tensors the release's."""
    kinds = ["dense", "sparse", "sparse", last]
    folder = release_with_depths(tmp_path, "hy_v4", index_topk=16, mlp_layer_types=kinds)
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    padded = kinds + [kinds[-1]] * (layers + 2 - len(kinds))  # vLLM's _extend_layer_types, up to layer N + 1
    drafter = MTP.from_target(MTP.Config(mtp_depths=2), load_target(str(folder)), str(folder))
    for depth in (0, 1):
        mlp = mtp_depths.part(drafter, depth).block.mlp
        assert hasattr(mlp, "experts") == (padded[layers + depth] == "sparse") == (last == "sparse"), depth


def test_a_release_listing_mlp_kinds_past_its_layers_is_one_line_before_anything_loads(
    tmp_path, small_data, token_cache, capsys
):
    """`mlp_layer_types` with entries for the MTP layers past num_hidden_layers: transformers' check refuses the
    config; `recipe=mtp` says so in one line, exit 2, nothing written (was StrictDataclassClassValidationError, exit
    70)."""
    folder = release_with_depths(tmp_path / "target", "hy_v4", index_topk=16)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "mlp_layer_types": config["mlp_layer_types"] + ["dense"] * 2})
    )
    run = tmp_path / "run"
    done = run_entry_in_process(["train.py", *mtp_args(folder, run, small_data, token_cache)], capsys)
    line = assert_one_line_error(done, 2, "transformers refuses its config.json")
    assert "must be equal to the number of `mlp_layer_types` (6)" in line
    assert not list(run.glob("checkpoints/*")) and not (run / "final").exists()
