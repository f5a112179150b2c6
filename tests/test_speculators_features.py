"""Features in speculators' format (data_prep/speculators_features.py): the files hold what vLLM's
`extract_hidden_states` would (speculators' layer ids = transformers' `hidden_states` indices, the last
slot the final layer's output before the final norm), line up with draftsmith's tokenization, and
speculators 0.9.0's own offline dataset class reads them (slow tier, in its venv)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from draftsmith.data_prep.speculators_features import INFO, TOKEN_FREQ, speculators_states, write_speculators_data
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target
from tests.helpers import DEMO, REFERENCE_TARGET

ROWS = 3


@pytest.fixture(scope="module")
def written(tmp_path_factory, token_cache):
    output = tmp_path_factory.mktemp("speculators") / "data"
    cfg = load_recipe(
        [
            "recipe=eagle3",
            f"target.name_or_path={REFERENCE_TARGET}",
            f"data.train=[{DEMO / 'data/train.regenerated.jsonl.gz'}]",
            f"data.max_conversations={ROWS}",
            f"data.cache_dir={token_cache}",
            f"output_dir={output.parent / 'run'}",
        ]  # fmt: skip
    )
    umask = os.umask(0o022)  # test_files_have_the_umasks_mode's
    try:
        return output, write_speculators_data(cfg, output, dtype="float32")
    finally:
        os.umask(umask)


def test_states_follow_vllm_layer_ids(written):
    output, info = written
    assert info["draftsmith_layer_ids"] == [0, 1, 2] and info["speculators_layer_ids"] == [1, 2, 3]
    model = load_target(load_recipe(["recipe=eagle3", f"target.name_or_path={REFERENCE_TARGET}"]).target)
    rows = load_from_disk(str(output))
    assert len(rows) == ROWS and rows[0]["seq_len"] == len(rows[0]["input_ids"])
    saved = load_file(output / "hidden_states" / "hs_0.safetensors")
    assert torch.equal(saved["token_ids"], rows[0]["input_ids"])
    with torch.no_grad():
        reference = model(saved["token_ids"][None], output_hidden_states=True).hidden_states
        # the final layer's output before the norm: the last layer run on its input by hand
        layer = model.model.layers[-1]
        positions = torch.arange(len(saved["token_ids"]))[None]
        rotary = model.model.rotary_emb(reference[-2], positions)
        mask = torch.full((len(positions[0]),) * 2, float("-inf")).triu(1)[None, None]
        out = layer(reference[-2], attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        pre_norm = out[0] if isinstance(out, tuple) else out
    states = saved["hidden_states"]
    assert states.shape == (len(saved["token_ids"]), 4, model.config.hidden_size)
    for slot, layer_id in enumerate(info["speculators_layer_ids"]):
        assert torch.equal(states[:, slot], reference[layer_id][0])
    torch.testing.assert_close(states[:, -1], pre_norm[0], atol=1e-4, rtol=1e-4)
    assert torch.allclose(model.model.norm(states[:, -1]), reference[-1][0], atol=1e-5)  # it is what the norm reads
    assert not torch.allclose(states[:, -1], reference[-1][0])  # and not transformers' normed last state
    frequency = torch.load(output / TOKEN_FREQ)
    assert sum(frequency.values()) == info["masked_tokens"] == int(sum(r.sum() for r in rows["loss_mask"]))


def test_files_have_the_umasks_mode(written):
    """safetensors writes through a private temporary file (mode 0600): every file of the folder gets the
    umask's mode (0644 under umask 022), so that speculators run by another user can read it."""
    output, _ = written
    files = [path for path in output.rglob("*") if path.is_file()]
    modes = {path.relative_to(output).as_posix(): oct(path.stat().st_mode & 0o777) for path in files}
    assert {path: mode for path, mode in modes.items() if mode != oct(0o644)} == {}
    assert len([path for path in modes if path.startswith("hidden_states/")]) == ROWS


def test_speculators_states_refuses_ids_past_the_layers():
    model = load_target(load_recipe(["recipe=eagle3", f"target.name_or_path={REFERENCE_TARGET}"]).target)
    with pytest.raises(Exception, match="layer ids"):
        speculators_states(model, torch.tensor([1, 2, 3]), [1, 4])


# speculators' offline reader over the folder: every row read back, split as its trainer splits it
READ = """
import json, sys, torch
from speculators.train.data import ArrowDataset
data = ArrowDataset(max_len=4096, datapath=sys.argv[1], on_missing="raise", hidden_states_dtype=torch.float32)
rows = [data[i] for i in range(len(data))]
print(json.dumps({"rows": len(rows),
                  "shapes": [[list(r["hidden_states"].shape), list(r["verifier_last_hidden_states"].shape)]
                             for r in rows],
                  "masked": [int(r["loss_mask"].sum()) for r in rows]}))
"""


@pytest.mark.slow
def test_speculators_reads_the_files(written, speculators_python):
    output, info = written
    done = subprocess.run([speculators_python, "-c", READ, str(output)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = load_from_disk(str(output))
    assert result["rows"] == ROWS
    assert result["shapes"] == [[[n, 3 * 256], [n, 256]] for n in map(int, rows["seq_len"])]
    assert sum(result["masked"]) == info["masked_tokens"]
    assert json.loads((output / INFO).read_text())["speculators_layer_ids"] == [1, 2, 3]
