"""Why vLLM-CPU's plain output differs from transformers' on an MLA target (DeepSeek-V3): the rotary
embedding, measured by next-token log-probabilities on short prompts.

    python benchmarks/vllm_mla_rope.py --vllm-python /path/to/vllm-venv/bin/python
        [--family deepseek_v3] [--out docs/results/vllm_mla_rope.json]

A tiny random-weight target of the family (draftsmith.random_target, as the family tests build it) is
loaded in float32 by transformers and by vLLM (plain decoding, eager); for each prompt the top-5 next
tokens and their log-probabilities are read from both, and from transformers once more with the
family's rotary embedding replaced by the identity (the model module's `apply_rotary_pos_emb*`
functions). A one-token prompt sits at position 0, where rotation is the identity: any difference there
is not the rotary embedding's. Each row: the prompt, the three top-5 lists, and the largest difference
of vLLM's log-probabilities from each transformers reading over vLLM's top 5. Nothing downloads.
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

PROMPTS = [[504], [1, 504], [22, 33], [1, 504, 3384, 314, 260, 1345]]

# Run by the vLLM Python: the top-5 next tokens of each prompt, one JSON line.
VLLM_TOP5 = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True)
params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
rows = []
for prompt in json.loads(sys.argv[2]):
    logprobs = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0].logprobs[0]
    rows.append(sorted(([int(t), float(p.logprob)] for t, p in logprobs.items()), key=lambda row: -row[1])[:5])
print("TOP5", json.dumps(rows))
"""


def transformers_top5(directory: Path, rotary: bool) -> tuple[list[list[list[float]]], list[str]]:
    """The top-5 of every prompt, and the names of the rotary functions (replaced when not `rotary`)."""
    import importlib

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    module = importlib.import_module(type(model).__module__)
    saved = {name: getattr(module, name) for name in dir(module) if name.startswith("apply_rotary_pos_emb")}
    if not rotary:
        for name in saved:
            setattr(module, name, lambda q, k, *args, **kwargs: (q, k))
    try:
        rows = []
        with torch.no_grad():
            for prompt in PROMPTS:
                logprobs = model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
                top = logprobs.topk(5)
                rows.append([[int(t), float(p)] for t, p in zip(top.indices, top.values)])
        return rows, sorted(saved)
    finally:
        for name, function in saved.items():
            setattr(module, name, function)


def largest_difference(vllm: list[list[float]], logprobs: list[list[float]]) -> float | None:
    """Over vLLM's top 5: |vLLM's log-probability - the other's|, where the other lists the token too."""
    other = dict((int(t), p) for t, p in logprobs)
    shared = [abs(p - other[int(t)]) for t, p in vllm if int(t) in other]
    return round(max(shared), 5) if shared else None


def main() -> None:
    from benchmarks.provenance import provenance
    from benchmarks.vllm_probe import add_vllm_python, ask_vllm, vllm_version_or_exit

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_vllm_python(parser)
    parser.add_argument("--family", default="deepseek_v3")
    parser.add_argument("--out", type=Path, default=REPO / "docs/results/vllm_mla_rope.json")
    args = parser.parse_args()
    began = time.perf_counter()

    from draftsmith.random_target import demo_tokenizer_dir, write_random_target

    version = vllm_version_or_exit(args.vllm_python)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_random_target(args.family, Path(tmp) / "target", seed_from=demo_tokenizer_dir())
        rotated, functions = transformers_top5(directory, rotary=True)
        unrotated, _ = transformers_top5(directory, rotary=False)
        served = ask_vllm(args.vllm_python, VLLM_TOP5, "TOP5", str(directory), json.dumps(PROMPTS))
    rows = [
        {
            "prompt": prompt,
            "vllm": top,
            "transformers": hf,
            "transformers_without_rotary": bare,
            "largest_difference": largest_difference(top, hf),
            "largest_difference_without_rotary": largest_difference(top, bare),
        }
        for prompt, top, hf, bare in zip(PROMPTS, served, rotated, unrotated)
    ]
    result = {
        "family": args.family,
        "vllm": version,
        "rotary_functions_replaced": functions,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result |= provenance(None, began)  # vLLM's threads and transformers' as each chose them
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({row_key: [row[row_key] for row in rows] for row_key in
                      ("largest_difference", "largest_difference_without_rotary")}))  # fmt: skip


if __name__ == "__main__":
    main()
