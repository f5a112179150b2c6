"""How vLLM 0.32 drafts with Gemma-4's assistant model (`gemma4_assistant`, served as `"method": "mtp"`):
which query position and which of the target's keys its draft steps use, measured against transformers.

    python benchmarks/vllm_gemma4_assistant.py --vllm-python /path/to/vllm-venv/bin/python
        [--out docs/results/vllm_gemma4_assistant.json]
        [--target demo/gemma4-target --assistant <an exported assistant's vllm/ folder>]

A tiny random-weight Gemma-4 target (draftsmith.random_target, seeded from the demo's weights) and a
random two-layer assistant (a sliding and a full-attention layer, transformers' own class and init) are
written to a temporary directory. vLLM decodes a prompt greedily with the assistant drafting 3 tokens a
step, and every proposal its proposer returns is recorded. transformers then computes the first two
proposals after each prompt from the same weights: the target's forward over the committed tokens gives
the last hidden state, the next token and the keys and values it shares (`return_shared_kv_states`); the
assistant drafts from them with its query at the position of that hidden state (p - 1) or of the token it
is fed (p), over the same keys, and at p - 1 with its sliding layer over the last `sliding_window` keys
only. Each row: vLLM's proposal and the three readings'. Nothing downloads.

With `--target` and `--assistant`, that pair instead (a trained assistant, whose sliding layer tells the two
window readings apart where a random one drafts the same tokens either way), on the prompts below and more
that cross the window.
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

# a short prompt, and one longer than the tiny target's sliding window (48 positions): which keys the
# assistant's sliding layer reads shows there
PROMPTS = [[1, 15, 200, 33, 7, 91, 404, 5], [1, *range(300, 360)]]
LONGER = [[1, *range(600, 700)], [1, *range(1000, 1130, 2)], [1, *range(2000, 2150, 3)]]  # with --assistant
GAMMA = 3

# Run by the vLLM Python: the decoded tokens and every proposal of the assistant, one JSON line.
VLLM_PROPOSALS = """
import json, sys
import vllm.v1.spec_decode.gemma4 as gemma4
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
proposals, propose = [], gemma4.Gemma4Proposer.propose
def recorded(self, *args, **kwargs):
    drafts = propose(self, *args, **kwargs)
    proposals.append(drafts[0].tolist())
    return drafts
gemma4.Gemma4Proposer.propose = recorded
speculative = {"method": "mtp", "model": sys.argv[2], "num_speculative_tokens": int(sys.argv[4])}
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True, speculative_config=speculative)
rows = []
for prompt in json.loads(sys.argv[3]):  # one at a time: a proposal is one request's
    proposals.clear()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0.0, max_tokens=4),
                       use_tqdm=False)[0].outputs[0]
    rows.append({"tokens": list(out.token_ids), "proposals": list(proposals)})
print("PROPOSALS", json.dumps(rows))
"""


def write_assistant(target: Path, directory: Path) -> None:
    """A random assistant for `target`: the target's text config with two layers (sliding, full) and no
    per-layer inputs (the assistant's config class refuses them)."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    values = json.loads((target / "config.json").read_text())
    own = ("architectures", "model_type", "transformers_version", "dtype")
    text = {key: value for key, value in values.items() if key not in own}
    full = max(i for i, kind in enumerate(values["layer_types"]) if kind == "full_attention")
    text.update(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, per_layer_config={"1": values.get("per_layer_config", {}).get(str(full), {})},
    )  # fmt: skip
    config = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**text), backbone_hidden_size=values["hidden_size"])
    config.architectures = ["Gemma4AssistantForCausalLM"]
    torch.manual_seed(0)
    Gemma4AssistantForCausalLM(config).save_pretrained(directory)


def transformers_proposals(target: Path, assistant: Path, committed: list[list[int]]) -> dict[str, list]:
    """The assistant's greedy proposal after each committed sequence, its query at the hidden state's
    position over every key the target shares, at that position over the sliding layer's last `window`
    keys only, and at the fed token's position."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    drafter = Gemma4AssistantForCausalLM.from_pretrained(assistant, dtype=torch.float32).eval()
    embed = model.get_input_embeddings()  # scales by sqrt(hidden), as vLLM's `normalizer` does
    window = model.config.sliding_window
    readings: dict[str, list] = {"query_at_hidden_position": [], "query_at_hidden_position_sliding_window": [],
                                 "query_at_token_position": []}  # fmt: skip
    with torch.no_grad():
        for tokens in committed:
            out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True, return_shared_kv_states=True)
            shared = dict(out.shared_kv_states.items())
            keys, values = shared["sliding_attention"]
            windowed = {**shared, "sliding_attention": (keys[:, :, -window:], values[:, :, -window:])}
            fed = out.logits[:, -1:].argmax(-1)
            for key, position, kv in (("query_at_hidden_position", len(tokens) - 1, shared),
                                      ("query_at_hidden_position_sliding_window", len(tokens) - 1, windowed),
                                      ("query_at_token_position", len(tokens), shared)):  # fmt: skip
                token, hidden, proposal = fed, out.hidden_states[-1][:, -1:], []
                for _ in range(GAMMA):
                    step = drafter(inputs_embeds=torch.cat([embed(token), hidden], -1), shared_kv_states=kv,
                                   position_ids=torch.tensor([[position]]))  # fmt: skip
                    token, hidden = step.logits.argmax(-1), step.last_hidden_state
                    proposal.append(int(token))
                readings[key].append(proposal)
    return readings


def main() -> None:
    from benchmarks.provenance import provenance
    from benchmarks.vllm_probe import add_vllm_python, ask_vllm, vllm_version_or_exit

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_vllm_python(parser)
    parser.add_argument("--out", type=Path, default=REPO / "docs/results/vllm_gemma4_assistant.json")
    parser.add_argument("--target", type=Path, help="a Gemma-4 target folder (with --assistant)")
    parser.add_argument("--assistant", type=Path, help="an assistant folder for --target (a trained one)")
    args = parser.parse_args()
    if (args.target is None) != (args.assistant is None):
        parser.error("--target and --assistant go together")
    began = time.perf_counter()

    from draftsmith.random_target import demo_tokenizer_dir, write_random_target

    version = vllm_version_or_exit(args.vllm_python)
    prompts = PROMPTS if args.assistant is None else PROMPTS + LONGER
    with tempfile.TemporaryDirectory() as tmp:
        if args.assistant is None:
            target = write_random_target("gemma4_text", Path(tmp) / "target", seed_from=demo_tokenizer_dir())
            write_assistant(target, Path(tmp) / "assistant")
            assistant = Path(tmp) / "assistant"
        else:
            target, assistant = args.target.resolve(), args.assistant.resolve()
        served = ask_vllm(args.vllm_python, VLLM_PROPOSALS, "PROPOSALS", str(target), str(assistant),
                          json.dumps(prompts), str(GAMMA))  # fmt: skip
        # each prompt's first proposal, and its second where the first one's first draft was rejected (a random
        # assistant's usually is): the prompt and the first decoded token committed then
        committed, proposed = [], []
        for prompt, run in zip(prompts, served):
            committed.append(prompt)
            proposed.append(run["proposals"][0])
            if run["proposals"][0][0] != run["tokens"][1]:
                committed.append(prompt + run["tokens"][:1])
                proposed.append(run["proposals"][1])
        readings = transformers_proposals(target, assistant, committed)
    rows = [
        {"committed_length": len(tokens), "vllm": proposal, **{key: values[i] for key, values in readings.items()}}
        for i, (tokens, proposal) in enumerate(zip(committed, proposed))
    ]
    result = {
        "vllm": version,
        "pair": "random target and assistant" if args.assistant is None else f"{args.target} + {args.assistant}",
        "gamma": GAMMA,
        "decoded": [run["tokens"] for run in served],
        "rows": rows,
        "vllm_equals": {key: all(row["vllm"] == row[key] for row in rows) for key in readings},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result |= provenance(None, began)  # vLLM's threads and transformers' as each chose them
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["vllm_equals"]))


if __name__ == "__main__":
    main()
