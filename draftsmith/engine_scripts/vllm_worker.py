"""The vLLM worker: the real vLLM engine in a process of its own, answering draftsmith's requests
(its client is draftsmith.engines.VllmWorker).

Runs with the Python of an environment that has vLLM (never draftsmith's): it imports only the
standard library, vllm and (to write captured states) vLLM's own torch and safetensors, so vLLM's pinned torch and
transformers never meet draftsmith's. This folder is first on its sys.path, as on the engine processes vLLM spawns:
the engine loads draftsmith's hidden-states connector from it by module name.

    <vllm python> vllm_worker.py        (one JSON request a line on stdin, one JSON reply a line on stdout)

A request is an object with one key, the name of what it asks for, whose value holds its arguments:

- {"open": {LLM keyword arguments: model, dtype, max_model_len, ...}} starts the worker's long-lived
  engine for the "generate" requests after it, the one an earlier "open" started shut down first (as a "runs"
  request shuts it down: one worker serves engine after engine). Reply: {"ok": true, "vllm_version": "..."}.
- {"generate": {"prompts": [[token ids], ...], "max_tokens": N, "temperature": T, "top_p": P, "seeds":
  [int, ...]}} answers one batch on that engine (data_prep.regenerate). Reply: {"ok": true, "outputs":
  [[token ids], ...], "finish_reasons": [...], "seconds": S}. Prompts and answers are token ids, so the
  chat template and the decoding are draftsmith's own; every prompt of a batch goes to `LLM.generate`
  at once (continuous batching), each with its own seed, so sampled answers do not depend on the batch
  they were in.
- {"capture": {"prompts": [[token ids], ...], "topk": K, "states": S, "directory": DIR}} the target's states over
  each prompt on that engine, opened (for S true) with vLLM's `extract_hidden_states` method and draftsmith's
  connector (hidden_states.py, which answers it; data_prep/capture_vllm.py opens it): one safetensors file a prompt,
  DIR/{i}.safetensors, holding `token_ids` [T], with S `hidden_states` [T, layers, H] and, when K > 0, the target's K
  most likely next tokens at every position, `topk_ids` [T, K] (int32) and `topk_logprobs` [T, K] (float32,
  log-softmax of the raw logits, best first). Reply: {"ok": true, "files": [path, ...], "seconds": S}.
- {"close": {}} shuts that engine down, the worker kept for later requests. Reply: {"ok": true}.
- {"served_as": {"config": {config.json's fields}}} how this vLLM reads a draft folder with that config.json, no
  engine started (draft_config.py). Reply: {"ok": true, "read": {"written", "served" or "error"} or null}.
- {"runs": {"target": DIR, "prompts": [[token ids], ...], "max_tokens": N, "dtype": "float32",
  "max_model_len": N, "gpu_memory_utilization": 0.3, "runs": [{"name": ..., "speculative_config": null
  | {...}}, ...]}} greedy generation with and without a drafter, each run in an engine of its own that
  is shut down after it, with vLLM's spec-decode counters (the export check, export/verify.py).
  Optional: "enable_prefix_caching": false (a target with recurrent layers on a CPU build, whose prefix-caching
  "align" path for speculative decoding is a Triton kernel), "disable_hybrid_kv_cache_manager": true (a folder
  that says so: formats/repo.py's EngineRepo.engine_arguments), "warmup": N (untimed generations first) and
  "load": [{"concurrency": C, "prompts": [[ids], ...]}, ...] (instead of "prompts": a closed loop per level, C
  requests in flight until the level's prompts are done, as "levels": [{"concurrency", "outputs", "seconds",
  "tokens", "steps", "mean_batch", "tpot_s": [per request], "metrics"}]), the load sweep (export/sweep.py);
  "sequential": true (batch size 1: one prompt at a time, each timed and counted, as "per_prompt": [{"seconds",
  "tokens", "metrics"}]), which only the benchmarks' per-prompt timings send. Reply: {"ok": true,
  "vllm_version": ..., "runs": {name: {"outputs": [[ids]], "finish_reasons": [...], "metrics": {"num_drafts",
  "num_draft_tokens", "num_accepted_tokens", "accepted_per_position"}, "seconds": {...}, "engine_settings": {what
  the engine resolved: runner, max_num_seqs and, when speculating, method, num_speculative_tokens, the batch-size
  schedule, draft_sample_method, rejection_sample_method}}}}.

A failed request is answered {"ok": false, "error": ..., "traceback": ..., "error_lines": [...]} and
ends the worker with exit code 1: an engine that failed may hold half-freed state, so the next request
gets a fresh process. A "runs" request whose engine left this process unable to start another (vLLM's
n-gram proposer: `SPENT_BY`) is answered with "ended": true, and the worker then ends (exit code 0): the
next request needs a fresh process too (and a later run of the same request fails: the load sweep sends one
run a request). The end of stdin ends the worker (exit code 0), and so does the end of the
process that started it. The worker stays up between requests, so a program that checks several
exports (a test session, a benchmark) imports vLLM once.

vLLM writes its logs to stdout (also from the engine processes it spawns), so file descriptors 1
and 2 are routed through a pipe to the real stderr and the replies go to a saved copy of stdout.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): on a small CPU machine it
starts about 4x faster. Its OpenMP threads (OMP_NUM_THREADS) are the caller's to choose.
"""

import gc
import json
import os
import re
import sys
import threading
import time
import traceback

import draft_config  # draftsmith's, beside this script (the standard library alone)

COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
# A module whose import leaves this process unable to start another engine: vLLM's n-gram proposer imports numba,
# and with it llvmlite's library handle, which answers every attribute (`__dict__` too) with a wrapped C function;
# vLLM 0.32's CPU build, starting an engine, scans every loaded module's objects for Triton kernels to override, and
# fails on it ("AttributeError: '_lib_fn_wrapper' object has no attribute 'get'").
SPENT_BY = "llvmlite.binding.ffi"
ERROR_LINE = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")


class LogsToStderr:
    """fd 1 and 2 (inherited by vLLM's subprocesses) into a pipe copied to the real stderr; error
    lines are kept, since an engine subprocess's root cause appears only in its log."""

    def __init__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.result_stream = os.fdopen(os.dup(1), "w", buffering=1)
        self.stderr_fd = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        self.error_lines = []
        self.thread = threading.Thread(target=self.pump, args=(read_end,), daemon=True)
        self.thread.start()

    def pump(self, read_end):
        pending = b""
        while True:
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            os.write(self.stderr_fd, chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                found = ERROR_LINE.search(line.decode("utf-8", "replace"))
                if found and found.group(0).strip() not in self.error_lines:
                    self.error_lines.append(found.group(0).strip())

    def close(self):
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.stderr_fd, 1)
        os.dup2(self.stderr_fd, 2)
        self.thread.join(timeout=3.0)


def spec_counters(llm):
    """The spec-decode counters, summed over engines (labels model_name, engine)."""
    from vllm.v1.metrics.reader import Counter, Vector

    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS and isinstance(metric, Counter):
            totals[COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POSITION and isinstance(metric, Vector):
            per_position = totals["accepted_per_position"]
            per_position += [0] * (len(metric.values) - len(per_position))
            for position, value in enumerate(metric.values):
                per_position[position] += int(value)
    return totals


def settled_counters(llm):
    """The counters once the last step's stats have landed (they may come a moment after generate() returns)."""
    after = spec_counters(llm)
    for _ in range(10):
        time.sleep(0.05)
        again = spec_counters(llm)
        if again == after:
            break
        after = again
    return after


def difference(after, before):
    out = {key: after[key] - before[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    earlier = before["accepted_per_position"] + [0] * len(after["accepted_per_position"])
    out["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"], earlier)]
    return out


def measured_run(request, speculative_config):
    """One run of a "runs" request, in an engine of its own: its outputs, counters and timings."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    seconds = {}
    start = time.perf_counter()
    kwargs = {
        "model": request["target"],
        "dtype": request.get("dtype", "float32"),
        "enforce_eager": True,
        "gpu_memory_utilization": float(request.get("gpu_memory_utilization", 0.3)),
        "max_model_len": int(request.get("max_model_len", 1024)),
        "seed": 0,
        "disable_log_stats": False,  # LLM.get_metrics() needs the stat loggers
        "trust_remote_code": bool(request.get("trust_remote_code", False)),
    }
    for switch in ("enable_prefix_caching", "disable_hybrid_kv_cache_manager"):
        kwargs |= {switch: bool(request[switch])} if switch in request else {}
    if request.get("language_model_only"):
        kwargs["language_model_only"] = True
    if "hf_overrides" in request:
        kwargs["hf_overrides"] = dict(request["hf_overrides"])
    if speculative_config is not None:
        kwargs["speculative_config"] = dict(speculative_config)
    load = request.get("load")
    if load:
        kwargs["max_num_seqs"] = max(int(level["concurrency"]) for level in load)
    settle_heap()
    llm = LLM(**kwargs)
    seconds["construct"] = time.perf_counter() - start
    sampling = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]))
    short = SamplingParams(temperature=0.0, max_tokens=8)
    for _ in range(int(request.get("warmup", 0))):  # untimed: lazy initialisation stays out of the figures
        if load:  # at every level's batch size: each compiles its own paths lazily
            for level in load:
                closed_loop(
                    llm,
                    {"concurrency": level["concurrency"], "prompts": level["prompts"][: int(level["concurrency"])]},
                    short,
                )
        else:  # the first prompt's first token: suffix decoding's trees keep its answer, no measured prompt's
            llm.generate([TokensPrompt(prompt_token_ids=request["prompts"][0][:1])], short, use_tqdm=False)
    if load:
        result = {
            "levels": [closed_loop(llm, level, sampling) for level in load],
            "engine_settings": engine_settings(llm),
        }
        shut_down(llm)
        return result
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in request["prompts"]]
    before = spec_counters(llm)
    start = time.perf_counter()
    if request.get("sequential"):  # batch size 1: each prompt alone, timed and counted on its own
        outputs, per_prompt = [], []
        for prompt in prompts:
            counted = settled_counters(llm)  # settled before the clock starts: its waits are not timed
            begin = time.perf_counter()
            outputs += llm.generate([prompt], sampling, use_tqdm=False)
            per_prompt.append({"seconds": time.perf_counter() - begin, "tokens": len(outputs[-1].outputs[0].token_ids)})
            per_prompt[-1]["metrics"] = difference(settled_counters(llm), counted)
    else:
        outputs, per_prompt = llm.generate(prompts, sampling, use_tqdm=False), None
    seconds["generate"] = time.perf_counter() - start
    result = {
        "outputs": [[int(t) for t in o.outputs[0].token_ids] for o in outputs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
        "metrics": difference(settled_counters(llm), before),
        "seconds": seconds,
    }
    if per_prompt is not None:
        result["per_prompt"] = per_prompt
    result["engine_settings"] = engine_settings(llm)
    shut_down(llm)
    return result


def settle_heap():
    """Before an engine starts: collect this process's garbage, then freeze what is left (vLLM's modules,
    this worker's state). vLLM runs full collections as an engine starts (five in 0.32) and as it shuts
    down (two), and a collection skips frozen objects: about 0.3 s each on a 2-core machine."""
    gc.collect()
    gc.freeze()


def shut_down(llm):
    """The engine's memory back before the next run's engine sizes its KV cache from what is free. vLLM's
    shutdown unfreezes the heap before it collects; it stays frozen here, so the collections walk only
    what the engine left (`settle_heap`)."""
    unfreeze, gc.unfreeze = gc.unfreeze, lambda: None
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort
        pass
    finally:
        gc.unfreeze = unfreeze


def closed_loop(llm, level, sampling):
    """One load level: `concurrency` requests in flight (a new one enters as one finishes) until the
    level's prompts are done, stepping the engine directly so every token's arrival is timed.
    Time per output token of a request = (last token's arrival - first's) / (tokens - 1)."""
    from vllm.inputs import TokensPrompt

    engine, concurrency = llm.llm_engine, int(level["concurrency"])
    waiting = list(enumerate(level["prompts"]))[::-1]
    index_of, first, last, outputs = {}, {}, {}, [None] * len(waiting)
    steps = served = 0
    counted = settled_counters(llm)
    begin = time.perf_counter()
    while waiting or engine.has_unfinished_requests():
        while waiting and engine.get_num_unfinished_requests() < concurrency:
            index, prompt = waiting.pop()
            request_id = f"load-{concurrency}-{index}"  # outputs carry this id (the engine's own is another)
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), sampling)
            index_of[request_id] = index
        step_outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        served += len(step_outputs)
        for output in step_outputs:
            if output.outputs and output.outputs[0].token_ids:
                first.setdefault(output.request_id, now)
                last[output.request_id] = now
            if output.finished:
                outputs[index_of[output.request_id]] = [int(t) for t in output.outputs[0].token_ids]
    seconds = time.perf_counter() - begin
    tpot = [
        (last[rid] - first[rid]) / (len(outputs[index]) - 1)
        for rid, index in index_of.items()
        if len(outputs[index]) > 1
    ]
    return {
        "concurrency": concurrency,
        "outputs": outputs,
        "seconds": seconds,
        "tokens": sum(map(len, outputs)),
        "steps": steps,
        "mean_batch": served / steps if steps else 0.0,
        "tpot_s": tpot,
        "metrics": difference(settled_counters(llm), counted),
    }


def engine_settings(llm):
    """What the engine resolved from its arguments: the settings that move τ or the schedule."""
    from vllm.platforms import current_platform

    config = llm.llm_engine.vllm_config
    settings = {"runner": current_platform.device_type, "max_num_seqs": config.scheduler_config.max_num_seqs}
    speculative = config.speculative_config
    if speculative is not None:
        schedule = speculative.num_speculative_tokens_per_batch_size
        settings |= {
            "method": speculative.method,
            "num_speculative_tokens": speculative.num_speculative_tokens,
            "num_speculative_tokens_per_batch_size": [list(map(int, entry)) for entry in schedule]
            if schedule
            else None,
            "draft_sample_method": speculative.draft_sample_method,
            "rejection_sample_method": speculative.rejection_sample_method,
        }
    return settings


def runs(request):
    """The "runs" request: each run in turn, one engine after another in this process."""
    import vllm

    result = {"vllm_version": vllm.__version__, "runs": {}}
    for run in request["runs"]:
        result["runs"][run["name"]] = measured_run(request, run.get("speculative_config"))
    if SPENT_BY in sys.modules:  # no later engine starts in this process: `main` ends it after the reply
        result["ended"] = True
    return result


class LongLivedEngine:
    """The "open" and "generate" requests: one engine kept between requests, until the next "open" or "runs"."""

    def __init__(self):
        self.llm = None

    def open(self, engine):
        import vllm

        self.close()
        settle_heap()
        self.llm = vllm.LLM(**engine)
        return {"vllm_version": vllm.__version__}

    def close(self):
        """The kept engine shut down, if any: an engine started next sizes its KV cache from the memory left free,
        and a frozen heap (`settle_heap`) would keep a dropped one's objects."""
        if self.llm is not None:
            shut_down(self.llm)
            self.llm = None

    def generate(self, batch):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                temperature=float(batch["temperature"]),
                top_p=float(batch["top_p"]),
                max_tokens=int(batch["max_tokens"]),
                seed=int(seed),
            )
            for seed in batch["seeds"]
        ]
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in prompt]) for prompt in batch["prompts"]]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return {
            "outputs": [[int(t) for t in o.outputs[0].token_ids] for o in outputs],
            "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
            "seconds": time.perf_counter() - start,
        }

    def capture(self, request):
        import hidden_states  # draftsmith's, beside this script

        return hidden_states.capture(self.llm, request)


def exit_with_parent():
    """A worker outlives its job only by a second: a killed job's engine must not go on using the machine."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main():
    exit_with_parent()
    logs = LogsToStderr()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = LongLivedEngine()

    def runs_alone(request):
        engine.close()  # each run's engine alone in this process, as its measurements assume
        return runs(request)

    def closed(arguments):
        engine.close()  # its memory free for what runs beside this process until the worker's next request
        return {}

    handlers = {
        "open": engine.open,
        "generate": engine.generate,
        "capture": engine.capture,
        "close": closed,
        "runs": runs_alone,
        "served_as": draft_config.served_as,
    }

    def reply(message):
        logs.result_stream.write(json.dumps(message) + "\n")
        logs.result_stream.flush()

    for line in iter(sys.stdin.readline, ""):
        if not line.strip():
            continue
        logs.error_lines.clear()
        try:
            request = json.loads(line)
            if len(request) != 1 or next(iter(request)) not in handlers:
                raise ValueError(f"a request names one of {sorted(handlers)}; this one has the keys {sorted(request)}")
            ((name, arguments),) = request.items()
            answer = handlers[name](arguments)
            reply({"ok": True, **answer})
        except BaseException as err:  # noqa: BLE001 - everything is reported as JSON
            logs.close()
            reply({"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(),
                   "error_lines": logs.error_lines[-8:]})  # fmt: skip
            os._exit(1)  # an engine that failed may hold half-freed state: the next request gets a fresh process
        if answer.get("ended"):
            break
    logs.close()
    os._exit(0)  # engine threads can hang interpreter teardown


if __name__ == "__main__":  # vLLM starts engine processes with spawn, which re-imports this module
    main()
