"""Is vLLM's speculative decoding itself lossless on a target, whatever drafts it verifies: the target's plain
greedy output in vLLM against its output under speculation by drafters draftsmith does not train, each parting's gap
in units of bfloat16 in transformers' logits and in vLLM's own (the tiny Qwen3-Next's export check,
docs/targets-matrix.md).

    python benchmarks/vllm_spec_lossless.py --vllm-python /path/to/vllm-venv/bin/python --target DIR
        [--methods oracle,oracle_reject,mtp,ngram,suffix] [--gamma 3] [--dtype bfloat16] [--batched] [--out FILE]

Methods: `oracle` drafts the plain run's own output (benchmarks/vllm_oracle_proposer.py: every draft accepted, so a
parting there comes with no rejection before it: a verify forward's rounding against a decode step's);
`oracle_reject` the same with draft 2 of every step wrong (a rollback of the recurrent states at every step); `mtp`
the target folder's own MTP layer (a random one: nothing accepted); `ngram` (prompt lookup of 1 to 4 tokens) and
`suffix` (suffix decoding, a tree γ deep), whose drafts vary in length from step to step. The prompts are the export
check's on the matrix's settings (the demo's eval data, 3 per domain, 192 tokens at most) and each of them twice over
(its token ids repeated), 48 new tokens; one prompt at a time (the worker's "sequential", with per-prompt counters)
unless `--batched` (all at once, as the check sends them); prefix caching off (a CPU build's hybrid targets need it
off). A parting's gap is eval/partings.py's, the target read by transformers in `--dtype`, and again from vLLM's raw
logits at the common prefix. One JSON object on stdout (and in --out): the plain outputs, and per method its
counters and each prompt's output, counters and parting.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.names import names_of  # noqa: E402
from benchmarks.vllm_probe import add_vllm_python  # noqa: E402

EVAL_DATA = "demo/data/eval.jsonl.gz"
PROMPTS_PER_DOMAIN, MAX_LENGTH, MAX_NEW = 3, 192, 48  # benchmarks/target_matrix.py's check settings
# the methods --methods takes: vLLM's own proposers, and the oracle proposer drafting the target's tokens (none wrong,
# or the first draft of each step wrong: vllm_oracle_proposer.py)
METHODS = ("ngram", "suffix", "mtp", "oracle", "oracle_reject")
LOOKUP_MIN, LOOKUP_MAX = 1, 4  # n-gram: draft from any single-token match, so that it drafts often
# Run by the vLLM Python: its own plain logits (raw, bfloat16 computed) of two tokens after each given context, and
# the largest of its top 100 (a parting's scale), one JSON line.
VLLM_LOGITS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
asks = json.loads(sys.argv[3])
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=max(len(c) for c, _ in asks) + 8,
          enable_prefix_caching=False, logprobs_mode="raw_logits", max_logprobs=100)
params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=100)
rows = []
for context, tokens in asks:
    top = llm.generate([TokensPrompt(prompt_token_ids=context)], params, use_tqdm=False)[0].outputs[0].logprobs[0]
    rows.append({"logits": [top[t].logprob if t in top else None for t in tokens],
                 "largest": max(abs(p.logprob) for p in top.values())})
print("LOGITS", json.dumps(rows))
"""


def vllm_own_gaps(args, prompts: list[list[int]], plain: list[list[int]], rows: list[dict], unit: float) -> None:
    """Each parting's gap in vLLM's own plain logits as well (`vllm_units`, at the scale of its largest): its output
    parts from transformers' early on this target, so transformers' logits may not show vLLM's near ties."""
    from benchmarks.vllm_probe import ask_vllm
    from draftsmith.eval.partings import NEAR_TIE_UNITS

    parted = [r for r in rows if "tokens" in r.get("parting", {})]
    asks = [
        [prompts[r["prompt"]] + plain[r["prompt"]][: r["parting"]["position"]], r["parting"]["tokens"]] for r in parted
    ]
    if not asks:
        return
    answers = ask_vllm(args.vllm_python, VLLM_LOGITS, "LOGITS", str(args.target), args.dtype, json.dumps(asks))
    for row, answer in zip(parted, answers):
        drafted, alone = answer["logits"]
        if drafted is None or alone is None:  # one of the two is not among vLLM's top 100: far from a tie
            row["parting"]["vllm_units"] = None
            continue
        units = abs(drafted - alone) / (unit * answer["largest"])
        row["parting"] |= {"vllm_gap": round(abs(drafted - alone), 5), "vllm_units": round(units, 2),
                           "vllm_near_tie": units <= NEAR_TIE_UNITS}  # fmt: skip


def ask_worker(python: str, request: dict, env: dict) -> dict:
    """vLLM's reply to the "runs" `request`, from a worker of its own with `env` (one OpenMP thread)."""
    from draftsmith.engines import VllmWorker
    from draftsmith.errors import EXIT_UNAVAILABLE, EngineUnavailable

    worker = VllmWorker(python, "--vllm-python", env={"OMP_NUM_THREADS": "1", **env}, show_log=False)
    try:
        return worker.ask({"runs": request}, "run the target with and without speculation")
    except EngineUnavailable as err:  # n-gram and suffix decoding on a CPU build's hybrid target: one line
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_UNAVAILABLE)  # the engine's code, as draftsmith's commands exit with it
    finally:
        worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_vllm_python(parser)
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--methods", type=names_of(METHODS), default="ngram,suffix")
    parser.add_argument(
        "--batched",
        action="store_true",
        help="every prompt at once, as the export check sends them (no per-prompt counters)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.eval.partings import parting, rounding_unit
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.export.free_methods import ngram_config, suffix_config

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    by_domain = load_prompts([str(REPO / EVAL_DATA)], tokenizer, PROMPTS_PER_DOMAIN, MAX_LENGTH)
    checked = [prompt for domain in by_domain.values() for prompt in domain]
    prompts = checked + [prompt + prompt for prompt in checked]
    configs: dict = {
        "ngram": {**ngram_config(args.gamma), "prompt_lookup_min": LOOKUP_MIN, "prompt_lookup_max": LOOKUP_MAX},
        # a tree as deep as γ: at vLLM's default depth (24) the CPU build's Gated-DeltaNet verify fails on these
        # prompts (RuntimeError: The size of tensor a (27) must match the size of tensor b (26), gdn_attention.py)
        "suffix": {
            **suffix_config(0),
            "num_speculative_tokens": args.gamma,
            "suffix_decoding_max_tree_depth": args.gamma,
        },
        # the target's own MTP layer (`--target` a folder with one: heads/mtp_random_layer.write_random_layer), γ
        # drafts every step as a drafter of draftsmith's; a random layer's are nearly all rejected
        "mtp": {"method": "mtp", "num_speculative_tokens": args.gamma},
    }
    methods = args.methods
    oracles = {"oracle": None, "oracle_reject": 1}  # vllm_oracle_proposer.py's wrong_at: none, or draft 1 of each step
    runs = [{"name": "plain", "speculative_config": None}]
    # the n-gram proposer leaves the worker unable to start another engine: its run goes last
    ordered = sorted((m for m in methods if m not in oracles), key=lambda m: m == "ngram")
    runs += [{"name": m, "speculative_config": configs[m]} for m in ordered]
    request = {
        "target": str(args.target), "prompts": prompts, "max_tokens": MAX_NEW, "dtype": args.dtype,
        "max_model_len": max(map(len, prompts)) + MAX_NEW + 8, "enable_prefix_caching": False,
        "sequential": not args.batched, "runs": runs,
    }  # fmt: skip
    engine = ask_worker(args.vllm_python, request, {})
    with tempfile.TemporaryDirectory() as scratch:
        for method in (m for m in methods if m in oracles):  # drafts: the plain run's outputs
            drafts = Path(scratch) / f"{method}.json"
            known = {"prompts": prompts, "outputs": engine["runs"]["plain"]["outputs"], "wrong_at": oracles[method]}
            drafts.write_text(json.dumps(known))
            configs[method] = {"method": "custom_class", "model": "vllm_oracle_proposer.OracleProposer",
                               "num_speculative_tokens": args.gamma}  # fmt: skip
            run = {"name": method, "speculative_config": configs[method]}
            env = {"ORACLE_DRAFTS": str(drafts), "PYTHONPATH": str(REPO / "benchmarks")}
            engine["runs"] |= ask_worker(args.vllm_python, {**request, "runs": [run]}, env)["runs"]

    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).eval()
    model.config.num_nextn_predict_layers = 0  # transformers reads no MTP layer: the target alone
    unit = rounding_unit(model.dtype) or torch.finfo(torch.bfloat16).eps / 2
    plain = engine["runs"]["plain"]["outputs"]
    result = {"target": str(args.target), "vllm_version": engine["vllm_version"], "dtype": args.dtype,
              "gamma": args.gamma, "prompts": len(prompts), "max_new_tokens": MAX_NEW, "plain": plain,
              "methods": {}}  # fmt: skip
    for method in methods:
        run = engine["runs"][method]
        rows = []
        for index, (prompt, alone, drafted) in enumerate(zip(prompts, plain, run["outputs"])):
            row = {"prompt": index, "output": drafted}
            if not args.batched:
                row["counters"] = run["per_prompt"][index]["metrics"]
            if drafted != alone:
                row["parting"] = parting(model, prompt, alone, drafted, unit)
            rows.append(row)
        far = [r for r in rows if "parting" in r and not r["parting"]["near_tie"]]
        result["methods"][method] = {
            "config": configs[method],
            "counters": run["metrics"],
            "engine_settings": run["engine_settings"],
            "parted": sum("parting" in r for r in rows),
            "parted_beyond_near_tie": len(far),
            "rows": rows,
        }
    vllm_own_gaps(args, prompts, plain, [r for m in result["methods"].values() for r in m["rows"]], unit)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
