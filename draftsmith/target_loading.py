"""Reading the target's weights: its config (its sliding window the one vLLM serves), its whole model (a causal LM,
or a wrapper's language model as one), and transformers' load report, said in one line where it lists a checkpoint's
multi-token-prediction layers."""

from __future__ import annotations

import logging
import re
from typing import Optional

import torch

from draftsmith.causal_lm import (
    not_a_causal_lm,
    register_misfiled_causal_lms,
    text_model_of_a_wrapper,
    wraps_a_text_model,
)
from draftsmith.errors import UserError
from draftsmith.families import text_config, unserved_clamp
from draftsmith.model_files import TRANSFORMERS_LAYERS, read_pretrained
from draftsmith.vllm_window import serve_window

log = logging.getLogger("draftsmith.target")


def load_config(section, say: bool = False):
    """The target's config as draftsmith runs it: transformers' reading of the release, its sliding-window layers
    attending the keys vLLM serves it with (`served_window`; `say`: in a log line, once per model read). Only this
    in-memory object changes: the release's config.json stays as written (the export ships it), and a dict saved from
    this config states the served count in `sliding_window_size` (draftsmith.vllm_window). One whose layers vLLM
    clamps and transformers' class does not is refused (`unserved_clamp`)."""
    from transformers import AutoConfig

    config = read_pretrained(
        AutoConfig.from_pretrained,
        section.name_or_path,
        f"cannot load target {section.name_or_path!r}",
        revision=section.revision,
        trust_remote_code=section.trust_remote_code,
    )
    if refusal := unserved_clamp(config, section.name_or_path):  # a Hub id's, whose config the recipe check cannot read
        raise UserError(refusal)
    theirs = getattr(text_config(config), "sliding_window", None)
    if (window := serve_window(config)) is not None:
        (log.info if say else log.debug)(
            "target %s: its sliding-window layers attend %d keys, as vLLM serves it (transformers' class would "
            "attend %d)", section.name_or_path, window, theirs,
        )  # fmt: skip
    return config


def read_model(section, dtype: torch.dtype, device: torch.device | str):
    """The whole model, its weights read from the checkpoint, on `device`: a causal LM, or the language model and
    lm_head of a wrapper transformers has no causal LM class for (`language_causal_lm`), proven once on a few tokens
    to compute the wrapper's own logits, or a wrapper's text model and a text-only release's lm_head
    (`read_text_model_lm`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from draftsmith.wrapped_text import check_computes_as_wrapper, language_causal_lm

    register_misfiled_causal_lms()
    config = load_config(section, say=True)  # read once: handed to the loader, which would read it again
    if text_model_of_a_wrapper(config.to_dict()):
        from draftsmith.text_model_lm import read_text_model_lm

        return named(read_text_model_lm(section, config, dtype).to(device), section.name_or_path)
    wrapper = wraps_a_text_model(config.to_dict())
    report = HeldLoadReport()
    try:
        model, loading = read_pretrained(
            (AutoModelForImageTextToText if wrapper else AutoModelForCausalLM).from_pretrained,
            section.name_or_path,
            f"cannot load target {section.name_or_path!r}",
            config=config,
            revision=section.revision,
            dtype=dtype,
            trust_remote_code=section.trust_remote_code,
            use_safetensors=True,  # never unpickle a target's weights: a pickle can run code it holds
            output_loading_info=True,
            adapter_kwargs={},
            **TRANSFORMERS_LAYERS,
        )
    except UserError as err:  # a Hub id's config no causal LM class loads: said as the recipe check says it
        refusal = not_a_causal_lm(config.to_dict(), section.name_or_path)
        if refusal is not None:
            raise UserError(refusal) from err
        report.show()  # transformers' table of what it did not load (weights of other shapes), which the line cites
        raise
    finally:
        report.stop()
    report.release(loading, model.config, section.name_or_path)
    if not wrapper:
        return model.to(device)
    causal_lm = language_causal_lm(model, section.name_or_path).to(device)  # the wrapper's modules, moved with it
    check_computes_as_wrapper(causal_lm, model, section.name_or_path)
    return named(causal_lm, section.name_or_path)


def named(model, name_or_path: str):
    """A causal LM draftsmith built from a release's modules, named by the release it was read from, as one
    transformers loads is (its `name_or_path`: where a reader finds the release's own files, its config.json)."""
    model.name_or_path = str(name_or_path)
    return model


class HeldLoadReport(logging.Filter):
    """Holds transformers' load report (a table, a row per tensor it did not load as is) back until the load
    says what it lists: a checkpoint's multi-token-prediction layers, stored as layers past num_hidden_layers
    (DeepSeek-V3, GLM-4.5; transformers leaves out only the released sizes' indices), are one line instead."""

    LOGGER = "transformers.modeling_utils"

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []
        logging.getLogger(self.LOGGER).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            self.held.append(record)
            return False
        return True

    def stop(self) -> None:
        logging.getLogger(self.LOGGER).removeFilter(self)

    def release(self, loading: dict, config, name_or_path: str) -> None:
        text = getattr(config, "text_config", None) or config
        last = getattr(text, "num_hidden_layers", None)
        unexpected = loading["unexpected_keys"]
        past_last = [key for key in unexpected if (index := layer_index(key)) is not None and last and index >= last]
        if self.held and unexpected and len(past_last) == len(unexpected) and not loading["missing_keys"]:
            log.info(
                "target %s: its checkpoint's %d tensors of layers past num_hidden_layers=%d are its "
                "multi-token-prediction layers, which its forward does not run (drafter.type=mtp reads them)",
                name_or_path, len(past_last), last,
            )  # fmt: skip
            return
        self.show()

    def show(self) -> None:
        self.stop()  # else the filter holds each record again as it is handled
        for record in self.held:
            logging.getLogger(self.LOGGER).handle(record)


def layer_index(key: str) -> Optional[int]:
    """The decoder layer a checkpoint tensor's name is under (`model.layers.N.`, a wrapper's
    `model.language_model.layers.N.`), or None."""
    found = re.match(r"model\.(?:language_model\.)?layers\.(\d+)\.", key)
    return int(found.group(1)) if found else None
