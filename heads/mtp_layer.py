"""The target's released MTP layer in its checkpoint: where a layout stores it (`Layout`), reading its tensors
(safetensors headers and files, a local folder or the Hub cache), and converting its decoder block between the
checkpoint's names and transformers' modules through a one-layer model of the target's class (`carrier`).
Apart from the drafter (heads/mtp.py), which holds the table of layouts and trains the layer.
"""

from __future__ import annotations

import contextlib
import re
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from draftsmith.errors import UserError
from draftsmith.families import COMPRESSED, FULL, INDEXED, LINEAR, SLIDING, clamp_lists
from draftsmith.heads import mtp_stacked
from draftsmith.heads.base import WEIGHTS_NAME
from draftsmith.heads.eagle_base import import_qualified
from draftsmith.heads.mtp_family import decoder_layers
from draftsmith.heads.mtp_plain import kept, strip
from draftsmith.model_files import TRANSFORMERS_LAYERS, checkpoint_folder, prefix_renamed, tensor_names
from draftsmith.target import shipped_config_json


@dataclass(frozen=True)
class Layout:
    """How a target architecture's checkpoint stores its MTP layers and how vLLM 0.32 computes them."""

    vllm_model: str  # vLLM's module for it (model_executor/models/<name>.py), or its class where a folder holds it
    count_key: str  # the config key holding the number of MTP layers
    names: tuple[str, ...]  # heads/mtp.py's WRAPPER modules (mtp_streams.ROLES for `streams`) as the checkpoint names
    after_layers: bool  # stored as layer N (N = num_hidden_layers) of the model, else under `mtp.`
    masks_first_position: bool  # the embedding at position 0 is zeroed
    feeds_back_normed: bool  # a later step reads final_norm(pre), else pre
    # the release stores the block as transformers' modules hold it (each projection's experts fused in one 3-D
    # tensor), not in the per-expert form transformers saves by default; the export writes the release's form
    fused_experts: bool = False
    # each MTP layer under its own `mtp.{j}.`, its wrapper and block tensors side by side (DeepSeek-V4's release,
    # in DeepSeek's original names), else the block under `mtp.layers.{j}.` beside one wrapper (Qwen)
    own_prefix: bool = False
    # the layer passes hyper-connection streams [.., streams, H] (DeepSeek-V4): heads/mtp_streams.py
    streams: bool = False
    # the streams are mixed by gated residuals, the target's laid side by side (Qwen4-Exp): heads/mtp_gated.py
    gated: bool = False
    # vLLM builds the block as this kind of layer (attention, MLP) whatever the target's last layer is (Dots3-Note's
    # sliding-window attention and dense MLP: layer N takes `mtp_layer_types`, and is past the layers with experts)
    block_kind: Optional[tuple[str, str]] = None
    # the layer's own embedding table, which vLLM reads in place of the target's (Dots3-Note's `has_own_embed_tokens`),
    # by its release name outside the layer's prefix; the drafter holds it as `embed_tokens.weight` under the prefix
    own_embedding: str = ""
    # where the MTP layers are stored when not after the decoder's layers: `mtp.`, or HY-V4's `model.mtp_layers.`
    under: str = "mtp."
    # the block is the family's decoder layer without its hyper-connections (heads/mtp_plain.py): the release
    # ships none for it and vLLM builds it on one residual stream (HY-V4, GLM-5-Next; MiniMax-M3's layer, which has
    # none, for its attention on the drafter's masks, and MiMo-V2-Flash's, for its sinks on eager attention)
    plain_block: bool = False
    # how the decoder's layers are named, an `after_layers` layout's among them (a vision-language wrapper's language
    # model's: GLM-5-Next's `model.language_model.`)
    decoder_prefix: str = "model."
    # where an `own_prefix` layout stores the block under the layer's prefix: beside the wrapper's tensors, or under
    # a module of its own (MiniMax-M3's `transformer_layer.`); another's first block, if not `layers.0.` (ERNIE-4.5's
    # `block.0.` under `model.mtp_`)
    block_prefix: str = ""
    # the block's tensors take the release's names, between which and its modules transformers converts in the
    # vision-language wrapper's class only (MiniMax-M3's: its language model's own class keeps its fused form): the
    # carrier is the wrapper, its decoder's layers under `decoder_prefix` as the release stores them
    wrapper_carrier: bool = False
    # the block is the family's decoder layer with short convolutions over the last tokens' inputs beside its
    # attention (Inkling's), run on the drafter's masks and cache by heads/mtp_convolved.py
    convolved: bool = False
    # the layer's input is [hidden | embedding] (Inkling's), not [embedding | hidden]
    hidden_first: bool = False
    # the target's embedding norm (its input embedding's `embed_norm`) applied to the embedding first where the
    # config's `use_embed_norm` says, and the logits divided by its `logits_mup_width_multiplier` (Inkling's)
    target_scales: bool = False
    # the top-level config block holding `count_key`, where vLLM reads it (Inkling's `mtp_config`), else the config
    # or its text_config
    count_block: str = ""
    count_at_top: bool = False  # the count at the top of a wrapper's config, where vLLM reads it (Exaone-4.5's)
    # layer tensors stored outside the layer's prefix: (name under the prefix, as the drafter names it; release name)
    # (Inkling's `chain_norm`, one for every depth, and the target's embedding norm, which vLLM reads from the folder)
    outside: tuple[tuple[str, str], ...] = ()
    # the block's attention kind where the config lists depth 0 among its `mtp_local_layer_ids` (Inkling's
    # sliding-window `hybrid_sliding`), else `block_kind`'s
    local_kind: str = ""
    # the block's modules the release names otherwise than transformers' decoder layer: (release's, transformers')
    # (MiMo-V2-Flash's `pre_mlp_layernorm.` for the layer's `post_attention_layernorm.`)
    block_renames: tuple[tuple[str, str], ...] = ()
    # the config key holding the window vLLM gives the block's sliding-window attention where transformers derives
    # another from it (MiMo-V2-Flash's `sliding_window_size`: vLLM attends that many keys, transformers one more)
    window_key: str = ""
    # vLLM builds depth j's block as the decoder's layer j (its kind, window; `block_kind`'s or refused) where the
    # config's `mtp_layer_types`, `mtp_sliding_windows` name none, read where `reads_mtp_fields` (not Exaone-4.5's)
    kind_of_layer_0: bool = False
    reads_mtp_fields: bool = True
    # the block is a stack of the family's decoder layers under `layers.{i}.`, the wrapper's tensors in its first and
    # last layer (Nemotron-H's `mtp_layers_block_type`): heads/mtp_stacked.py
    stacked: bool = False
    # the model type whose decoder layer vLLM builds the block as, not the target's (LongCat-Flash's deepseek_v2,
    # ERNIE-4.5's llama), its config the target's fields by name, `block_fields` over them (heads/mtp_family.py)
    block_family: str = ""
    block_fields: tuple[tuple[str, object], ...] = ()
    # (norm, config flag, rank field): vLLM loads the norm's weight times sqrt(hidden_size / rank) where the flag is
    # set (LongCat-Flash's MLA LoRA norms)
    scaled_norms: tuple[tuple[str, str, str], ...] = ()
    final_norm: bool = True  # else the logits and the next step read the block's output as is (ERNIE-4.5's)
    # vLLM's model runs depth `spec_step_idx % count` at draft step i, which its model runner V2 passes where the count
    # (its `num_nextn_predict_layers`) is above 1: several depths train as served (heads/mtp_depths.py)
    step_depths: bool = False
    # the vLLM release from which its model runs depth i at step i (None: every release that runs model runner V2);
    # earlier ones run depth 0 at every step (Qwen3-Next's, Qwen3.5's and GLM-5-Next's before 0.34.0: formats/mtp.py
    # says which serve a folder)
    step_depths_from: Optional[str] = None
    # the vLLM release from which its model feeds a later draft step the other state than `feeds_back_normed` says,
    # which the releases before it feed (GLM-4.5's: final_norm(pre) from 0.34.0); `drafter.feeds_back_normed` trains for
    # either
    feedback_changed_in: Optional[str] = None
    # why no vLLM release checked serves the layer as the checkpoint ships it ("": they do); the layout is then SGLang's
    # model's (formats/mtp_sglang.py), the only engine to serve it
    vllm_refused: str = ""

    def prefix(self, num_hidden_layers: int) -> str:
        """The first MTP layer's tensor names start with this."""
        if self.after_layers:
            return f"{self.decoder_prefix}layers.{num_hidden_layers}."
        return f"{self.under}0." if self.own_prefix else self.under

    def block(self) -> str:
        """Where the decoder layer's own tensors sit under `prefix`."""
        if self.after_layers:
            return ""
        if self.stacked:
            return "layers."
        return self.block_prefix or ("" if self.own_prefix else "layers.0.")

    def shared(self) -> tuple[str, ...]:
        """Tensors under the prefix that vLLM replaces by the target's (its embedding and lm_head)."""
        if self.after_layers:
            return ("embed_tokens.", "shared_head.head.")
        # DeepSeek-V4's copies are `emb.` and `head.`, HY-V4's `embed_tokens.` and `shared_head.`
        return ("emb.", "head.", "embed_tokens.", "shared_head.") if self.own_prefix else ()

    def layers_named(self, num_hidden_layers: int) -> str:
        """How the MTP layers' tensor names start (for a message)."""
        if self.after_layers:
            return f"{self.decoder_prefix}layers.{num_hidden_layers}.*"
        return self.under + ("{j}.*" if self.own_prefix else self.block().removesuffix("0.") + "{j}.*")

    def release_name(self, name: str, num_hidden_layers: int) -> str:
        """A tensor of the layer (named under the prefix) -> its name in the release."""
        own = self.own_embedding and name == OWN_EMBEDDING
        return self.own_embedding if own else dict(self.outside).get(name, self.prefix(num_hidden_layers) + name)

    def layer_name(self, release_name: str, num_hidden_layers: int) -> str:
        """`release_name`'s inverse."""
        if self.own_embedding and release_name == self.own_embedding:
            return OWN_EMBEDDING
        outside = {theirs: own for own, theirs in self.outside}
        return outside.get(release_name, release_name.removeprefix(self.prefix(num_hidden_layers)))

    def shipped_layers(self, names: Iterable[str], num_hidden_layers: int) -> set[int]:
        """The indices of the MTP layers whose tensors are among a checkpoint's tensor names: layers N, N+1, ...
        after the decoder's, `mtp.{j}` or `mtp.layers.{j}`."""
        if self.after_layers:
            pattern = re.compile(re.escape(self.decoder_prefix) + r"layers\.(\d+)\.")
        else:
            depth = "" if self.own_prefix else re.escape(self.block().removesuffix("0."))
            pattern = re.compile(re.escape(self.under) + depth + r"(\d+)\.")
        first = num_hidden_layers if self.after_layers else 0
        return {int(found[1]) for found in map(pattern.match, names) if found and int(found[1]) >= first}


READER = "drafter.type=mtp"  # what reads the target's checkpoint, in the line when it cannot
OWN_EMBEDDING = "embed_tokens.weight"  # Layout.own_embedding, as the drafter names it
# the target's embedding norm, as the drafter names it where a layout's export carries it (`Layout.outside`)
TARGET_EMBED_NORM = "target_embed_norm.weight"


def shipped_config(name_or_path: str, loaded: dict) -> dict:
    """The target's config.json as it ships (`shipped_config_json`); a vision-language wrapper's is its
    `text_config`, named by `loaded` (the language model's config as transformers loads it, dict form) as that
    language model: what vLLM serves beside the wrapper target; a wrapper draftsmith runs as its language model
    (`loaded` names the wrapper's architecture: GLM-5-Next) ships whole, as vLLM reads it."""
    shipped = shipped_config_json(name_or_path)
    if "text_config" not in shipped or shipped.get("architectures") == loaded["architectures"]:
        return shipped
    return {**shipped["text_config"], "architectures": loaded["architectures"], "model_type": loaded["model_type"]}


def layer_files(name_or_path: str, config: dict, layout: Layout) -> dict[Path, list[str]]:
    """The safetensors files of the target's checkpoint holding its first MTP layer, with those tensors' names,
    without the copies of the embedding and lm_head vLLM does not read."""
    folder = checkpoint_folder(name_or_path, READER)
    prefix = layout.prefix(decoder_layers(config))
    files: dict[Path, list[str]] = {}
    for name, path in tensor_names(folder).items():
        rest = name.removeprefix(prefix)
        if name.startswith(prefix) and not rest.startswith(layout.shared()) and first_layer(rest, layout):
            files.setdefault(path, []).append(name)
    if not files:
        raise UserError(f"drafter.type=mtp: {folder}'s weights hold no MTP layer (no tensor named {prefix}*)")
    if layout.own_embedding:
        found = tensor_names(folder).get(layout.own_embedding)
        if found is None:
            raise UserError(f"drafter.type=mtp: {folder}'s weights hold no {layout.own_embedding}, the MTP layer's own")
        files.setdefault(found, []).append(layout.own_embedding)
    for _, name in layout.outside:  # where the release has one: a layer lacking it is refused when it loads
        if name in tensor_names(folder):
            files.setdefault(tensor_names(folder)[name], []).append(name)
    return files


def read_layer(name_or_path: str, config: dict, layout: Layout) -> dict[str, torch.Tensor]:
    """The target's first MTP layer, its tensors named as in the checkpoint minus the prefix."""
    layers = decoder_layers(config)
    tensors = {}
    for path, names in layer_files(name_or_path, config, layout).items():
        with safe_open(str(path), "pt") as f:
            tensors.update({layout.layer_name(name, layers): f.get_tensor(name) for name in names})
    return tensors


def shipped_shapes(name_or_path: str, config: dict, layout: Layout) -> dict[str, tuple[int, ...]]:
    """Name (with the prefix) -> shape of each tensor of the target's first MTP layer (headers only): what
    vLLM loads for the layer, which an export must match."""
    shapes = {}
    for path, names in layer_files(name_or_path, config, layout).items():
        with safe_open(str(path), "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in names})
    return shapes


def first_layer(name: str, layout: Layout) -> bool:
    """Whether a tensor (named under the prefix) belongs to the first MTP layer: under `mtp.` the wrapper
    is shared and the blocks are `layers.{j}` (a stacked layout's are all the first layer's: vLLM serves one)."""
    if layout.after_layers or layout.own_prefix or layout.stacked:
        return True
    return not name.startswith(layout.block().removesuffix("0.")) or name.startswith(layout.block())


def layer_config(target_config, layout: Layout) -> dict:
    """The target's config for the one decoder layer the engine builds as the MTP block: of the kind of the
    layers after the dense ones (experts where the family has them: vLLM builds layer N, past
    `first_k_dense_replace`), with full attention (vLLM's `layer_type="full_attention"`), or the family's sparse
    attention where every layer that is not linear attention has it (DeepSeek-V3.2, GLM-5-Next: its cache layer keeps
    the indexer's keys too; its own indexer, as vLLM builds every MTP layer's), or sliding-window
    attention where the family compresses attention (DeepSeek-V4: vLLM builds the MTP layer with compress ratio 0,
    the trailing entry of the release's `compress_ratios`, which is its plain sliding-window attention with sinks), or
    the kind a layout names (`Layout.block_kind`: Dots3-Note's sliding dense layer, MiniMax-M3's block-sparse attention
    with experts, which vLLM forces on its MTP block whatever the target's layers have)."""
    values = target_config.to_dict()
    values = values.get("text_config") or values
    if layout.stacked:
        return mtp_stacked.stack_config(values)
    values["num_hidden_layers"] = 1
    if "first_k_dense_replace" in values:
        values["first_k_dense_replace"] = 0
    if isinstance(values.get("mlp_layer_types"), list):
        values["mlp_layer_types"] = values["mlp_layer_types"][-1:]
    # SwiGLU limit lists: Ling-3.0's block is layer N to vLLM, past their N entries, so unclamped (a release whose
    # class leaves them unread computes unclamped too, and one limit above 0 is refused: families.unserved_clamp)
    values.update({key: [0] for key in clamp_lists(values)})
    if values.get("ple_layer_ids"):  # Qwen4-Exp's n-gram embedding: vLLM's MTP layer (layer N) has none
        values["ple_layer_ids"] = []
    if isinstance(values.get("indexer_types"), list):  # vLLM's MTP layer runs an indexer of its own
        values["indexer_types"] = ["full"]
    if layout.block_kind is not None:
        attention, mlp = layout.block_kind
        attention = (layout.reads_mtp_fields and values.get("mtp_layer_types") or [attention])[0]
        if layout.local_kind and 0 in (values.get("mtp_local_layer_ids") or ()):
            attention = layout.local_kind
        kinds = values.get("layer_types") or []
        if "per_layer_config" in values:  # a family with per-layer overrides (Dots3-Note's): the first layer of that
            # kind's (transformers' `per_layer_config`, by layer index); a target with no such layer has none
            first = str(kinds.index(attention)) if attention in kinds else None
            values["per_layer_config"] = {"0": (values["per_layer_config"] or {}).get(first) or {}}
        values |= {"layer_types": [attention], "mlp_layer_types": [mlp]}
        if values.get(layout.window_key) is not None:  # popped: the config class would derive its own from it
            values["sliding_window"] = values.pop(layout.window_key)
    elif isinstance(values.get("layer_types"), list):
        kinds = set(values["layer_types"]) - {LINEAR}  # beside GLM-5-Next's indexed attention
        sparse, pooled = kinds == {INDEXED}, bool(kinds & set(COMPRESSED))
        values["layer_types"] = [INDEXED if sparse else SLIDING if pooled else FULL]
    return values


def count_holder(config: dict, layout: Layout) -> dict:
    """The part of a config (dict form) that holds the MTP layer count, where vLLM reads it: a block of its own
    (`Layout.count_block`, made where absent), a wrapper's text_config (its top: `count_at_top`), or the config."""
    if layout.count_block:
        return config.setdefault(layout.count_block, {})
    return config if layout.count_at_top else config.get("text_config") or config


def carrier(spec: dict, layout: Layout):
    """A one-layer model of the target's class (vocabulary of one token), whose transformers loading and
    saving code converts the block's tensors between checkpoint names and module parameters, and where its layer's
    tensors are named: a causal LM's, or the base model's of a wrapper's language model transformers has no causal LM
    class for (GLM-5-Next's, whose names in the wrapper's checkpoint are the base model's under a prefix), or the
    wrapper's, with a tiny vision tower, where only its class converts the release's names
    (`Layout.wrapper_carrier`)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    from draftsmith.causal_lm import may_be_a_causal_lm
    from draftsmith.tiny_wrapper import tiny_wrapper_config

    config = import_qualified(spec["config_class"]).from_dict(
        {**spec["config"], "vocab_size": 1, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    )
    config.tie_word_embeddings = False
    if layout.wrapper_carrier:
        wrapper = tiny_wrapper_config(wrapper_model_type(config), config, released=True)
        wrapper.tie_word_embeddings = False
        return wrapper, AutoModelForImageTextToText, f"{layout.decoder_prefix}layers.0."
    if may_be_a_causal_lm(config.model_type):
        return config, AutoModelForCausalLM, "model.layers." if layout.stacked else "model.layers.0."
    return config, AutoModel, "layers.0."


def wrapper_model_type(text_config) -> str:
    """The model type of the vision-language wrapper whose language model `text_config` configures: the config class
    beside it whose `text_config` is of its class."""
    module = sys.modules[type(text_config).__module__]
    return next(
        value.model_type
        for value in vars(module).values()
        if isinstance(value, type) and getattr(value, "sub_configs", {}).get("text_config") is type(text_config)
    )


def carried_layer(model: nn.Module, layout: Layout) -> nn.Module:
    """The carrier's one decoder layer, or a stacked layout's layers."""
    layers = model.get_decoder().layers
    return layers if layout.stacked else layers[0]


@contextlib.contextmanager
def quiet_transformers():
    """No load report or progress bar from the carrier's loading and saving: its embedding, norm and lm_head
    are missing by design, and the user sees no model load of theirs."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def block_from_checkpoint(tensors: dict[str, torch.Tensor], spec: dict, layout: Layout) -> dict[str, torch.Tensor]:
    """The block's checkpoint tensors (names under the block) -> its parameters, by transformers' loader (a plain
    block's: the layer's but for its hyper-connections, which the release does not ship)."""
    config, auto, at = carrier(spec, layout)
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        renames = layout.block_renames
        named = {f"{at}{prefix_renamed(name, renames)}": tensor.contiguous() for name, tensor in tensors.items()}
        save_file(named, str(Path(tmp) / WEIGHTS_NAME), metadata={"format": "pt"})
        with quiet_transformers():
            model, info = auto.from_pretrained(
                tmp, dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True, **TRANSFORMERS_LAYERS
            )
    missing = [
        name
        for name in info["missing_keys"]
        if name.startswith(at) and (not layout.plain_block or kept(name.removeprefix(at)))
    ]
    unexpected = [name.removeprefix(at) for name in info["unexpected_keys"]]
    if missing or unexpected:
        raise UserError(
            f"drafter.type=mtp: the checkpoint's MTP layer does not match the target's decoder layer (missing "
            f"{[name.removeprefix(at) for name in missing][:3]}, unexpected {unexpected[:3]})"
        )
    if info.get("mismatched_keys"):  # (name, the checkpoint's shape, the layer's shape)
        name, theirs, ours = min(info["mismatched_keys"])
        raise UserError(
            f"drafter.type=mtp: the checkpoint's MTP layer does not match the target's decoder layer "
            f"({name.removeprefix(at)} is {list(theirs)}, the layer's is {list(ours)})"
        )
    state = carried_layer(model, layout).state_dict()
    return {name: t for name, t in state.items() if kept(name)} if layout.plain_block else state


def block_to_checkpoint(block: nn.Module, spec: dict, layout: Layout) -> dict[str, torch.Tensor]:
    """The block's parameters -> its checkpoint tensors (names under the block), by transformers' saver: in
    the release's form (`Layout.fused_experts`; a plain block's without the layer's hyper-connections)."""
    config, auto, at = carrier(spec, layout)
    model = auto.from_config(config, dtype=torch.float32)
    layer = strip(carried_layer(model, layout)) if layout.plain_block else carried_layer(model, layout)
    layer.load_state_dict({k: v.float() for k, v in block.state_dict().items()})
    with tempfile.TemporaryDirectory() as tmp, quiet_transformers():
        model.save_pretrained(tmp, save_original_format=not layout.fused_experts)
        saved = load_file(str(Path(tmp) / WEIGHTS_NAME))
    dtype = next(block.parameters()).dtype
    release = tuple((theirs, own) for own, theirs in layout.block_renames)
    if layout.stacked:  # the original format renames the decoder too (a release's `backbone.` for `model.`)
        first = next(iter(layer.state_dict()))
        at = next(name.removesuffix(first) for name in saved if name.endswith(f".{first}"))
    saved_block = {name.removeprefix(at): tensor for name, tensor in saved.items() if name.startswith(at)}
    return {prefix_renamed(name, release): tensor.to(dtype) for name, tensor in saved_block.items()}
