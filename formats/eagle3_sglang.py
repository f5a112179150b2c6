"""EAGLE-3 for SGLang: its one layout (`LlamaForCausalLMEagle3` with draftsmith's ids in `eagle_config`),
apart from vLLM's (formats/eagle3.py) because SGLang's layer has fewer settings and refuses what it lacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from draftsmith.errors import UserError
from draftsmith.formats import Source
from draftsmith.formats.eagle3_layout import (
    EXTENSIONS,
    LLAMA_ONLY,
    Layout,
    as_midlayer,
    draftsmith_ids,
    eagle3_architecture,
    layer_expected,
    vllm_ids,
)
from draftsmith.formats.repo import SGLANG_FLAGS, SGLANG_REVISION_FLAG, EngineRepo, TargetInfo, draft_layer_config

SGLANG_SERVE = (
    "python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path {path} --speculative-num-steps {gamma} --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens {gamma_plus_one}" + SGLANG_FLAGS
)


class SGLang(Layout):
    """SGLang's `LlamaForCausalLMEagle3` (checked against sglang's llama_eagle3.py and the Llama target's
    layer capture, source read, not run): `eagle_config.eagle_aux_hidden_state_layer_ids` are
    draftsmith's ids (it captures id + 1 before that layer), the layer's residual is always the
    un-normalised feature (it ignores `norm_before_residual`, so a drafter trained with true is
    refused), weights are `midlayer.*` (every version loads that name), and no `bias` key (it would add
    an o_proj bias). It has neither EAGLE-3.1's norms nor a parallel EAGLE: such drafters are refused.
    The folder also carries vLLM's top-level ids (ours + 1), which SGLang ignores, so vLLM loads that
    form too."""

    engine = "sglang"
    families = LLAMA_ONLY
    norm_before_residual = False

    def refuse(self, drafter, target: TargetInfo) -> None:
        draft_layer_config(drafter, self.families, "SGLang", "EAGLE-3")
        if drafter.config.parallel_drafting:
            raise UserError(
                "this EAGLE-3 drafter drafts in parallel (P-EAGLE), which SGLang does not serve: it would draft "
                "sequentially with a drafter trained for mask inputs (export it for vllm)"
            )
        extensions = [key for key in (*EXTENSIONS, "norm_before_fc") if getattr(drafter.config, key)]
        if extensions:
            raise UserError(
                f"this EAGLE-3 drafter uses {' and '.join(extensions)}, which SGLang's EAGLE-3 layer does not have: "
                "it would serve another function (export it for vllm, or train without them)"
            )
        if drafter.config.sliding_window is not None:
            raise UserError(
                f"this EAGLE-3 drafter's layer attends to a sliding window of {drafter.config.sliding_window} "
                "positions, which SGLang's EAGLE-3 layer has not been verified to honour (export it for vllm, or "
                "retrain with drafter.sliding_window=null)"
            )
        if drafter.config.norm_before_residual != self.norm_before_residual:
            raise UserError(
                "this EAGLE-3 drafter was trained with norm_before_residual=true; SGLang's EAGLE-3 layer always "
                "keeps the un-normalised feature as its residual and would serve another function (export it for "
                "vllm, or retrain with false)"
            )
        vllm_ids(list(drafter.config.aux_layers), target.shape.num_hidden_layers)  # SGLang never captures our last id

    def write(self, source: Source, gamma: int) -> EngineRepo:
        drafter, target = source.drafter, source.target
        layer = draft_layer_config(drafter, self.families, "SGLang", "EAGLE-3")
        ours = list(drafter.config.aux_layers)
        ids = vllm_ids(ours, target.shape.num_hidden_layers)
        config = layer | {
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": drafter.config.draft_vocab_size,
            "target_hidden_size": target.shape.hidden_size,
            "num_aux_hidden_states": len(ours),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ours, "use_aux_hidden_state": True},
            "norm_before_residual": self.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": ids,  # vLLM's convention; SGLang reads eagle_config
        }
        tensors = as_midlayer(drafter.state_dict())
        expected = as_midlayer(
            layer_expected(config, target.shape.vocab_size, drafter.config.draft_vocab_size, len(ours))
        )
        conventions = {
            "aux_layer_ids": {
                "draftsmith": ours,
                "sglang": ours,
                "vllm": ids,
                "rule": "SGLang's eagle_config ids are draftsmith's (it captures the input of layer id + 1); "
                "the top-level ids are vLLM's (+1)",
            },
            "norm_before_residual": "false: SGLang's layer keeps the un-normalised feature as the residual",
            "weights": "layers.0.* written as midlayer.*",
            "checked_against": "sglang python/sglang/srt/models/llama_eagle3.py and models/llama.py "
            "(source read, not run)",
        }
        return EngineRepo(
            self.engine,
            config,
            tensors,
            expected,
            SGLANG_SERVE,
            conventions,
            method="EAGLE3",
            revision_flag=SGLANG_REVISION_FLAG,
        )

    def recognises(self, config: dict[str, Any]) -> bool:
        return (
            eagle3_architecture(config)
            and "speculators_model_type" not in config
            and "eagle_aux_hidden_state_layer_ids" in config.get("eagle_config", {})
        )

    def read(self, folder: Path, config: dict[str, Any], num_layers: Optional[int]) -> dict[str, Any]:
        ours = list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        top = config.get("eagle_aux_hidden_state_layer_ids")
        if top is not None and draftsmith_ids(top) != ours:
            raise UserError(
                f"{folder}: top-level eagle_aux_hidden_state_layer_ids {top} disagree with eagle_config's {ours} "
                "(+1 expected)"
            )
        if bool(config.get("norm_before_residual")) != self.norm_before_residual:  # read: it would evaluate another
            raise UserError(
                f"{folder}: norm_before_residual is true, which SGLang's EAGLE-3 layer ignores (it keeps the "
                "un-normalised feature as its residual): SGLang would serve another function than the folder says"
            )
        return {"aux_layers": ours, "layer_family": self.families[0], "norm_before_residual": self.norm_before_residual}
