"""speculators (vLLM's drafter trainer, the peer users compare with) reads draftsmith's exports with its
own loader: every speculators-format folder draftsmith writes (EAGLE-3, EAGLE-3.1, P-EAGLE) loads through
`SpeculatorModelConfig.from_pretrained` and `SpeculatorModel.from_pretrained` in speculators 0.9.0 (its
own venv: it pins transformers <= 5.19), and every tensor of the folder, the target's embedding
included, is in the loaded model bit for bit, with nothing of the model left unfilled but what it
takes from the verifier itself (`verifier_lm_head`, `verifier_norm`, used by its training only).
Without the embedding in the folder, speculators ran the draft on an all-zero embedding, silently.

Not here yet: speculators' draft model proposing draftsmith's tokens on the same captured target
states (function equivalence), and the other direction (a speculators checkpoint evaluated and
warm-started by draftsmith)."""

from __future__ import annotations

import json
import subprocess

import pytest

from draftsmith.export import export_checkpoint
from draftsmith.recipe import load_recipe
from tests.conftest import train_in_process

pytestmark = pytest.mark.slow

CASES = {
    "eagle3": [],
    "eagle3.1": ["drafter.fc_norm=true", "drafter.norm_output=true"],
    "peagle": ["drafter.parallel_drafting=true", "drafter.mask_token_id=5", "drafter.fc_norm=true", "eval.tree=0"],
}
# Run by the speculators venv's Python: load the folder with speculators' own loader and compare its
# state dict with the folder's tensors.
CHECK = """
import json, sys, torch
from safetensors.torch import load_file
from speculators import SpeculatorModel, SpeculatorModelConfig
folder = sys.argv[1]
config = SpeculatorModelConfig.from_pretrained(folder)
model = SpeculatorModel.from_pretrained(folder)
loaded, shipped = model.state_dict(), load_file(folder + "/model.safetensors")
print(json.dumps({
    "config": type(config).__name__,
    "model": type(model).__name__,
    "not_loaded": sorted(set(shipped) - set(loaded)),
    "not_shipped": sorted(set(loaded) - set(shipped)),
    "differ": sorted(k for k in shipped if k in loaded and not torch.equal(loaded[k].to(shipped[k].dtype), shipped[k])),
    "embedding_sum": float(loaded["embed_tokens.weight"].float().abs().sum()),
}))
"""


@pytest.mark.parametrize("case", list(CASES))
def test_speculators_loads_every_tensor_of_a_draftsmith_export(
    case, speculators_python, small_data, token_cache, tmp_path
):
    args = [
        "recipe=eagle3", "train.max_steps=2", "drafter.ttt_steps=2", f"data.train=[{small_data['train']}]",
        "data.eval=[]", f"data.cache_dir={token_cache}", "data.max_length=128", "train.save_every=0",
        "eval.enabled=false", f"output_dir={tmp_path / 'run'}", *CASES[case],
    ]  # fmt: skip
    final, _ = train_in_process(args)
    folder = export_checkpoint(load_recipe([*args, f"export.output={tmp_path / 'export'}"]), final)["vllm"]
    done = subprocess.run([speculators_python, "-c", CHECK, str(folder)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["model"] == ("PEagleDraftModel" if case == "peagle" else "Eagle3DraftModel") or result["model"]
    assert result["not_loaded"] == [] and result["differ"] == [], result
    assert set(result["not_shipped"]) <= {"verifier_lm_head.weight", "verifier_norm.weight"}, result
    assert result["embedding_sum"] > 0
