"""What vLLM 0.32 drafts with the Gemma-4 Unified assistant when it serves the unified language model alone
(`Gemma4UnifiedForCausalLM`, which it registers no class for, so it runs it on its Transformers backend), measured
against draftsmith's proposer on the same committed tokens.

    python benchmarks/vllm_gemma4_unified_assistant.py --vllm-python /path/to/vllm-venv/bin/python
        [--out docs/results/vllm_gemma4_unified_assistant.json]
        [--target <a gemma4_unified_text target folder> --checkpoint <its gemma4_assistant checkpoint>]

A pair like the matrix row's (docs/targets-mtp.md, "Gemma-4 Unified rows") is trained in a temporary directory with
the matrix's settings (its seeded tiny `gemma4_unified_text` target trained on the demo's conversations, then
`train.py recipe=gemma4_assistant` with the row's overrides, without its resume; about 4 minutes on 2 cores), or with
--target and --checkpoint that pair is read; the assistant's folder is what the export writes. vLLM runs the target
as its folder names it (on its Transformers backend) and, in a second engine, as its own Gemma-4 class
(`--hf-overrides '{"architectures": ["Gemma4ForCausalLM"]}'`, the same tensors). Each decodes the demo's eval prompts
greedily, one at a time (`lossless`: its tokens are draftsmith's plain greedy decoding's), with the assistant drafting
3 tokens a step; every proposal its proposer returns is recorded with the position it drafts at, and the token
embedding its gemma4_mtp model computes (`embed_input_ids`), as a multiple of the embedding table's rows (`scale`; the
target's own scaling is sqrt(hidden), vLLM's `normalizer`). draftsmith's proposer then drafts after the same committed
tokens twice: as trained (the target's embedding, scaled by sqrt(hidden) as the target scales it) and with that
embedding scaled by sqrt(hidden) once more. Each count: the proposals (chains), first tokens and tokens of each
reading equal to vLLM's. Nothing downloads.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GAMMA = 3
PROMPTS_PER_DOMAIN = 3  # the demo's eval prompts, as the matrix's export check serves them
MAX_TOKENS = 48
# How vLLM is asked to run the target: as the folder names it (Gemma4UnifiedForCausalLM, which vLLM 0.32 runs on its
# Transformers backend), and as its own Gemma-4 class (`--hf-overrides`), which reads the same tensors
SERVINGS = {"transformers_backend": None, "gemma4_for_causal_lm": {"architectures": ["Gemma4ForCausalLM"]}}

# Run by the vLLM Python: every proposal (the position it drafts at, its tokens) and the embedding scale, one line.
VLLM_PROPOSALS = """
import json, sys
import vllm.model_executor.models.gemma4_mtp as mtp
import vllm.v1.spec_decode.gemma4 as gemma4
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
calls, scales, propose = [], [], gemma4.Gemma4Proposer.propose
def recorded(self, *args, **kwargs):
    calls.append({"positions": []})
    drafts = propose(self, *args, **kwargs)
    calls[-1]["drafts"] = drafts[0].tolist()
    return drafts
gemma4.Gemma4Proposer.propose = recorded
forward = mtp.Gemma4MultiTokenPredictor.forward
def seen(self, input_ids, positions, *args, **kwargs):
    calls[-1]["positions"].append(int(positions[-1]))
    return forward(self, input_ids, positions, *args, **kwargs)
mtp.Gemma4MultiTokenPredictor.forward = seen
embed = mtp.Gemma4MultiTokenPredictor.embed_input_ids
def measured(self, input_ids):
    out = embed(self, input_ids)
    module = type(self.embed_tokens)
    scales.append({"module": module.__module__ + "." + module.__name__, "normalizer": float(self.normalizer),
                   "scale": float(out.norm() / self.embed_tokens.weight[input_ids].norm())})
    return out
mtp.Gemma4MultiTokenPredictor.embed_input_ids = measured
speculative = {"method": "mtp", "model": sys.argv[2], "num_speculative_tokens": int(sys.argv[4])}
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, enforce_eager=True, speculative_config=speculative,
          hf_overrides=json.loads(sys.argv[6]))
rows = []
for prompt in json.loads(sys.argv[3]):
    calls.clear()
    sampling = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[5]))
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)[0].outputs[0]
    rows.append({"tokens": list(out.token_ids), "calls": list(calls)})
architecture = llm.llm_engine.model_config.architecture
print("PROPOSALS", json.dumps({"rows": rows, "embedding": scales[0], "architecture": architecture}))
"""


def trained_pair(directory: Path) -> tuple[Path, Path]:
    """A pair trained with benchmarks/target_matrix.py's settings: its seeded tiny unified language model trained on
    the demo's conversations, then an assistant trained for it by train.py with the row's overrides; (target,
    checkpoint)."""
    import os
    import subprocess

    from benchmarks.target_matrix import COMMON, KINDS, TARGET_STEPS, trained_target

    target = trained_target("gemma4_unified_text", directory / "target", TARGET_STEPS, False)
    recipe, overrides = KINDS["gemma4_assistant"]
    run = directory / "run"
    args = [f"recipe={recipe}", f"target.name_or_path={target}", *COMMON, *overrides, "eval.enabled=false",
            f"output_dir={run}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "train.py", *args], cwd=REPO, check=True, env=env, capture_output=True)
    return target, run / "final"


def write_export(model, drafter, name: str, folder: Path) -> Path:
    """The assistant's vLLM folder as the export writes it (its config.json and weights)."""
    from safetensors.torch import save_file

    from draftsmith.formats import Source, exporter_for
    from draftsmith.formats.repo import TargetInfo
    from draftsmith.target import TargetShape

    info = TargetInfo(TargetShape.of(model, name), model.config.to_dict(), name)
    repo = exporter_for(drafter.type).vllm(Source(drafter, folder, model, info), GAMMA, folder)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(repo.config))
    save_file({key: tensor.contiguous() for key, tensor in repo.tensors.items()}, str(folder / "model.safetensors"))
    return folder


def draftsmith_chains(drafter, cases: list[tuple[list[int], list[int], object]]) -> list[list[int]]:
    """draftsmith's proposal after each position of each (decoded sequence, positions, the target's states over it):
    the committed tokens up to the position, the token after it the target's."""
    import torch

    from draftsmith.heads.proposer import DraftState

    chains = []
    with torch.no_grad():
        for sequence, places, states in cases:
            for place in places:
                state = DraftState(
                    tokens=torch.tensor(sequence[: place + 2]), final=states.final[0, place], layers={},
                    new_final=states.final[0, : place + 1],
                    new_layers={layer: h[0, : place + 1] for layer, h in states.layers.items()},
                )  # fmt: skip
                chains.append(drafter.proposer().propose(state, GAMMA).tokens.tolist())
    return chains


def agreement(chains: list[list[int]], served: list[list[int]]) -> dict[str, int]:
    pairs = list(zip(chains, served))
    return {
        "chains_equal": sum(ours == theirs for ours, theirs in pairs),
        "first_tokens_equal": sum(ours[0] == theirs[0] for ours, theirs in pairs),
        "tokens_equal": sum(a == b for ours, theirs in pairs for a, b in zip(ours, theirs)),
    }


def reading(model, drafter, prompts: list[list[int]], plain: list[list[int]], served: dict) -> dict:
    """vLLM's decoded tokens (`served`) against draftsmith's greedy decoding (`plain`), and its proposals against
    draftsmith's after the same committed tokens, as trained and with the target's embedding scaled by sqrt(hidden) a
    second time."""
    import torch

    from draftsmith.target import run_target

    # each proposal's position: its second forward's (the first runs over every new position); a proposal whose
    # drafted-from token is past the decoded text (the last, after max_tokens) is left out
    cases, proposals = [], []
    for prompt, row in zip(prompts, served["rows"]):
        sequence = prompt + row["tokens"]
        calls = [
            call for call in row["calls"] if len(call["positions"]) > 1 and call["positions"][1] + 1 < len(sequence)
        ]
        with torch.no_grad():  # one causal forward gives every position's states, before the embedding is rescaled
            states = run_target(model, torch.tensor([sequence]), request=drafter.request)
        cases.append((sequence, [call["positions"][1] for call in calls], states))
        proposals += [call["drafts"] for call in calls]
    as_trained = draftsmith_chains(drafter, cases)
    scale = model.get_input_embeddings().embed_scale
    with torch.no_grad():
        scale.mul_(scale.clone())  # sqrt(hidden) twice: the assistant's input only (the states are computed)
        scaled_twice = draftsmith_chains(drafter, cases)
        scale.sqrt_()
    return {
        "architecture": served["architecture"],
        "lossless": [row["tokens"] for row in served["rows"]] == plain,
        "embedding": served["embedding"],
        "proposals": len(proposals),
        "draftsmith": agreement(as_trained, proposals),
        "draftsmith_embedding_scaled_twice": agreement(scaled_twice, proposals),
    }


def main() -> None:
    from benchmarks.provenance import provenance
    from benchmarks.vllm_probe import add_vllm_python, ask_vllm, vllm_version_or_exit

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_vllm_python(parser)
    parser.add_argument("--out", type=Path, default=REPO / "docs/results/vllm_gemma4_unified_assistant.json")
    parser.add_argument("--target", type=Path, help="a gemma4_unified_text target folder (with --checkpoint)")
    parser.add_argument("--checkpoint", type=Path, help="a gemma4_assistant checkpoint for --target (a trained one)")
    args = parser.parse_args()
    if (args.target is None) != (args.checkpoint is None):
        parser.error("--target and --checkpoint go together")
    began = time.perf_counter()

    from transformers import AutoTokenizer

    from draftsmith.eval.loop import generate_batch
    from draftsmith.eval.prompts import eos_ids_of, load_prompts
    from draftsmith.heads.base import load_drafter
    from draftsmith.target import load_target

    version = vllm_version_or_exit(args.vllm_python)
    with tempfile.TemporaryDirectory() as tmp:
        target, checkpoint = (args.target, args.checkpoint) if args.target else trained_pair(Path(tmp))
        model = load_target(str(target))
        drafter = load_drafter(checkpoint, target_model=model).eval()
        folder = write_export(model, drafter, str(target), Path(tmp) / "export")
        by_domain = load_prompts([str(REPO / "demo/data/eval.jsonl.gz")], AutoTokenizer.from_pretrained(target),
                                 PROMPTS_PER_DOMAIN, 192)  # fmt: skip
        prompts = [prompt for domain in by_domain.values() for prompt in domain]
        eos_ids = eos_ids_of(model, AutoTokenizer.from_pretrained(target))
        plain = [generation.tokens for generation in generate_batch(model, prompts, MAX_TOKENS, eos_ids=eos_ids)]
        readings = {}
        for name, overrides in SERVINGS.items():
            served = ask_vllm(args.vllm_python, VLLM_PROPOSALS, "PROPOSALS", str(target), str(folder),
                              json.dumps(prompts), str(GAMMA), str(MAX_TOKENS), json.dumps(overrides))  # fmt: skip
            readings[name] = reading(model, drafter, prompts, plain, served)
    result = {
        "vllm": version,
        "pair": f"{args.target} + {args.checkpoint}" if args.target else "trained here with the matrix's settings",
        "gamma": GAMMA,
        **readings,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result |= provenance(None, began)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(readings))


if __name__ == "__main__":
    main()
