"""Does vLLM accept at temperature > 0 what draftsmith's loop accepts: an export folder served as its card says (the
`vllm serve` line of its README) on the eval prompts of --data at --temperature, and the same drafter read from the
folder decoding the same prompts in draftsmith's loop at the same temperature, τ (1 + accepted draft tokens per
verify step, vLLM's mean acceptance length) and each position's acceptance rate side by side. The export check
compares them greedy only; the sampled requests people serve are this comparison.

    python benchmarks/vllm_sampled_acceptance.py --vllm-python /path/to/vllm-venv/bin/python --folder EXPORT
        [--data demo/data/eval.jsonl.gz] [--prompts 4] [--max-new 48] [--repeats 8] [--temperature 0.8]
        [--as-shipped] [--threads 1] [--out FILE]

Both sides sample: each prompt --repeats times with its own seed, every row --max-new tokens (EOS ignored, as vLLM's
`ignore_eos`), the first new token drawn from the prefill without a draft as vLLM draws it. τ's standard error comes
from the spread of the repeats' τ (each repeat is every prompt once, a batch), and `z` is the difference over the
two errors combined: |z| beyond about 3 says the engine accepts another rate than draftsmith predicts. vLLM's CPU
build 0.32 samples speculative requests wrongly (vllm-project/vllm#55005): by default the engine side mends its
kernel stand-in first (benchmarks/vllm_sampling.py); `--as-shipped` leaves it. One JSON object on stdout (and
appended to --out), with where the numbers came from (benchmarks/provenance.py). Exit 2: not an export folder, no
--data, no vLLM at --vllm-python; 3: vLLM failed while serving.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.provenance import provenance  # noqa: E402
from benchmarks.vllm_sampled_exactness import add_folder_arguments, emit, engine_env, fail, served_folder  # noqa: E402
from draftsmith.errors import EXIT_CHECK_FAILED  # noqa: E402

# Run by the vLLM Python: every repeat's batch (each prompt once, its own seed) served with the speculative config,
# vLLM's draft counters read after each, one JSON line.
VLLM_SIDE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import vllm_sampling  # the engine in this process, and the stand-in's mend
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
target, speculative, prompts, repeats, max_new, temperature, mended = sys.argv[2:9]
prompts, repeats, max_new, temperature = json.loads(prompts), int(repeats), int(max_new), float(temperature)
if mended == "mended":
    vllm_sampling.cpu_kernels._expand_kernel_impl = vllm_sampling.expand_in_own_dtype
llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=max(map(len, prompts)) + max_new + 8,
          skip_tokenizer_init=True, seed=0, gpu_memory_utilization=0.3, disable_log_stats=False,
          speculative_config=json.loads(speculative))

def counters():
    found = {m.name: m for m in llm.get_metrics()}
    return (int(found["vllm:spec_decode_num_drafts"].value), int(found["vllm:spec_decode_num_accepted_tokens"].value),
            list(found["vllm:spec_decode_num_accepted_tokens_per_pos"].values))

rows, before = [], counters()
for repeat in range(repeats):
    params = [SamplingParams(temperature=temperature, max_tokens=max_new, ignore_eos=True, detokenize=False,
                             seed=repeat * len(prompts) + i) for i in range(len(prompts))]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    after = counters()
    rows.append({"drafts": after[0] - before[0], "accepted": after[1] - before[1],
                 "accepted_at": [a - b for a, b in zip(after[2], before[2])]})
    before = after
print("ROWS " + json.dumps(rows))
"""


def vllm_side(python: str, target: str, speculative: dict, prompts, repeats, max_new, temperature, mended, threads):
    """Each repeat's draft counters in vLLM (VLLM_SIDE)."""
    args = [str(REPO / "benchmarks"), target, json.dumps(speculative), json.dumps(prompts), str(repeats), str(max_new),
            str(temperature), "mended" if mended else "as shipped"]  # fmt: skip
    done = subprocess.run([python, "-c", VLLM_SIDE, *args], capture_output=True, text=True, env=engine_env(threads))
    lines = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
    if done.returncode != 0 or not lines:
        fail(EXIT_CHECK_FAILED, f"vLLM did not serve: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1][len("ROWS ") :])


def draftsmith_side(target_model, drafter, prompts, repeats: int, max_new: int, gamma: int, temperature: float):
    """Each repeat's draft counters in draftsmith's loop, on vLLM's schedule: the first new token sampled from the
    prefill without a draft, then the drafter's chains of `gamma` after it."""
    from draftsmith.eval.counts import Counts
    from draftsmith.eval.loop import generate_batch
    from draftsmith.eval.sampling import Sampling
    from draftsmith.export.verify import VllmScheduled

    sampling, rows = Sampling(temperature=temperature), []
    verifier = drafter.proposer(temperature).verifier or target_model
    for repeat in range(repeats):
        seeds = [repeat * len(prompts) + i for i in range(len(prompts))]
        first = generate_batch(verifier, prompts, 1, sampling=sampling, seeds=seeds)
        drafted = [prompt + row.tokens[:1] for prompt, row in zip(prompts, first)]
        # one a sequence (each holds its state), drafting as vLLM schedules it up to max_tokens, counted past them
        proposers = [VllmScheduled(drafter.proposer(temperature), len(p) + max_new - 1, len(p) - 1) for p in drafted]
        counts = Counts()
        for row in generate_batch(verifier, drafted, max_new - 1 + gamma, proposers, gamma, None, sampling,
                                  seeds=[seed + 1 for seed in seeds]):  # fmt: skip
            counts.add(row.counts)
        # the loop's counters end at the deepest position a cycle reached; vLLM's count every position up to γ
        rows.append({"drafts": counts.reached[0] if counts.reached else 0, "accepted": counts.accepted,
                     "accepted_at": (counts.accepted_at + [0] * gamma)[:gamma]})  # fmt: skip
    return rows


def summary(rows: list[dict]) -> dict:
    """τ over all repeats, its standard error from the repeats' spread, each position's acceptance rate."""
    drafts = sum(row["drafts"] for row in rows)
    taus = [1 + row["accepted"] / max(row["drafts"], 1) for row in rows]
    error = statistics.stdev(taus) / len(taus) ** 0.5 if len(taus) > 1 else float("nan")
    at = [sum(row["accepted_at"][d] for row in rows) / max(drafts, 1) for d in range(len(rows[0]["accepted_at"]))]
    return {"tau": 1 + sum(row["accepted"] for row in rows) / max(drafts, 1), "tau_error": error, "drafts": drafts,
            "accepted_at_position": at, "repeats": rows}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_folder_arguments(parser)
    parser.add_argument("--prompts", type=int, default=4, help="prompts a domain of --data")
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    began = time.perf_counter()
    target, speculative, vllm_version = served_folder(args)
    from transformers import AutoTokenizer

    from draftsmith.eval.prompts import load_prompts
    from draftsmith.formats.folder import read_folder
    from draftsmith.target import load_target

    by_domain = load_prompts([str(args.data)], AutoTokenizer.from_pretrained(target), args.prompts, 192)
    prompts = [prompt for domain in by_domain.values() for prompt in domain]
    target_model = load_target(target)
    drafter = read_folder(Path(speculative["model"]), target_model)
    gamma = int(speculative["num_speculative_tokens"])
    with torch.no_grad():
        ours = draftsmith_side(target_model, drafter, prompts, args.repeats, args.max_new, gamma, args.temperature)
    served = vllm_side(args.vllm_python, target, speculative, prompts, args.repeats, args.max_new, args.temperature,
                       not args.as_shipped, args.threads)  # fmt: skip
    engine, loop = summary(served), summary(ours)
    row = {
        "folder": str(args.folder), "method": speculative.get("method"), "vllm": vllm_version,
        "kernel_stand_in": "as shipped" if args.as_shipped else "mended", "temperature": args.temperature,
        "gamma": gamma, "prompts": len(prompts), "max_new": args.max_new, "vllm_tau": engine, "draftsmith_tau": loop,
        "z": (engine["tau"] - loop["tau"]) / (engine["tau_error"] ** 2 + loop["tau_error"] ** 2) ** 0.5,
    } | provenance(args.threads, began)  # fmt: skip
    emit(row, args.out)


if __name__ == "__main__":
    main()
