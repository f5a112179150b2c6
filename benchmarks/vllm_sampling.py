"""Run by vLLM's environment's Python (by benchmarks/vllm_sampled_exactness.py, and by the engine tests through
helpers.vllm_script): one prompt sampled ROWS times,
MAX_TOKENS new tokens each, at TEMPERATURE, by vLLM with the folder's speculative config (the first token is the
prefill's, drawn as without the drafter); the sampled sequences counted, written as JSON to OUT.

    python vllm_sampling.py TARGET SPECULATIVE_CONFIG_JSON PROMPT_JSON ROWS MAX_TOKENS TEMPERATURE OUT [--mended]

`--mended`: with the CPU build's stand-in for the Triton kernel that spreads each request's
sampling settings over its draft positions (`vllm.utils.cpu_triton_utils._expand_kernel_impl`) replaced, before the
engine registers it, by one that writes the caller's tensor in its own dtype. The output also says whether the stand-in
registered writes a float tensor (`expand_writes_floats`: vllm-project/vllm#55005 is that the build's does not)."""

import collections
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: the mend reaches it
import torch  # noqa: E402
import vllm  # noqa: E402
import vllm.utils.cpu_triton_utils as cpu_kernels  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


def expand_in_own_dtype(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """What the Triton kernel does: each request's value repeated over its tokens, `replace_from` read as
    `replace_to`, written into `output` itself."""
    per_request = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output.copy_(values.repeat_interleave(per_request, output_size=output.numel()))


def sampled(llm: LLM, prompt: list[int], rows: int, max_tokens: int, temperature: float) -> dict[str, int]:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * rows, params, use_tqdm=False)
    sequences = collections.Counter(tuple(output.outputs[0].token_ids) for output in outputs)
    return {json.dumps(list(tokens)): n for tokens, n in sequences.items()}


def accepted(llm: LLM) -> int:
    return next(int(m.value) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens")


def expand_writes_floats() -> bool:
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    spread = expand_batch_to_tokens(torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 3)
    return torch.equal(spread, torch.tensor([0.5, 2.0, 2.0]))


def main() -> None:
    target, speculative, prompt, rows, max_tokens, temperature, out = sys.argv[1:8]
    mended = "--mended" in sys.argv[8:]
    if mended:
        cpu_kernels._expand_kernel_impl = expand_in_own_dtype
    prompt, rows, max_tokens, temperature = json.loads(prompt), int(rows), int(max_tokens), float(temperature)
    engine = dict(model=target, dtype="float32", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
                  seed=0, gpu_memory_utilization=0.3, disable_log_stats=False)  # fmt: skip
    llm = LLM(**engine, speculative_config=json.loads(speculative))
    result = {"vllm_version": vllm.__version__, "expand_writes_floats": expand_writes_floats()}  # stand-ins registered
    result["speculative"] = sampled(llm, prompt, rows, max_tokens, temperature)
    result["accepted"] = accepted(llm)
    with open(out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
