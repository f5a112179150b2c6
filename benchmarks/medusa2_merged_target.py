"""Where vLLM's plain output of a Medusa-2 export's served target (its `target/`: the LoRA adapters merged into the
target's weights in the dtype the export loaded it in) parts from draftsmith's plain decoding of the target it
evaluated (the unmerged adapted target, the export check's reference), of the merged folder, and of the original
target; and how much of the adapters' weight change the merged weights keep against a merge in float32 rounded
once (docs/targets-matrix.md, the Qwen3-Next Medusa-2 row).

    python benchmarks/target_matrix.py --vllm-python $VLLM --families qwen3_next --kinds medusa2 \\
        --set target.dtype=bfloat16 --export-set export.tolerance=0.08 --out ROWS --work WORK
    python benchmarks/medusa2_merged_target.py --vllm-python $VLLM --run WORK/qwen3_next-medusa2 \\
        --folder WORK/served-qwen3_next-medusa2/vllm [--out FILE]

The prompts are the export check's (the run's recipe: its eval data, eval.max_prompts per domain,
eval.max_new_tokens), decoded greedily in the run's target.dtype; vLLM serves the folder's target as the check does
(prefix caching off). Each parting is eval/partings.py's, its gap in the logits of the adapted and of the merged
target. `kept`: the projection of the merged folder's weight change on the float32 merge's, per adapted tensor (1:
all of it). One JSON object on stdout (and in --out).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.provenance import emit, provenance  # noqa: E402
from benchmarks.vllm_probe import add_vllm_python  # noqa: E402


def weight_changes(target_section, adapter: Path, merged) -> dict[str, dict[str, float]]:
    """Per tensor the adapters change: the change's size against the weight's, and the share of it the merged
    folder keeps and a float32 merge rounded once to the served dtype would keep (projections on the float32 one)."""
    from omegaconf import OmegaConf
    from peft import PeftModel

    from draftsmith.target import load_target

    wide = load_target(OmegaConf.merge(target_section, {"dtype": "float32"}))
    served = load_target(target_section)
    exact = PeftModel.from_pretrained(copy.deepcopy(wide), str(adapter)).merge_and_unload().state_dict()
    original, narrow, folder = wide.state_dict(), served.state_dict(), merged.state_dict()
    rows = {}
    for name, weight in exact.items():
        change = weight - original[name]
        if not change.any():
            continue
        square = (change * change).sum()
        once = weight.to(served.dtype).float() - narrow[name].float()
        rows[name] = {
            "relative_change": round((change.norm() / original[name].norm()).item(), 5),
            "kept": round(((folder[name].float() - narrow[name].float()) * change).sum().item() / square.item(), 3),
            "kept_rounded_once": round((once * change).sum().item() / square.item(), 3),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_vllm_python(parser)
    parser.add_argument("--run", type=Path, required=True, help="the Medusa-2 training run (final/, recipe.yaml)")
    parser.add_argument("--folder", type=Path, required=True, help="its export's vLLM folder (target/ inside)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    began = time.perf_counter()
    import torch
    from omegaconf import OmegaConf

    from draftsmith.eval.loop import generate_batch
    from draftsmith.eval.prompts import eos_ids_of, load_prompts, prompt_sources
    from draftsmith.export.verify import EngineSession, parting_gaps
    from draftsmith.families import reads_in_order
    from draftsmith.heads.base import load_drafter
    from draftsmith.target import TargetShape, load_target, load_tokenizer

    torch.set_num_threads(options.threads)
    cfg = OmegaConf.load(options.run / "recipe.yaml")
    tokenizer = load_tokenizer(cfg.target)
    sources, per_file = prompt_sources(cfg)
    by_domain = load_prompts(
        sources, tokenizer, int(cfg.eval.max_prompts), int(cfg.data.max_length), cfg.data.skip_invalid_utf8, per_file
    )
    prompts = [prompt for domain in by_domain.values() for prompt in domain]
    max_new = int(cfg.eval.max_new_tokens)
    target = load_target(cfg.target)
    drafter = load_drafter(options.run / "final", TargetShape.of(target, cfg.target.name_or_path), target).eval()
    merged_dir = options.folder / "target"
    merged = load_target(OmegaConf.merge(cfg.target, {"name_or_path": str(merged_dir)}))
    models = {"adapted": drafter.proposer().verifier, "merged": merged, "original": target}
    eos_ids = eos_ids_of(target, tokenizer)
    plain = {
        name: [g.tokens for g in generate_batch(m, prompts, max_new, eos_ids=eos_ids)] for name, m in models.items()
    }
    request = {
        "target": str(merged_dir.resolve()),
        "prompts": prompts,
        "max_tokens": max_new,
        "max_model_len": max(map(len, prompts)) + max_new + 8,
        "dtype": str(target.dtype).removeprefix("torch."),
        "trust_remote_code": bool(cfg.target.trust_remote_code),
        "runs": [{"name": "plain", "speculative_config": None}],
    }
    if reads_in_order(target.config):  # as the check serves a recurrent target (export/verify.py)
        request["enable_prefix_caching"] = False
    with EngineSession() as session:
        engine = session.run(options.vllm_python, request, "serve the merged target")
    served = engine["runs"]["plain"]["outputs"]
    partings = {
        f"vllm_vs_{name}": {
            judge: parting_gaps(models[judge], prompts, served, plain[name]) for judge in ("adapted", "merged")
        }
        for name in models
    }
    partings["merged_vs_adapted"] = {
        "adapted": parting_gaps(models["adapted"], prompts, plain["merged"], plain["adapted"])
    }
    result = {
        "run": str(options.run),
        "folder": str(options.folder),
        "vllm_version": engine["vllm_version"],
        "dtype": request["dtype"],
        "prompts": len(prompts),
        "max_new_tokens": max_new,
        "partings": partings,
        "weights": weight_changes(cfg.target, options.run / "final" / "adapter", merged),
        "vllm_plain": served,
        "draftsmith_plain": plain,
        **provenance(options.threads, began),
    }
    emit(result, options.out, indent=1)


if __name__ == "__main__":
    main()
