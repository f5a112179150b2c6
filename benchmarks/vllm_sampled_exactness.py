"""Does vLLM sample an export's speculative requests from the target's own distribution: one prompt sampled --rows
times at --temperature by vLLM serving the folder as its card says (the `vllm serve` line of its README: the target,
the speculative config), the first two new tokens counted, and Pearson's chi-square of the counts against the
target's exact distribution computed by transformers (the first token is the prefill's, drawn as without a drafter:
the control; the second is the first one a draft is verified for).

    python benchmarks/vllm_sampled_exactness.py --vllm-python /path/to/vllm-venv/bin/python --folder EXPORT
        [--data demo/data/eval.jsonl.gz] [--rows 2000] [--temperature 0.8] [--as-shipped] [--out FILE]

The prompt is the first conversation of --data: its first user turn through the target's chat template, then the
first 6 tokens of its answer, text the drafter was trained on, so that drafts are accepted as well as rejected.
vLLM's CPU build 0.32 samples speculative requests wrongly (vllm-project/vllm#55005): by default the engine-side
script (benchmarks/vllm_sampling.py) mends its kernel stand-in first; `--as-shipped` samples the build as installed.
The engine runs the target in float32 with a 256-token context (tiny targets). One JSON object on stdout (and
appended to --out): the folder, method, vLLM version, draws, accepted draft tokens, the p-values, and where the
numbers came from (benchmarks/provenance.py).
Exit 2: not an export folder, no --data, no vLLM at --vllm-python; 3: vLLM failed while sampling.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.provenance import provenance  # noqa: E402
from benchmarks.vllm_probe import add_vllm_python, vllm_version_or_exit  # noqa: E402
from draftsmith.errors import EXIT_CHECK_FAILED, EXIT_USER_ERROR  # noqa: E402

ENGINE_SCRIPT = REPO / "benchmarks" / "vllm_sampling.py"
ANSWER_TOKENS = 6


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test with the cells expected to hold fewer than 5 samples pooled into one."""
    from scipy import stats  # 1.5 s of import: not in the collection of every test module that imports this one

    probs = probs.flatten().double()
    counts, expected = counts.flatten().double(), probs / probs.sum() * counts.sum()  # float32 rounding
    if counts[expected == 0].sum() > 0:  # a sequence the target can never produce
        return 0.0
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    return float(stats.chisquare(observed[keep].numpy(), expected[keep].numpy()).pvalue)


def two_token_pvalues(model, prompt: list[int], temperature: float, sampled: dict[str, int]) -> dict[str, float]:
    """Chi-square p-values of two-token draws (`sampled`: JSON token lists -> counts) against `model`'s exact
    distribution at `temperature`: of the first token, of the second (the first a draft is verified for) and of both."""
    with torch.no_grad():  # P(x1), and P(x2 | x1) for every x1
        first = (model(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)
        rows = torch.cat([torch.tensor(prompt).expand(len(first), -1), torch.arange(len(first))[:, None]], 1)
        second = torch.cat([(model(chunk).logits[:, -1] / temperature).softmax(-1) for chunk in rows.split(512)])
    joint = first[:, None] * second
    table = torch.zeros_like(joint)
    for tokens, n in sampled.items():
        table[tuple(json.loads(tokens))] += n
    return {"x1": chi_square_pvalue(table.sum(1), first), "x2": chi_square_pvalue(table.sum(0), joint.sum(0)),
            "x1 x2": chi_square_pvalue(table, joint)}  # fmt: skip


def engine_argv(target, speculative: dict, prompt: list[int], rows: int, temperature: float, out: Path, mended: bool):
    """The engine-side script's arguments: `rows` two-token draws (benchmarks/vllm_sampling.py)."""
    return [str(ENGINE_SCRIPT), str(target), json.dumps(speculative), json.dumps(prompt), str(rows), "2",
            str(temperature), str(out), *(["--mended"] if mended else [])]  # fmt: skip


def fail(code: int, line: str) -> None:
    print(f"error: {line}", file=sys.stderr)
    sys.exit(code)


def served_as_carded(folder: Path) -> tuple[str, dict]:
    """The target and the speculative config of the folder's `vllm serve` line (its README)."""
    readme = folder / "README.md"
    card = readme.read_text().splitlines() if readme.is_file() else []
    lines = [line for line in card if line.startswith("vllm serve ")]
    if len(lines) != 1:
        inside = f" (give {folder / 'vllm'}, the export's vLLM folder)" if (folder / "vllm").is_dir() else ""
        fail(
            EXIT_USER_ERROR,
            f"{folder} is not a vLLM export folder: its README.md has no one `vllm serve` line" + inside,
        )
    words = shlex.split(lines[0])
    return words[2], json.loads(words[words.index("--speculative-config") + 1])


def prompt_of(target: str, data: Path) -> list[int]:
    """The first conversation's first user turn, through the target's chat template, and its answer's first tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    with gzip.open(data, "rt") if data.suffix == ".gz" else data.open() as file:
        turns = json.loads(file.readline())["messages"]
    user = next(turn for turn in turns if turn["role"] == "user")
    answer = next(turn["content"] for turn in turns if turn["role"] == "assistant")
    text = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    return (tokenizer(text, add_special_tokens=False)["input_ids"]
            + tokenizer(answer, add_special_tokens=False)["input_ids"][:ANSWER_TOKENS])  # fmt: skip


def add_folder_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of the benchmarks that serve an export folder's sampled requests (this one's and
    benchmarks/vllm_sampled_acceptance.py's)."""
    add_vllm_python(parser)
    parser.add_argument("--folder", type=Path, required=True, help="a vLLM export folder")
    parser.add_argument("--data", type=Path, default=REPO / "demo" / "data" / "eval.jsonl.gz")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--as-shipped", action="store_true", help="the CPU build's kernel stand-in left as installed")
    parser.add_argument("--threads", type=int, default=1, help="vLLM's OpenMP threads and torch's here")
    parser.add_argument("--out", type=Path)


def served_folder(args: argparse.Namespace) -> tuple[str, dict, str]:
    """The folder's target and speculative config (its card's) and the vLLM version, or one line and exit 2; torch's
    threads set."""
    target, speculative = served_as_carded(args.folder)
    if not args.data.is_file():
        fail(EXIT_USER_ERROR, f"--data {args.data} is not a file")
    version = vllm_version_or_exit(args.vllm_python)
    torch.set_num_threads(args.threads)
    return target, speculative, version


def engine_env(threads: int) -> dict[str, str]:
    """The vLLM Python's environment: the engine in its process (the stand-in's mend reaches it), a KV cache for tiny
    targets, `threads` OpenMP threads unbound."""
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}  # fmt: skip


def emit(row: dict, out: Path | None) -> None:
    print(json.dumps(row))
    if out:
        with out.open("a") as file:
            file.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_folder_arguments(parser)
    parser.add_argument("--rows", type=int, default=2000)
    args = parser.parse_args()
    began = time.perf_counter()
    target, speculative, _ = served_folder(args)
    from draftsmith.target import load_target

    prompt = prompt_of(target, args.data)
    with tempfile.TemporaryDirectory() as scratch:  # the counts, beside neither the folder nor --out
        counts = Path(scratch) / "counts.json"
        argv = engine_argv(target, speculative, prompt, args.rows, args.temperature, counts, not args.as_shipped)
        done = subprocess.run([args.vllm_python, *argv], capture_output=True, text=True, env=engine_env(args.threads))
        if done.returncode != 0:
            fail(EXIT_CHECK_FAILED, f"vLLM did not sample: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
        engine = json.loads(counts.read_text())
    row = {
        "folder": str(args.folder), "method": speculative.get("method"), "vllm": engine["vllm_version"],
        "kernel_stand_in": "as shipped" if args.as_shipped else "mended",
        "stand_in_writes_floats": engine["expand_writes_floats"], "temperature": args.temperature, "draws": args.rows,
        "accepted": engine["accepted"], "distinct_pairs": len(engine["speculative"]),
        "pvalues": two_token_pvalues(load_target(target), prompt, args.temperature, engine["speculative"]),
    } | provenance(args.threads, began)  # fmt: skip
    emit(row, args.out)


if __name__ == "__main__":
    main()
