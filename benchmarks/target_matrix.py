"""The target-family matrix: every drafter kind on tiny targets of every family that transformers and
vLLM both implement, through the real entry points, as JSON rows (docs/targets-matrix.md is this table).

    python benchmarks/target_matrix.py --vllm-python /path/to/vllm-venv/bin/python
        [--families qwen3,gpt_oss] [--kinds eagle3,medusa] [--out docs/results/target_matrix.jsonl] [--work DIR]

Per family, a random-weight target of that family is built from transformers' config class
(draftsmith.random_target at draftsmith.tiny_config's shape: hidden 256, 4 layers, 4 heads over 2 KV heads,
4 experts of which 2 are routed for mixtures of experts, sliding windows of 48 positions where the family has them), its
tensors seeded from the demo target's trained weights wherever name and shape match, then the whole
target trained --target-steps steps on the demo's conversations (TARGET_STEPS; so its text is predictable
and varied and a drafter learns within seconds, whatever the family computes differently), in a temporary
directory: nothing downloads. Every row records the steps and `target_variety`, the share of distinct tokens
in the target's own greedy text on the eval prompts (1/48 for a target that repeats one token). A
vision-language wrapper's model type (`qwen3_5`, `qwen3_5_moe`: Qwen3.5's release form) gets that text target
inside the wrapper (write_random_wrapper); one whose language model transformers has no causal LM class for
(`glm5_next`) is written whole by write_random_target, its language model seeded and trained. Per kind, one row:

- `train`: `python train.py recipe=<kind> target.name_or_path=<target> ...` (a few dozen steps on the
  demo's regenerated data) exited 0, its eval stage included (false, with the `error` line alone, where the
  target is refused before any training by the checks train.py refuses it with: linear-attention layers alone);
- `resume`: the same command with train.resume=<its checkpoint RESUME_STEPS before the end> trained those steps
  again (a resume keeps the run's schedule, so the first run trains past that checkpoint), and
  its eval stage decoded the eval prompts (greedy, γ of the recipe) with the weights the export then
  serves: `lossless` (every method's tokens equal plain greedy decoding's) and `tau_draftsmith` are that
  report's (the first run's where the resume failed, and then nothing is exported);
- `export` (with --vllm-python; a row without has none of the columns below): `python -m export ...
  export.vllm_python=<venv>` exited 0, which means vLLM loaded the
  folder and served the eval prompts with the drafter: `vllm_lossless` (vLLM's tokens with the
  drafter equal its tokens without it and draftsmith's), `tau_vllm` and `tau_draftsmith_same_prompts`
  (draftsmith's chain τ on the prompts vLLM served), `relative_difference`, and for a target checked
  in bfloat16 `vllm_partings` (where its outputs with and without the drafter parted) and
  `vllm_plain_partings` (where its plain output parted from draftsmith's), each at a near tie of the
  target's logits, which the check passes; or `refused` with the export's one-line error (a combination
  vLLM 0.32 cannot serve, or a parting beyond a near tie).

For `mtp` the target gets a random first MTP layer in its family's checkpoint layout, as a released one
ships it (`heads.mtp.write_random_layer`; a vision-language wrapper is written whole as its releases are, where its
layer is the wrapper's: MiniMax-M3's; a family without an MTP layout keeps none, and the row records
the trainer's refusal), and the row adds `tau_shipped`: that layer's own τ, before fine-tuning, through
`python -m eval` on the same prompts. The layer is added after the target's training, to a copy of the family's
trained target (the target trained once per family), except where the release is another model than the plain
target (`released_apart`: Kimi-K2.5's and MiniMax-M3's wrappers), which is trained apart.

Every family, kind and override is checked before the first target is written (one line, exit 2). Resumable: rows
already in --out are kept and their (family, kind) skipped. Timings are of this
machine with whatever else runs on it; they are not the point.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.provenance import provenance  # noqa: E402
from benchmarks.vllm_probe import engine_python  # noqa: E402
from draftsmith.errors import UserError, one_line  # noqa: E402
from draftsmith.random_target import RANDOM_TARGET_TOKENIZER_FILES, demo_tokenizer_dir, write_random_target  # noqa: E402
from draftsmith.tiny_wrapper import TINY_VISION  # noqa: E402

FAMILIES = (
    "llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2", "gemma3_text", "phi3", "gpt_oss",
    "glm4", "cohere", "granite",
)  # fmt: skip
# Vision-language wrappers whose releases are the family's only checkpoints (Qwen3.5's): --families names the
# wrapper's model type, its target is the seeded text target laid out as the releases are (write_random_wrapper;
# tests/test_mtp.py's wrappers are built by it too)
TRAIN_DATA = "demo/data/train.regenerated.jsonl.gz"
EVAL_DATA = "demo/data/eval.jsonl.gz"
EVAL_PROMPTS = 3  # per domain
MAX_LENGTH = 192  # tokens of a training row, and of an eval prompt
VARIETY_TOKENS = 48  # new tokens per prompt: the eval's and target_variety's
# The steps a seeded target is trained on the demo's conversations before any drafter (random_target.train_on_demo):
# a family whose own layers the demo has no tensors for (latent attention, experts) otherwise repeats one or two
# tokens; 120 steps, about 1.5 minutes on 2 cores at the tiny shape, make it write varied text (DeepSeek-V3's: 2 ->
# 17 distinct tokens of 40 on a chat prompt).
TARGET_STEPS = 120
COMMON = [
    f"data.train=[{TRAIN_DATA}]", "data.eval=[]", f"eval.data=[{EVAL_DATA}]", f"data.max_length={MAX_LENGTH}",
    "train.save_every=0", "train.log_every=10", f"eval.max_prompts={EVAL_PROMPTS}",
    f"eval.max_new_tokens={VARIETY_TOKENS}", "eval.tree=0", "train.warmup_steps=5",
]  # fmt: skip
# kind -> (recipe, overrides): short runs that reach accepted drafts on the seeded targets
KINDS = {
    "eagle3": ("eagle3", ["train.max_steps=40", "drafter.ttt_steps=2", "train.lr=3e-3"]),
    "eagle3-qwen3-layers": ("eagle3", ["train.max_steps=40", "drafter.ttt_steps=2", "train.lr=3e-3",
                                       "drafter.layer_family=qwen3"]),
    "eagle3.1": ("eagle3", ["train.max_steps=40", "drafter.ttt_steps=2", "train.lr=3e-3", "drafter.fc_norm=true",
                            "drafter.norm_output=true"]),
    "peagle": ("eagle3", ["train.max_steps=50", "drafter.ttt_steps=2", "train.lr=6e-3",
                          "drafter.parallel_drafting=true", "drafter.mask_token_id=5", "drafter.fc_norm=true",
                          "eval.num_speculative_tokens=2"]),
    "eagle": ("eagle", ["train.max_steps=40", "train.lr=3e-3"]),
    "medusa": ("medusa", ["train.max_steps=40"]),
    "medusa2": ("medusa2", ["train.max_steps=40", "drafter.heads_warmup=4"]),
    "draft_model": ("draft", ["train.max_steps=40"]),
    "pard": ("draft", ["train.max_steps=60", "train.lr=6e-3", "drafter.parallel_drafting=true",
                       "drafter.mask_token_id=5", "drafter.parallel_tokens=2", "eval.num_speculative_tokens=2",
                       "train.micro_batch_size=4", "data.max_length=128"]),
    "dflash": ("dflash", ["train.max_steps=40", "drafter.anchors=16"]),
    "dspark": ("dspark", ["train.max_steps=40", "drafter.anchors=16"]),
    "mtp": ("mtp", ["train.max_steps=40", "train.lr=3e-3"]),
    "gemma4_assistant": ("gemma4_assistant", ["train.max_steps=40", "train.lr=3e-3"]),
}  # fmt: skip
RESUME_STEPS = 4  # the steps past the checkpoint the resume goes back to


def run(args: list[str], env: dict) -> tuple[int, str, float]:
    """Run `python args` in the repository; (exit code, last error line, seconds)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, env=env)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    tail = lines[-1] if lines else (result.stderr.strip().splitlines() or [""])[-1]
    return result.returncode, tail[:400], round(time.perf_counter() - start, 1)


def measure(
    family: str,
    kind: str,
    target: Path,
    work: Path,
    vllm_python: Optional[str],
    env: dict,
    extra: list[str],
    export_extra: list[str],
) -> dict:
    recipe, overrides = KINDS[kind]
    out = work / f"{family}-{kind}"
    args = [f"recipe={recipe}", f"target.name_or_path={target}", *COMMON, *overrides, *extra, f"output_dir={out}"]
    row: dict = {"family": family, "kind": kind} | ({"overrides": extra} if extra else {})
    row |= {"export_overrides": export_extra} if export_extra else {}
    steps = next(int(o.split("=")[1]) for o in overrides if o.startswith("train.max_steps="))
    # a checkpoint RESUME_STEPS before the end for the resume to go back to: a resume keeps the run's schedule
    args += [f"train.max_steps={steps + RESUME_STEPS}", f"train.save_every={steps}"]
    code, error, seconds = run(["train.py", *args], env)
    row |= {"train": code == 0, "train_s": seconds}
    if code != 0:
        return row | {"error": error}
    if kind == "mtp":
        row["tau_shipped"] = shipped_tau(target, args, work / f"{family}-{kind}-shipped", env)
    row |= eval_row(out)
    # the resumed run evaluates its final/ as the first did: the export reads that report (it refuses one of other
    # weights), and the row's draftsmith τ is then of the weights the engine serves
    code, error, _ = run(["train.py", *args, f"train.resume={out / 'checkpoints' / f'step_{steps:07d}'}"], env)
    row["resume"] = code == 0
    if code != 0:
        return row | {"error": error}
    row |= eval_row(out)
    if vllm_python is None:  # rows without vLLM's columns
        return row
    code, error, seconds = run(
        ["-m", "export", *args, f"checkpoint={out / 'final'}", f"export.output={work / f'served-{family}-{kind}'}",
         f"export.vllm_python={vllm_python}", *export_extra],
        env,
    )  # fmt: skip
    row["export_s"] = seconds
    if code != 0:
        return row | {"export": False, "refused": error}
    info = json.loads((work / f"served-{family}-{kind}" / "vllm" / "draftsmith_export.json").read_text())
    verified = info["verified"]
    return row | {
        "export": True,
        "vllm_lossless": bool(verified["lossless"] and verified["equals_draftsmith_plain"]),
        # bfloat16: where vLLM's outputs with and without the drafter parted, and where its plain output parted from
        # draftsmith's, each at a near tie (export/verify.py)
        **({"vllm_partings": verified["partings"]} if "partings" in verified else {}),
        **({"vllm_plain_partings": verified["plain_partings"]} if "plain_partings" in verified else {}),
        "tau_vllm": verified["tau_engine"],
        "tau_draftsmith_same_prompts": verified["tau_draftsmith"],
        "relative_difference": verified["relative_difference"],
        "vllm_version": verified.get("engine_version"),
    }


def eval_row(run_dir: Path) -> dict:
    """`lossless` and `tau_draftsmith` from the eval report train.py wrote beside the run's final/."""
    every = json.loads((run_dir / "eval" / "report.json").read_text())["domains"]["all"]
    return {
        "lossless": all(method.get("lossless", True) for method in every.values()),
        "tau_draftsmith": round(every["chain"]["tau"], 4) if "chain" in every else None,
    }


def target_variety(target: Path) -> float:
    """The share of distinct tokens among the target's own greedy tokens on the eval prompts (VARIETY_TOKENS per
    prompt, EOS ignored; eval.max_prompts' prompts of each domain as the runs decode them): about 1/VARIETY_TOKENS for
    a target that repeats one token, whose rows measure drafters learning that repetition, and whose lossless checks
    compare runs of one token."""
    from draftsmith.eval.loop import generate
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.target import load_target, load_tokenizer

    model = load_target(str(target))
    prompts = load_prompts([str(REPO / EVAL_DATA)], load_tokenizer(str(target)), EVAL_PROMPTS, MAX_LENGTH)
    every = [prompt for domain in prompts.values() for prompt in domain]
    tokens = [generate(model, prompt, VARIETY_TOKENS).tokens for prompt in every]
    return round(sum(len(set(row)) for row in tokens) / sum(map(len, tokens)), 3)


def shipped_tau(target: Path, args: list[str], out: Path, env: dict) -> float:
    """The chain τ of the MTP layer the target ships, unchanged, on the eval prompts of `args`."""
    from draftsmith.heads import drafter_class
    from draftsmith.target import load_target

    mtp = drafter_class("mtp")
    model = load_target(str(target))
    mtp.from_target(mtp.Config(), model, str(target)).save_pretrained(out / "shipped")
    code, error, _ = run(["-m", "eval", *args, f"checkpoint={out / 'shipped'}", f"output_dir={out}"], env)
    if code != 0:
        raise RuntimeError(f"the shipped layer's eval failed: {error}")
    return round(json.loads((out / "eval" / "report.json").read_text())["domains"]["all"]["chain"]["tau"], 4)


WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def write_random_wrapper(model_type: str, directory: str | Path, **text: Any) -> Path:
    """A tiny vision-language wrapper of `model_type` (WRAPPERS) in `directory`/wrapper, laid out as Qwen3.5's
    releases are: a random vision tower beside the language model under `model.language_model.*` (a random text
    target written by write_random_target(**text) in `directory`/text), the tokenizer and the image and video
    processors' configs beside (vLLM sizes its multimodal budget from them at start, text prompts or not)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    directory = Path(directory)
    text_folder = write_random_target(WRAPPERS[model_type], directory / "text", **text)
    text_config = json.loads((text_folder / "config.json").read_text())
    del text_config["architectures"]  # the wrapper's config names its own only
    vision = {**TINY_VISION, "out_hidden_size": text_config["hidden_size"]}
    config = AutoConfig.for_model(model_type, text_config=text_config, vision_config=vision)
    wrapper = directory / "wrapper"
    AutoModelForImageTextToText.from_config(config).save_pretrained(wrapper)
    weights = wrapper / "model.safetensors"
    tensors = load_file(str(weights))
    for name, tensor in load_file(str(text_folder / "model.safetensors")).items():
        tensors[name.replace("model.", "model.language_model.", 1)] = tensor
    save_file(tensors, str(weights), metadata={"format": "pt"})
    for name in RANDOM_TARGET_TOKENIZER_FILES:
        if (text_folder / name).is_file():
            shutil.copyfile(text_folder / name, wrapper / name)
    vision_config = config.vision_config
    common = {
        "patch_size": vision_config.patch_size, "temporal_patch_size": vision_config.temporal_patch_size,
        "merge_size": vision_config.spatial_merge_size, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "size": {"shortest_edge": 1024, "longest_edge": 16384}, "processor_class": "Qwen3VLProcessor",
    }  # fmt: skip
    processors = {
        "preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessorFast", **common},
        "video_preprocessor_config.json": {"video_processor_type": "Qwen3VLVideoProcessor", **common},
    }
    for name, values in processors.items():
        (wrapper / name).write_text(json.dumps(values, indent=2) + "\n")
    return wrapper


def trained_target(family: str, folder: Path, steps: int, released: bool) -> Path:
    """The family's target, seeded from the demo's and trained `steps` steps, in `folder`: a wrapper of WRAPPERS
    as its releases lay it out, the family's release form where `released` (write_random_target's)."""
    seeding = {"seed_from": demo_tokenizer_dir(), "train_steps": steps}
    if family in WRAPPERS:
        return write_random_wrapper(family, folder, **seeding)
    return write_random_target(family, folder, released=released, **seeding)


def released_apart(family: str) -> bool:
    """Whether the family's release form is another model than its plain target: a vision-language wrapper whose
    language model transformers has a causal LM for (Kimi-K2.5's, MiniMax-M3's) is written as that causal LM alone,
    and released as the wrapper whole (tiny_wrapper_config), whose language model's random weights are drawn after
    the vision tower's: other weights, trained apart. Any other family's release form is its plain target, bit for
    bit (the same config, seed and training), a WRAPPERS one included (write_random_wrapper either way)."""
    from transformers import AutoConfig

    from draftsmith.causal_lm import text_has_causal_lm

    if family in WRAPPERS:
        return False
    try:
        return text_has_causal_lm(AutoConfig.for_model(family).to_dict())
    except ValueError:  # not a model type of transformers: write_random_target refuses it in one line
        return False


def with_mtp_layer(target: Path) -> Path:
    """The target, given a random MTP layer where vLLM serves one for its architecture."""
    from draftsmith.heads.mtp_layouts import LAYOUTS
    from draftsmith.heads.mtp_random_layer import write_random_layer

    if json.loads((target / "config.json").read_text())["architectures"][0] in LAYOUTS:
        write_random_layer(target)
    return target


def markdown(rows: list[dict]) -> str:
    """The matrix as docs/targets-matrix.md shows it: one line per (family, kind)."""

    def mark(value) -> str:
        return {True: "yes", False: "**no**", None: "–"}.get(value, str(value))

    lines = [
        "| family | kind | trains | resumes | lossless (draftsmith) | τ draftsmith | vLLM serves | lossless (vLLM) "
        "| τ vLLM / draftsmith, same prompts | Δ | target variety |",
        "|---|---|:-:|:-:|:-:|--:|:-:|:-:|--:|--:|--:|",
    ]
    order = {family: index for index, family in enumerate(FAMILIES)}
    kinds = {kind: index for index, kind in enumerate(KINDS)}
    rows = sorted(rows, key=lambda r: (order.get(r["family"], len(order)), r["family"], kinds.get(r["kind"], 99)))
    for row in rows:
        served = mark(row.get("export")) if "export" in row else "–"
        if row.get("refused"):
            served = "refused: " + row["refused"].removeprefix("error: ").split(" (")[0]
        pair = f"{row['tau_vllm']:.3f} / {row['tau_draftsmith_same_prompts']:.3f}" if row.get("export") else "–"
        delta = f"{100 * row['relative_difference']:+.1f}%" if row.get("export") else "–"
        lossless = mark(row.get("vllm_lossless"))
        ties = [f"{len(row[key])} {what}" for key, what in (("vllm_partings", "near ties"),
                ("vllm_plain_partings", "near ties from draftsmith's plain")) if row.get(key)]  # fmt: skip
        if ties:  # bfloat16: passed with partings at near ties only
            units = max(p.get("units", 0) for key in ("vllm_partings", "vllm_plain_partings") for p in row.get(key, []))
            lossless = f"up to {', '.join(ties)} (≤ {units} units)"
        lines.append(
            f"| {row['family']} | {row['kind']} | {mark(row.get('train'))} | {mark(row.get('resume'))} | "
            f"{mark(row.get('lossless'))} | {row.get('tau_draftsmith') or '–'} | {served} | "
            f"{lossless} | {pair} | {delta} | {row.get('target_variety', '–')} |"
        )
    return "\n".join(lines)


def check_options(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    """Every kind, family and override of the run, refused in one line before any target is written: a misspelt
    family would stop the run after the earlier families' minutes, and an override no recipe takes would append a
    row of failed runs for each family and kind to --out."""
    from draftsmith.random_target import tiny_target_config
    from draftsmith.recipe import validated

    if options.markdown:
        return
    kinds = options.kinds.split(",")
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        parser.error(f"--kinds: {', '.join(unknown)} not among {', '.join(KINDS)}")
    try:
        for family in options.families.split(","):  # the configs of the targets trained_target writes, no weights
            tiny_target_config(WRAPPERS.get(family, family), released=options.released)
            if "mtp" in kinds and released_apart(family):
                tiny_target_config(family, released=True)
    except UserError as err:
        parser.error(f"--families: {err}")
    for kind in kinds:
        recipe, overrides = KINDS[kind]
        args = [f"recipe={recipe}", *COMMON, *overrides, *options.set, "output_dir=runs/target_matrix"]
        try:
            validated(args, "train")
            validated([*args, *options.export_set], "export")
        except UserError as err:
            parser.error(f"--set/--export-set with --kinds {kind}: {err}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # optional here (rows without vLLM's columns), read as every benchmark reads it: relative to the current directory
    parser.add_argument("--vllm-python", type=engine_python)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--kinds", default="eagle3")
    parser.add_argument(
        "--out", type=Path, default=REPO / "docs/results/target_matrix.jsonl",
        help="the rows' JSON lines file, relative to the current directory (default: the repository's)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a recipe override for every run (training, eval, export), recorded in the rows",
    )  # fmt: skip
    parser.add_argument(
        "--export-set", action="append", default=[], metavar="KEY=VALUE",
        help="an override for the export (and its engine check) only: target.dtype=bfloat16 export.tolerance=0.08 "
        "for a target whose vLLM CPU layers take bfloat16 only, trained and evaluated in float32",
    )  # fmt: skip
    parser.add_argument(
        "--target-steps", type=int, default=TARGET_STEPS,
        help="steps each seeded target is trained on the demo's conversations first (0: seeded only, as rows before "
        "2026-12-01 were), recorded in the rows",
    )  # fmt: skip
    parser.add_argument(
        "--released", action="store_true",
        help="every row's target in its family's release form (write_random_target's released: a wrapper "
        "transformers loads as a causal LM itself written whole), recorded in the rows; default: the plain target, "
        "an mtp row's the release form where that is another model (released_apart)",
    )  # fmt: skip
    parser.add_argument("--markdown", action="store_true", help="print --out as docs/targets-matrix.md's table, stop")
    parser.add_argument(
        "--work", type=Path,
        help="keep the targets, runs and export folders here (default: a temporary directory, removed at the end)",
    )  # fmt: skip
    options = parser.parse_args()
    check_options(parser, options)
    out = options.out.resolve()
    if options.markdown:
        print(markdown([json.loads(line) for line in out.read_text().splitlines() if line]))
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        done = {(row["family"], row["kind"]) for row in map(json.loads, out.read_text().splitlines()) if row}
    env = {**os.environ, "OMP_NUM_THREADS": str(options.threads), "TOKENIZERS_PARALLELISM": "false"}
    import torch

    torch.set_num_threads(options.threads)  # this process trains each target (write_random_target) as the runs do
    with tempfile.TemporaryDirectory(prefix="target-matrix-") as tmp:
        work = options.work.resolve() if options.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for family in options.families.split(","):
            trained: dict[bool, Path] = {}  # release form or not -> the family's trained target, no MTP layer
            targets: dict[bool, Path] = {}  # with an MTP layer or not -> the family's target
            varieties: dict[bool, float] = {}  # and its target_variety
            for kind in options.kinds.split(","):
                if (family, kind) in done:
                    print(f"{family} {kind}: already in {out}, not measured again", file=sys.stderr)
                    continue
                mtp = kind == "mtp"
                # for `mtp` a wrapper as its releases ship it, where its MTP layer is the wrapper's
                released = options.released or (mtp and released_apart(family))
                start = time.perf_counter()
                try:
                    if mtp not in targets:
                        if released not in trained:
                            folder = work / (f"{family}-released" if released else family)
                            trained[released] = trained_target(family, folder, options.target_steps, released)
                        target = trained[released]
                        if mtp:
                            # the layer on a copy of the trained target: the target a second training would write,
                            # without its minutes (the shipped layer is random and added after the training either
                            # way)
                            target = with_mtp_layer(shutil.copytree(target, work / f"{family}-with-mtp"))
                        varieties[mtp] = target_variety(target)
                        targets[mtp] = target  # once its variety is known: a target refused is refused each kind
                except UserError as err:  # the target refused as the entry points refuse it (its eval loop's checks)
                    row = {"family": family, "kind": kind, "train": False, "error": f"error: {one_line(err)}"}
                else:
                    row = measure(family, kind, targets[mtp], work, options.vllm_python, env, options.set,
                                  options.export_set)  # fmt: skip
                    row |= {"target_variety": varieties[mtp]}
                row |= {"target_train_steps": options.target_steps}
                row |= {"target_released": released}
                row |= provenance(options.threads, start)  # wall_s: this row's
                print(json.dumps(row), flush=True)
                with out.open("a") as stream:
                    stream.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
