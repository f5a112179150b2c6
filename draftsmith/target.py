"""The frozen target: load any HF causal LM (local path or Hub id) and run it for the features a drafter asks for.

Layer index convention (used by every drafter and, later, by feature shards): layer `i` means the *output* of decoder
layer i (0-based), i.e. `hidden_states[i + 1]` of transformers' `output_hidden_states`; `-1` means the embeddings
(`hidden_states[0]`). The `final` feature is the last hidden state after the final norm, the input of the lm_head.
Caveat: transformers returns the *normed* state as `hidden_states[L]`, so layer L-1 is the same tensor as `final`, not
the raw output of the last decoder layer (EAGLE-3's default layers 1, L//2-1, L-4 never touch it). A target whose
layers pass several residual streams (hyper-connections) is read as vLLM reads it: their mean (`layer_output`).
"""

from __future__ import annotations

import inspect
import json
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

from draftsmith.errors import UserError
from draftsmith.hub_cache import HUB_COMMIT, hub_commit, hub_revision
from draftsmith.model_files import read_pretrained, read_tokenizer
from draftsmith.streams import last_layer_streams
from draftsmith.target_loading import load_config, read_model
from draftsmith.target_weights import loaded_records, same_embedding_norms, same_layer_values

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`auto` is float32 on CPU (bf16 matmuls are slow there) and bfloat16 on a GPU."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"target.dtype={name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as configs, reports and vLLM name it (`bfloat16`, not `torch.bfloat16`)."""
    return str(dtype).removeprefix("torch.")


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} asked for but no CUDA device is available")
    return device


def target_section(target: Any) -> Any:
    """The recipe's `target` section, or a plain path / Hub id standing for one with the defaults."""
    if isinstance(target, (str, os.PathLike)):
        return SimpleNamespace(name_or_path=str(target), revision=None, dtype="auto", trust_remote_code=False)
    return target


def load_tokenizer(section):
    """The target's tokenizer, from the recipe's `target` section (or a path)."""
    from transformers import AutoTokenizer

    section = target_section(section)
    tokenizer = read_tokenizer(
        AutoTokenizer.from_pretrained,
        section.name_or_path,
        f"cannot load the tokenizer of {section.name_or_path!r}",
        revision=section.revision,
        trust_remote_code=section.trust_remote_code,
    )
    if tokenizer.pad_token_id is None:
        # Padding positions are masked out everywhere; any id works, EOS is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_target(section, device: torch.device | str = "cpu", shard: str = "none"):
    """The target causal LM from the recipe's `target` section (or a path), frozen: eval mode, no parameter requires
    grad. `shard` is the recipe's `target.shard` for the stages that train, capture or regenerate: `fsdp` shards its
    decoder layers over the run's ranks (draftsmith.sharding, which this module calls and which calls nothing here);
    the eval and the export load it whole."""
    from draftsmith.sharding import built_whole, load_sharded

    section = target_section(section)
    dtype = resolve_dtype(section.dtype, device)
    with built_whole():  # never partitioned by a ZeRO-3 launch: the frozen target is not DeepSpeed's
        if shard == "none":
            return with_hub_commit(freeze(read_model(section, dtype, device)), section)
        model = load_sharded(
            load_config(section),
            dtype,
            device,
            read_weights=lambda: read_model(section, dtype, "cpu").state_dict(),  # rank 0's, in host memory
            trust_remote_code=section.trust_remote_code,
        )
    return with_hub_commit(freeze(model), section)


def empty_target(section, dtype: torch.dtype):
    """The target causal LM of the recipe's `target` section as load_target builds it, without its weights (they stay
    on the meta device): its config, layers and shapes, for a stage whose target runs elsewhere (a vLLM engine)."""
    from draftsmith.sharding import built_empty

    section = target_section(section)
    return with_hub_commit(freeze(built_empty(load_config(section), dtype, section.trust_remote_code)), section)


def with_hub_commit(model: torch.nn.Module, section) -> torch.nn.Module:
    """The loaded target, holding the Hub commit its files were read from (hub_cache.HUB_COMMIT)."""
    setattr(model, HUB_COMMIT, hub_commit(section.name_or_path, section.revision))
    return model


def loaded_config(target_model) -> dict:
    """A loaded target's config (dict form), naming its architecture: transformers loads a vision-language
    wrapper's language model alone, configured by the wrapper's text_config, which names none."""
    values = target_model.config.to_dict()
    # a layer count the config class derives (Nemotron-H's, from its layer kinds), which its dict form leaves out
    layers = getattr(target_model.config, "num_hidden_layers", None)
    if "num_hidden_layers" not in values and layers is not None:
        values["num_hidden_layers"] = layers
    return {**values, "architectures": values.get("architectures") or [type(target_model).__name__]}


def config_json(target_model) -> dict:
    """The loaded target's config.json as it ships (`shipped_config_json`), at the revision it loaded from; a model
    built in memory, the one `save_pretrained` would write."""
    name = target_model.name_or_path
    if not name:
        return target_model.config.to_dict()
    return shipped_config_json(name, getattr(target_model.config, "_commit_hash", None))


def shipped_config_json(name_or_path: str, revision: Optional[str] = None) -> dict:
    """A target's config.json as it ships, what an engine reads: a vision-language wrapper's whole, a flat release's
    keys and values as written (`loaded_config` is transformers' reading: a wrapper's language model alone, an
    infinity its saver encoded decoded), without transformers' own `_name_or_path` where a saver left it."""
    from transformers.utils import cached_file

    read = f"cannot read target {name_or_path!r}"
    path = read_pretrained(cached_file, name_or_path, read, filename="config.json", revision=revision)
    config = json.loads(Path(path).read_text())
    config.pop("_name_or_path", None)
    return config


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def target_id(name_or_path: str) -> str:
    """A stable name for the target: the Hub id, or the directory's name for a local path."""
    path = Path(name_or_path)
    return path.resolve().name if path.exists() else name_or_path


@dataclass(frozen=True)
class TargetShape:
    """What a drafter must agree on with its target; stored in every checkpoint, feature capture and export, and
    checked wherever two of them meet."""

    name_or_path: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    # which weights, wherever they are and in whatever dtype they load (draftsmith.target_weights): the norms of the
    # input embedding's first rows, and the first values of each weight of the last decoder layer (a fine-tune that
    # keeps the embedding, a LoRA merged into the layers, changes them); None where only a config was read, and in
    # what an earlier draftsmith saved
    embedding_norms: Optional[tuple[float, ...]] = None
    layer_values: Optional[tuple[float, ...]] = None
    # the Hub commit its files were read from (hub_cache.HUB_COMMIT); None for a local folder, where only a
    # config was read, and in what an earlier draftsmith saved
    revision: Optional[str] = None

    @classmethod
    def of(cls, model, name_or_path: str) -> TargetShape:
        """A loaded target's shape (the vocabulary is the lm_head's rows, which may be padded)."""
        shape = cls.from_config(model.config, name_or_path)
        loaded = {"vocab_size": int(model.get_output_embeddings().weight.shape[0]), "revision": hub_revision(model)}
        if model.get_input_embeddings().weight.is_meta:  # a target without its weights (empty_target)
            return cls(**{**shape.__dict__, **loaded})
        return cls(**{**shape.__dict__, **loaded, **loaded_records(model, name_or_path)})

    def same_weights(self, other: TargetShape) -> bool:
        """Whether two shapes are of the same target's weights, as far as both know (`same_embedding_norms`,
        `same_layer_values`)."""
        return same_embedding_norms(self.embedding_norms, other.embedding_norms) and same_layer_values(
            self.layer_values, other.layer_values
        )

    @classmethod
    def from_config(cls, config: Any, name_or_path: str) -> TargetShape:
        """From an HF config object or its dict form (a target's config.json)."""
        get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
        text = get("text_config")  # multimodal wrappers keep the language model's shape here
        if text is not None and get("hidden_size") is None:
            return cls.from_config(text, name_or_path)
        return cls(
            name_or_path=str(name_or_path),
            model_type=str(get("model_type")),
            hidden_size=int(get("hidden_size")),
            vocab_size=int(get("vocab_size")),
            num_hidden_layers=int(get("num_hidden_layers")),
        )

    @property
    def id(self) -> str:
        return target_id(self.name_or_path)


def local_target_config(name_or_path: str) -> Optional[dict]:
    """A local target's config.json (no weights, no network); None for a Hub id or a folder without a readable one."""
    path = Path(name_or_path) / "config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def names_a_missing_folder(name_or_path: str) -> bool:
    """A name written as a path (absolute, `./`, `../`, `~`, two slashes or more) that is no folder: a Hub id reads
    `owner/name`, so the Hub would only answer with a complaint about the id's form."""
    written_as_path = name_or_path.startswith(("/", ".", "~")) or "\\" in name_or_path or name_or_path.count("/") > 1
    return written_as_path and not Path(name_or_path).expanduser().is_dir()


def local_target_shape(name_or_path: str) -> Optional[TargetShape]:
    """The shape of a target in a local directory, read from its config.json alone; None where
    `local_target_config` finds none or it lacks a field."""
    config = local_target_config(name_or_path)
    try:
        return TargetShape.from_config(config, name_or_path) if config is not None else None
    except (ValueError, TypeError, KeyError):
        return None


def layer_output(hidden_states: Sequence[torch.Tensor], layer: int) -> torch.Tensor:
    """Decoder layer `layer`'s output (the module docstring's convention) from transformers' `hidden_states`,
    one state a position. A target with hyper-connections (DeepSeek-V4's `hc_mult`) passes several residual
    streams between layers, [..., streams, H] where the last state is [..., H]: the tap is their mean, as vLLM
    computes the taps its EAGLE-3 and DFlash drafters read (vllm/models/deepseek_v4/cpu/model.py and
    nvidia/model.py: `aux_recon.mean(dim=1)` of each tapped layer's mixed streams), so a drafter trains on
    what it is served. Streams laid side by side, [..., streams * H] (Qwen4-Exp's `hc_count`), are the same mean.
    """
    state, width = hidden_states[layer + 1], hidden_states[-1].shape[-1]
    if state.dim() == hidden_states[-1].dim() and state.shape[-1] != width:
        state = state.unflatten(-1, (-1, width))
    return state.mean(dim=-2) if state.dim() > hidden_states[-1].dim() else state


@dataclass
class FeatureRequest:
    """What a drafter needs from the target's forward pass."""

    final: bool = True  # last hidden state after the final norm (lm_head input)
    layers: tuple[int, ...] = ()  # outputs of these decoder layers (see the module docstring)
    logits: bool = False  # the target's next-token distribution (soft targets for distillation)
    streams: bool = False  # the last layer's residual streams [B, T, S, H] (hyper-connections: draftsmith.streams)


class TargetOutput:
    """The target's outputs over a batch: `final` [B, T, H] (post-norm last hidden state), `layers` (layer id ->
    [B, T, H]), `cache` (the KV cache, when the forward used one), and `logits` [B, T, V].

    `logits` is either given (captured features, a model whose logits are not its lm_head's output) or computed from
    `final` by `head`, the target's lm_head, on first access (`run_target`), under the grad and autocast modes of the
    forward: identical to the forward's own logits, and paid for only by a caller that reads them. `logits_at` reads
    the logits at a few positions without the whole [B, T, V] tensor."""

    def __init__(
        self,
        logits: Optional[torch.Tensor] = None,
        final: Optional[torch.Tensor] = None,
        layers: Optional[dict[int, torch.Tensor]] = None,
        cache: object = None,
        head: Optional[torch.nn.Module] = None,
        streams: Optional[torch.Tensor] = None,
    ):
        self._logits = logits
        self.final = final
        self.layers = {} if layers is None else layers
        self.streams = streams  # FeatureRequest.streams
        self.cache = cache
        self.head = head if logits is None else None
        self._modes = (torch.is_grad_enabled(), _autocast_state(final)) if self.head is not None else None

    @property
    def logits(self) -> Optional[torch.Tensor]:
        if self._logits is None and self.head is not None:
            self._logits = self._apply_head(self.final)
        return self._logits

    @logits.setter
    def logits(self, value: Optional[torch.Tensor]) -> None:
        self._logits, self.head = value, None

    def logits_at(self, index: torch.Tensor) -> torch.Tensor:
        """The logits at flat positions `index` (b * T + t), [len(index), V]: rows of `logits`,
        computed for those positions alone when they are computed from `final`."""
        if self._logits is None and self.head is not None:
            return self._apply_head(self.final.flatten(0, 1).index_select(0, index))
        return self.logits.flatten(0, 1).index_select(0, index)

    def _apply_head(self, hidden: torch.Tensor) -> torch.Tensor:
        grad, autocast = self._modes
        with torch.set_grad_enabled(grad), _autocast(hidden.device.type, autocast):
            return self.head(hidden)


def num_layers(model) -> int:
    """The target's decoder layers (a vision-language wrapper's: its language model's)."""
    return int(model.config.get_text_config().num_hidden_layers)


def check_layers(model, layers: Sequence[int]) -> None:
    check_layer_ids(num_layers(model), layers)


def check_layer_ids(count: int, layers: Sequence[int]) -> None:
    """Each of `layers` a hidden state of a target of `count` decoder layers (-1: the embeddings)."""
    for layer in layers:
        if not -1 <= layer < count:
            raise UserError(
                f"layer id {layer} is out of range for a target with {count} layers (valid: -1..{count - 1})"
            )


def _autocast_state(tensor: Optional[torch.Tensor]) -> Optional[torch.dtype]:
    """The autocast dtype in force for `tensor`'s device type, None when autocast is off."""
    if tensor is None:
        return None
    kind = tensor.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _autocast(kind: str, dtype: Optional[torch.dtype]):
    return torch.autocast(kind, dtype=dtype) if dtype is not None else torch.autocast(kind, enabled=False)


# model -> whether its logits are its lm_head applied to hidden_states[-1] (checked on its first forward)
_PLAIN_HEAD: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def _defers_logits(model) -> Optional[bool]:
    """Whether `run_target` may skip the lm_head in `model`'s forward and compute the logits from the
    final hidden state on demand: True, False, or None when not known yet (its first forward checks)."""
    if model in _PLAIN_HEAD:
        return _PLAIN_HEAD[model]
    try:
        takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_keep = False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not takes_keep or head is None:
        _PLAIN_HEAD[model] = False
        return False
    return None


def run_target(
    model,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    request: FeatureRequest = FeatureRequest(),
    position_ids: Optional[torch.Tensor] = None,
    cache=None,
    use_cache: bool = False,
) -> TargetOutput:
    """One forward of the target returning logits, the final hidden state and requested layers.

    The logits are what the model's forward returns, but where they are its lm_head applied to the final hidden state
    (checked once per model, on its first forward: logit soft-capping or scaling fails the check) the forward skips
    the lm_head (`logits_to_keep`) and `TargetOutput.logits` applies it on first access. A caller that never reads
    them (Medusa, a drafter trained on hard labels, the eval loop's prefill) never pays for the [B, T, V] projection;
    EAGLE-3 reads them at the positions its loss scores (`TargetOutput.logits_at`)."""
    want_layers = bool(request.layers)
    defer = _defers_logits(model)
    keep = {"logits_to_keep": torch.empty(0, dtype=torch.long, device=input_ids.device)} if defer else {}
    with last_layer_streams(model, request.streams) as captured:
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            output_hidden_states=True,
            return_dict=True,
            **keep,
        )
    hidden_states = outputs.hidden_states
    final = hidden_states[-1]
    head = model.get_output_embeddings() if defer else None
    if defer is None and final.dim() != input_ids.dim() + 1:  # first forward: one state a position, as drafters read
        raise UserError(
            f"cannot use target {type(model).__name__}: its hidden states are {tuple(final.shape)} for "
            f"{tuple(input_ids.shape)} tokens (streams stacked before the batch, as AltUp's), and draftsmith's "
            "drafters read one state a position"
        )
    if defer is None:  # first forward of this model: are its logits its lm_head's output?
        with torch.no_grad():
            _PLAIN_HEAD[model] = outputs.logits.shape == (*final.shape[:-1], outputs.logits.shape[-1]) and torch.equal(
                outputs.logits, model.get_output_embeddings()(final)
            )
    layers = {layer: layer_output(hidden_states, layer) for layer in request.layers} if want_layers else {}
    return TargetOutput(
        logits=None if defer else outputs.logits,
        final=final,
        layers=layers,
        cache=getattr(outputs, "cache", None) if use_cache else None,  # none: a model keeping its state in its modules
        head=head,
        streams=captured.get("streams"),
    )
