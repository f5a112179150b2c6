"""vLLM's hidden-states extraction as draftsmith's capture runs it (`data.capture.engine=vllm`, on every build of
vLLM 0.32), in vLLM's environment, beside vllm_worker.py: the connector the engine loads by module name
(`kv_connector_module_path`), and the worker's "capture" request.

vLLM's `extract_hidden_states` method keeps the target's states at the asked layers in a cache of their own, and its
`ExampleHiddenStatesConnector` writes a finished request's states to a safetensors file. That connector copies them
off the GPU through pinned memory on a CUDA stream, which a CPU build cannot allocate ("pin_memory=True requires a
CUDA or other accelerator backend"). `HiddenStatesConnector` leaves a GPU's copy to vLLM's own code and copies a CPU
cache's states to the file directly, in the engine's step: the same file, the same lock released when it is written.
"""

import os
import time

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    cleanup_hidden_states,
    extract_from_kv_cache,
    load_hidden_states,
)

STEPS_TO_WRITE = 100  # engine steps after a capture's generate() within which every prompt's states are written


class WrittenAlready:
    """What the connector's completion poll asks of a copy in flight (`query()`), for a file already written."""

    @staticmethod
    def query() -> bool:
        return True


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        lock = self._lock_fds.pop(pending.req_id, None)
        if lock is not None:
            os.close(lock)  # releases the reader's wait
        self._req_copy_events[pending.req_id] = WrittenAlready()


def capture(llm, request):
    """The worker's "capture" request (vllm_worker.py) on `llm`, an engine opened with extract_hidden_states and this
    connector (for `states`; without, any engine): one file a prompt, its states with the next-token top-k beside
    them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    k, states, directory = int(request["topk"]), bool(request["states"]), request["directory"]
    paths = [os.path.join(directory, f"{i}.safetensors") for i in range(len(request["prompts"]))]
    params = [
        SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=k or None,
            logprobs=k or None,
            detokenize=False,
            extra_args={"kv_transfer_params": {"hidden_states_path": path + ".engine"}} if states else None,
        )
        for path in paths
    ]
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in prompt]) for prompt in request["prompts"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    # generate() returns once the requests are answered; their states are handed to the connector by the engine's
    # next steps, which only a caller drives when the engine runs in this process
    written = [output.kv_transfer_params["hidden_states_path"] for output in outputs] if states else []
    for _ in range(STEPS_TO_WRITE):
        if all(os.path.exists(path) for path in written):
            break
        llm.llm_engine.step()
    else:
        raise RuntimeError(f"vLLM's connector wrote no states within {STEPS_TO_WRITE} engine steps")
    for output, path in zip(outputs, paths):
        with_top_k(output, path, k, states)
    return {"files": paths, "seconds": time.perf_counter() - start}


def top_entries(logprobs, k):
    """One position's K most likely tokens from vLLM's logprobs there ({token id: Logprob}, K entries and the token
    that came, ranked), best first."""
    ranked = sorted(logprobs.items(), key=lambda item: (item[1].rank, -item[1].logprob))[:k]
    return [token for token, _ in ranked], [entry.logprob for _, entry in ranked]


def with_top_k(output, path, k, states):
    """One prompt's file: its tokens, the connector's states (with `states`: read once its writer's lock is free), and
    the next-token top-k beside them. vLLM's prompt logprobs at position t are of token t given the tokens before it:
    position t's next token is entry t + 1, and the last position's is the one generated token's."""
    if states:
        written = output.kv_transfer_params["hidden_states_path"]
        tensors = load_hidden_states(written)  # its token_ids too
        cleanup_hidden_states(written)
    else:
        tensors = {"token_ids": torch.tensor(output.prompt_token_ids)}
    if k:
        positions = [*output.prompt_logprobs[1:], output.outputs[0].logprobs[0]]
        ids, logprobs = zip(*(top_entries(entries, k) for entries in positions))
        tensors["topk_ids"] = torch.tensor(ids, dtype=torch.int32)
        tensors["topk_logprobs"] = torch.tensor(logprobs, dtype=torch.float32)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, path)
