"""A long-lived vLLM generation worker: one engine, many batches (data_prep.regenerate's vllm engine).

Runs with the Python of an environment that has vLLM (never draftsmith's): it imports only the
standard library, vllm and its sibling vllm_run.py. Protocol, one JSON object a line:

    stdin  line 1: {"engine": {LLM keyword arguments: model, dtype, max_model_len, ...}}
    stdout line 1: {"ok": true, "vllm_version": "..."}            (the engine is up)
    stdin  line n: {"prompts": [[token ids], ...], "max_tokens": N, "temperature": T, "top_p": P, "seeds": [int, ...]}
    stdout line n: {"ok": true, "outputs": [[token ids], ...], "finish_reasons": [...], "seconds": S}

Prompts go in as token ids and answers come back as token ids, so the chat template and the
decoding are draftsmith's own, exactly as with transformers. Every prompt of a batch goes to
`LLM.generate` at once (continuous batching); each has its own seed, so sampled answers do not
depend on the batch they were in. End of stdin ends the worker, and so does the end of the job that
started it. Any failure is one line
{"ok": false, "error": ..., "error_lines": [...]} and exit code 1.
"""

import json
import os
import sys
import time
import traceback

from vllm_run import LogsToStderr, exit_with_parent  # this script's directory is first on sys.path


def serve(requests, reply):
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**json.loads(next(requests))["engine"])
    reply({"ok": True, "vllm_version": vllm.__version__})
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        params = [
            SamplingParams(
                temperature=float(request["temperature"]),
                top_p=float(request["top_p"]),
                max_tokens=int(request["max_tokens"]),
                seed=int(seed),
            )
            for seed in request["seeds"]
        ]
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in prompt]) for prompt in request["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        reply(
            {
                "ok": True,
                "outputs": [[int(t) for t in o.outputs[0].token_ids] for o in outputs],
                "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
                "seconds": time.perf_counter() - start,
            }
        )


def main():
    exit_with_parent()
    logs = LogsToStderr()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    def reply(message):
        logs.result_stream.write(json.dumps(message) + "\n")
        logs.result_stream.flush()

    code = 0
    try:
        serve(iter(sys.stdin.readline, ""), reply)
    except BaseException as err:  # noqa: BLE001 - everything is reported as JSON
        code = 1
        logs.close()
        reply(
            {
                "ok": False,
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(),
                "error_lines": logs.error_lines[-8:],
            }
        )
    os._exit(code)  # engine threads can hang interpreter teardown


if __name__ == "__main__":  # vLLM starts engine processes with spawn, which re-imports this module
    main()
