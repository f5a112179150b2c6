"""Medusa-1 and Medusa-2 for vLLM's `MedusaModel` (SGLang serves no Medusa drafter).

vLLM reads `num_heads`, `num_hidden_layers`, `hidden_size`, `vocab_size`, `truncated_vocab_size` and
`medusa_fc_bias` (default false: head biases would be dropped without a word), renames any other key
holding both "num" and "heads" to `num_heads` (so nothing else of that shape is written), and loads
`blocks.{h}.layers.{l}.weight|bias` and `lm_heads.{h}.weight` — draftsmith's own names. Head h reads
the target's final hidden state at t and guesses token t+2+h in both. `num_speculative_tokens` must
not exceed the heads (more is an error in vLLM; fewer drops heads).

Medusa-2 trained LoRA adapters into the target, and its heads read the *adapted* target's hidden
states: the vLLM folder holds `medusa/` (the heads) and `target/` (the target with the adapters
merged, in the dtype draftsmith evaluated it in), and the serving command serves that target.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import UserError
from draftsmith.files import write_json
from draftsmith.formats import Exporter, Source, register
from draftsmith.formats.repo import VLLM_SERVE, EngineRepo, copy_tokenizer
from draftsmith.formats.versions import Releases
from draftsmith.heads import drafter_class
from draftsmith.heads.lora import ADAPTER_DIR
from draftsmith.target import TargetShape, load_target
from draftsmith.vllm_window import as_released

HEADS_DIR, TARGET_DIR = "medusa", "target"  # a Medusa-2 folder's two models


def medusa_config(drafter) -> dict[str, Any]:
    hidden, vocab = drafter.target.hidden_size, drafter.target.vocab_size
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": hidden,
        "vocab_size": vocab,
        "truncated_vocab_size": vocab,
        "num_heads": drafter.config.num_heads,
        "num_hidden_layers": drafter.config.num_layers,
        "medusa_fc_bias": True,  # draftsmith's blocks have biases; vLLM drops them unless told
        "original_lm_head": False,  # one lm_head per head
    }


def medusa_expected(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """What vLLM's MedusaModel loads for this config."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    expected = {}
    for head in range(config["num_heads"]):
        for layer in range(config["num_hidden_layers"]):
            expected[f"blocks.{head}.layers.{layer}.weight"] = (hidden, hidden)
            if config.get("medusa_fc_bias"):
                expected[f"blocks.{head}.layers.{layer}.bias"] = (hidden,)
        expected[f"lm_heads.{head}.weight"] = (vocab, hidden)
    return expected


@register
class MedusaExporter(Exporter):
    """Medusa-1's heads, and the reader of every vLLM Medusa folder (a Medusa-2 export's heads included)."""

    kinds = ("medusa",)
    vllm_method = "medusa"
    vllm_method_from_name = True
    vllm_takes_schedule = False  # vllm/v1/spec_decode/medusa.py: `assert num_speculative_tokens == self.num_...`
    vllm_reads_image_token = False  # vllm/v1/spec_decode/medusa.py reads the target's hidden states only
    vllm_shares_embedding = None  # and shares nothing
    vllm_releases = Releases(
        removed_in="0.33.0",  # its SpeculativeMethod has no "medusa", its wheel no Medusa model
        instead="vLLM 0.32 or earlier, or draftsmith's eval; for a newer vLLM train an EAGLE-3 drafter "
        "(recipe=eagle3) or a draft model (recipe=draft)",
    )
    sglang_reason = "SGLang serves no Medusa drafter (it has neither a Medusa model nor a Medusa speculative algorithm)"

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        drafter = source.drafter
        config = medusa_config(drafter)
        tensors = {
            name: tensor for name, tensor in drafter.state_dict().items() if name.startswith(("blocks.", "lm_heads."))
        }
        conventions = {
            "medusa_fc_bias": (
                "written true: draftsmith's residual blocks have biases, which vLLM's default (false) would drop"
            ),
            "heads": (
                "head h reads the target's final (post-norm) hidden state at t and guesses token t+2+h, in draftsmith "
                "and in vLLM"
            ),
        }
        return EngineRepo("vllm", config, tensors, medusa_expected(config), VLLM_SERVE, conventions)

    def recognises(self, config: dict[str, Any], names: Collection[str]) -> bool:
        return config.get("model_type") == "medusa" or "MedusaModel" in config.get("architectures", [])

    def read(
        self, folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], target_model, info: dict[str, Any]
    ):
        """A Medusa drafter from a vLLM Medusa folder; beside a `target/` (a Medusa-2 export), that
        merged target becomes the model that verifies it."""
        medusa = drafter_class("medusa")
        settings = {"num_heads": int(config["num_heads"]), "num_layers": int(config["num_hidden_layers"])}
        settings |= {
            key: value for key, value in info.get("drafter_config", {}).items() if key == "tree_topk"
        }  # decode-only
        drafter = medusa(medusa.Config(**settings), TargetShape.of(target_model, info.get("verifier", "target")))
        target = {"hidden_size": drafter.target.hidden_size, "vocab_size": drafter.target.vocab_size}
        target["truncated_vocab_size"] = target["vocab_size"]  # a smaller one maps a draft vocabulary
        differ = [
            f"{key}={config.get(key)} (the target's: {value})"
            for key, value in target.items()
            if config.get(key, value) != value
        ]
        if config.get("original_lm_head"):  # vLLM would read lm_heads.0 as every head's
            differ.append("original_lm_head=true (draftsmith's heads each have their own lm_head)")
        if differ:  # vLLM builds the heads at the config's shape, draftsmith at the target's
            raise UserError(
                f"{folder}: its config.json describes other heads than draftsmith reads for the target: "
                + ", ".join(differ)
            )
        if not config.get("medusa_fc_bias"):  # a Medusa folder without biases is draftsmith's with zero biases
            tensors = tensors | {
                n.replace(".weight", ".bias"): torch.zeros(t.shape[0])
                for n, t in tensors.items()
                if n.startswith("blocks.")
            }
        drafter.load_state_dict(tensors)
        drafter.learned = dict(info.get("learned") or {})  # the eval split's accuracy, which shapes the tree
        merged = folder.parent / TARGET_DIR
        if folder.name == HEADS_DIR and merged.is_dir():
            device = target_model.get_output_embeddings().weight.device
            drafter.verify_with(load_target(str(merged), device).to(target_model.dtype))
        return drafter


@register
class Medusa2Exporter(MedusaExporter):
    """Medusa-2: Medusa's heads in `medusa/`, beside the target with the drafter's adapters merged (`target/`),
    which is the model served. Its folder is read back by `MedusaExporter`, as Medusa heads verified by that
    merged target."""

    kinds = ("medusa2",)
    weights_dirs = (HEADS_DIR,)  # the heads beside the adapted target

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        heads = super().vllm(source, gamma, output)
        verifier = (
            f"{TARGET_DIR}/ is the target with the drafter's LoRA adapters merged; the heads read its hidden states, "
            "so it is the model to serve"
        )
        return dataclasses.replace(
            heads,
            serve=VLLM_SERVE.replace("{target}", "{path}/" + TARGET_DIR),  # the model: {path}/HEADS_DIR (weights_dir)
            conventions={**heads.conventions, "verifier": verifier},
            extra=lambda folder: write_merged_target(source, folder / TARGET_DIR),
            weights_dir=HEADS_DIR,
        )

    def recognises(self, config: dict[str, Any], names: Collection[str]) -> bool:
        return False  # a vLLM Medusa folder is MedusaExporter's to read, whichever kind wrote it


def write_merged_target(source: Source, directory: Path) -> None:
    """The target with the checkpoint's Medusa-2 adapters (its `adapter/`, peft format) merged into a
    copy of the target's weights: the drafter's own adapted target shares the target's tensors, so
    merging it would change the target itself."""
    from peft import PeftModel

    adapter = source.checkpoint / ADAPTER_DIR
    if not adapter.is_dir():
        raise UserError(
            f"{source.checkpoint} has no {ADAPTER_DIR}/ (the LoRA adapters in peft's format) to merge into the target"
        )
    merged = PeftModel.from_pretrained(copy.deepcopy(source.target_model), adapter).merge_and_unload()
    merged.save_pretrained(directory)
    # its config.json as the release states it, which vLLM reads: the loaded config attends the window vLLM serves,
    # which vLLM derives again from the release's (draftsmith.vllm_window)
    written = directory / "config.json"
    write_json(written, as_released(json.loads(written.read_text())), sort_keys=True)
    copy_tokenizer(source.target, directory)
