"""A release's `swiglu_limits` (draftsmith.families' CLAMP_FIELD): vLLM 0.32's Exaone-MoE reads entry i to clamp
decoder layer i's SwiGLU inputs (SiluAndMulWithClamp in its dense and shared-expert MLPs, the routed experts' limit,
and an MTP block j built as layer j, entry j: models/exaone_moe.py), while transformers' ExaoneMoeConfig declares no
such field and its model computes every layer unclamped. Such a target is refused in one line, exit 2, before any of
it loads: draftsmith would train and measure its drafter on another target than vLLM serves. A config class that
declares the field (Step-3.5's text config, whose model clamps as vLLM does) and limits of 0 are not refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.errors import UserError
from draftsmith.families import CLAMP_FIELD, unserved_clamp
from draftsmith.target import load_target
from draftsmith.tiny_config import build_config
from tests.helpers import assert_one_line_error, run_entry_in_process, run_in_vllm

pytestmark = pytest.mark.usefixtures("one_thread")


def exaone_moe(**fields) -> dict:
    """A tiny Exaone-MoE config.json (4 layers: one dense, three with experts) with `fields` over it."""
    config = build_config("exaone_moe", 512, {}).to_dict()
    return {**config, "architectures": ["ExaoneMoeForCausalLM"], **fields}


def config_only(folder: Path, config: dict) -> Path:
    """A target folder holding its config.json alone: whatever reads past the config fails on the missing weights."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("recipe", ["eagle3", "mtp"])
def test_a_target_whose_layers_vllm_clamps_and_transformers_does_not_is_refused_in_one_line(recipe, tmp_path, capsys):
    """At the recipe's check, before the target or the data loads (its folder holds no weights)."""
    folder = config_only(tmp_path / "target", exaone_moe(**{CLAMP_FIELD: [0.0, 7.0, 0.0, 7.0]}))
    args = ["train.py", f"recipe={recipe}", f"target.name_or_path={folder}", f"output_dir={tmp_path / 'run'}"]
    line = assert_one_line_error(run_entry_in_process(args, capsys), 2, f"cannot load target '{folder}'")
    assert "swiglu_limits clamps the SwiGLU of decoder layers [1, 3]" in line
    assert "where vLLM 0.32 reads it, and transformers' ExaoneMoeConfig declares no swiglu_limits" in line
    assert not (tmp_path / "run").exists()


def test_a_target_whose_config_is_read_at_its_load_is_refused_before_its_weights(tmp_path):
    """A Hub id's config, which the recipe's check cannot read, is checked where transformers reads it
    (target_loading.load_config), before the weights: here none exist."""
    folder = config_only(tmp_path / "target", exaone_moe(**{CLAMP_FIELD: [7.0] * 4}))
    with pytest.raises(UserError, match=r"decoder layers \[0, 1, 2, 3\] \(and of an MTP block j built as layer j\)"):
        load_target(str(folder))


@pytest.mark.parametrize(
    "limits",
    [[0.0] * 4, [0, 0, -1.0, 0], [0.0] * 4 + [7.0], None],
    ids=["zeros", "not-above-0", "past-the-decoder-layers", "absent"],
)
def test_limits_vllm_does_not_apply_are_not_refused(limits):
    """vLLM clamps where an entry is above 0, and reads one entry per decoder layer (an MTP block j reads entry j)."""
    assert unserved_clamp(exaone_moe(**{CLAMP_FIELD: limits}), "t") is None


def test_a_config_class_declaring_the_field_is_not_refused():
    """Step-3.5's text config (transformers' Step3p7TextConfig, model type step3p5) declares `swiglu_limits`, and its
    model clamps as vLLM's Step3p5 does; a model type transformers does not know (remote code) is checked once its
    config class has loaded."""
    step = build_config("step3p5", 512, {}).to_dict()
    assert unserved_clamp({**step, CLAMP_FIELD: [7.0] * step["num_hidden_layers"]}, "t") is None
    assert unserved_clamp(exaone_moe(model_type="not_in_transformers", **{CLAMP_FIELD: [7.0] * 4}), "t") is None


def test_a_field_the_class_declares_under_a_releases_name_is_not_refused():
    """Ling-3.0's release names its limits `expert_swiglu_limit_list`, which transformers 5.25's BailingHybridConfig
    reads as `swiglu_limits` (its attribute_map) and its experts clamp by, as vLLM's BailingMoeV3 does: its loaded
    config is not refused (it was, as a class declaring no such field)."""
    config = build_config("bailing_hybrid", 512, {}, expert_swiglu_limit_list=[0.0, 7.0, 7.0, 7.0])
    assert getattr(config, CLAMP_FIELD) == [0.0, 7.0, 7.0, 7.0]
    assert unserved_clamp(config, "t") is None


# the target's greedy tokens as vLLM 0.32 serves it, and the activation its dense layer 0 is built with
SERVE = """
import json, os, sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process, to read its activation's class
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=128, skip_tokenizer_init=True)
model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
params = SamplingParams(temperature=0, max_tokens=8, detokenize=False)
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])], params)
print("RESULT", json.dumps({"tokens": [list(out.outputs[0].token_ids) for out in outputs],
                            "dense": type(model.model.layers[0].mlp.act_fn).__name__}))
"""


@pytest.mark.slow
def test_vllm_clamps_the_layers_transformers_computes_unclamped(vllm_python, tmp_path):
    """The fact the refusal states, measured: a tiny Exaone-MoE target as written is served by vLLM-CPU 0.32 with
    transformers' greedy tokens; given swiglu_limits of 0.05 (its SwiGLU inputs reach about 3.6), vLLM builds its
    MLPs with SiluAndMulWithClamp and serves other tokens, while transformers' stay the unclamped ones."""
    from transformers import AutoModelForCausalLM

    from draftsmith.random_target import write_random_target

    shape = {"head_dim": 32, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    plain = write_random_target("exaone_moe", tmp_path / "plain", **shape)
    clamped = tmp_path / "clamped"
    clamped.mkdir()
    config = json.loads((plain / "config.json").read_text())
    for path in plain.iterdir():
        (clamped / path.name).write_bytes(path.read_bytes())
    (clamped / "config.json").write_text(json.dumps({**config, CLAMP_FIELD: [0.05] * config["num_hidden_layers"]}))
    prompts = [torch.randint(3, 400, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]

    def transformers_tokens(folder: Path) -> list[list[int]]:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            return [
                model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, 12:].tolist() for p in prompts
            ]

    def served(folder: Path) -> dict:
        result = run_in_vllm(vllm_python, SERVE, tmp_path, folder, json.dumps(prompts))
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
        assert result.returncode == 0 and lines, result.stderr[-3000:]
        return json.loads(lines[-1].removeprefix("RESULT "))

    ours = transformers_tokens(plain)
    assert transformers_tokens(clamped) == ours  # transformers reads no swiglu_limits
    assert served(plain) == {"tokens": ours, "dense": "SiluAndMul"}
    theirs = served(clamped)
    assert theirs["dense"] == "SiluAndMulWithClamp"
    assert all(tokens != expected for tokens, expected in zip(theirs["tokens"], ours))
