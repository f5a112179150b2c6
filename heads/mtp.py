"""MTP: the target's own multi-token-prediction layer, shipped in its checkpoint, fine-tuned as the drafter.

Bailing-Hybrid (Ling-3.0), DeepSeek-V3, V3.2 and V4, Dots3-Note, ERNIE-4.5, Exaone-MoE, Exaone-4.5, GLM-4.5,
GLM-4.7-Flash, GLM-5 and GLM-5-Next, HY-V3, HY-V4, Inkling, LongCat-Flash, MiMo-V2-Flash, MiniMax-M3, Nemotron-H,
Qwen3-Next, Qwen3.5 and Qwen4-Exp ship, next to their decoder layers, a layer trained to predict the token after next.
transformers drops it at load (the families' `_keys_to_ignore_on_load_unexpected`); vLLM serves it as the `mtp` method,
SGLang as its NEXTN algorithm (formats/mtp_sglang.py; GLM-4.7-Flash's by SGLang only). This kind reads it from
the target's safetensors, builds it as vLLM 0.32's `*_mtp.py` model for that architecture computes it, trains it on the
target's own distribution several steps ahead, each step fed its previous step's output (EAGLE's training-time test),
and exports it back under the checkpoint's own names (formats/mtp.py).

Draft position p reads the target's final (post-norm) hidden state f_p, the hidden state vLLM hands its
MTP proposer, and the embedding of the next token x_{p+1}:

    pre = block(proj(cat(embed_norm(e(x_{p+1})), hidden_norm(f_p))))     block: one decoder layer of the
    logits = lm_head(final_norm(pre))                                    target's family, MoE/MLA/sparse as its own

where e is the target's embedding, zeroed at position 0 in vLLM's DeepSeek and GLM models (SGLang's read it:
`drafter.masks_first_position`), and lm_head the target's (both engines share both with the target; the checkpoint's
copies are not read). A later draft step reads the previous step's `final_norm(pre)` (DeepSeek, GLM-5, HY-V4, Qwen)
or `pre` itself (GLM-4.5, MiniMax-M3), as vLLM's proposer feeds them back
(docs/results/vllm-0.32-source-2026-families.md, section 2). DeepSeek-V4's layer passes hyper-connection streams
instead, and reads the target's last layer's (heads/mtp_streams.py; Qwen4-Exp's, mixed by gated residuals:
heads/mtp_gated.py); HY-V4's and GLM-5-Next's block is their decoder layer without its hyper-connections
(heads/mtp_plain.py), as is MiniMax-M3's, its block-sparse attention on the drafter's masks (heads/mtp_blocks.py);
Nemotron-H's is a stack of its attention and expert layers, the wrapper's tensors stored in its first and last
(heads/mtp_stacked.py). Inkling's reads [hidden | embedding], its embedding normed by the target's embedding norm
first, its block the decoder layer with its short convolutions (heads/mtp_convolved.py), its chain norm (if any) as
the final norm, its logits divided by the target's muP multiplier (`head_input`), as vLLM's. LongCat-Flash's and
ERNIE-4.5's block is another family's decoder layer, DeepSeek-V2's and Llama's (heads/mtp_family.py); ERNIE-4.5's
logits read its output with no final norm. Decoding is EAGLE's: the layer's own KV cache over the committed
sequence, a chain or a dynamic tree grown from it (EagleProposer); vLLM and SGLang verify chains.

The first MTP layer runs every draft step (vLLM 0.32's V1 runner runs layer 0 whatever the count), but Inkling's
depths and `drafter.mtp_depths` of a layout whose vLLM model reads the step: depth i at step i (heads/mtp_depths.py).
The block's tensors are converted between the checkpoint's names and transformers' modules (fused experts) by
transformers' own loading and saving code, through a one-layer model of the target's class (heads/mtp_layer.py).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

import draftsmith.heads.mtp_depths as mtp_depths
from draftsmith.errors import UserError
from draftsmith.families import norm_eps, sliding_window, within_window
from draftsmith.heads import mtp_convolved, mtp_family, mtp_gated, mtp_plain, mtp_stacked, mtp_streams, register
from draftsmith.heads.base import FlopProfile
from draftsmith.heads.eagle_base import EagleBase, import_qualified
from draftsmith.heads.mtp_config import MtpConfig
from draftsmith.heads.mtp_family import decoder_layers, qualified
from draftsmith.heads.mtp_layer import (
    OWN_EMBEDDING,
    READER,
    TARGET_EMBED_NORM,
    Layout,
    block_from_checkpoint,
    block_to_checkpoint,
    layer_config,
    read_layer,
    shipped_config,
)
from draftsmith.heads.mtp_layouts import LAYOUTS, layout_of
from draftsmith.heads.packing import causal_document_mask, documents, positions, shifted
from draftsmith.heads.proposer import DraftState
from draftsmith.heads.vocab_loss import chunk_rows_for, steps_ahead_loss
from draftsmith.hub_cache import hub_revision
from draftsmith.model_files import checkpoint_folder, tensor_names
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape, loaded_config

if TYPE_CHECKING:
    from transformers import DynamicCache

# The drafter's modules around the block, by role; a layout names them as its checkpoint does.
WRAPPER = mtp_depths.WRAPPER


def check_ships_a_layer(config: dict, layout: Layout, name_or_path: str) -> None:
    """A target whose config (dict form) counts no MTP layer is refused in one line. Where the count is absent, as in
    Qwen3-Next's release (its checkpoint ships `mtp.*` all the same), vLLM 0.32 serves one layer (Qwen3-Next's and
    Qwen3.5's models default the count to 1; DeepSeek-V3's and GLM-4.5's read transformers' config class, whose
    default is 1): then the layers in the checkpoint's tensor names say (safetensors headers only)."""
    text = text_fields(config)
    count = config.get(layout.count_key, text.get(layout.count_key))
    if layout.count_block:  # read where vLLM reads it
        count = (config.get(layout.count_block) or {}).get(layout.count_key)
    if count is not None:
        if not int(count):
            raise UserError(
                f"drafter.type=mtp: the target ships no MTP layer ({layout.count_key} is 0 in its config.json); "
                "train another kind"
            )
        return
    layers = decoder_layers(text)
    if not layout.shipped_layers(tensor_names(checkpoint_folder(name_or_path, READER)), layers):
        raise UserError(
            f"drafter.type=mtp: the target ships no MTP layer (its config.json has no {layout.count_key} and its "
            f"weights no tensor named {layout.layers_named(layers)}): point target.name_or_path at the released "
            f"checkpoint (transformers drops the layer when it saves a model; {RANDOM_LAYER}), or train another kind"
        )


# what gives a tiny target of the docs' "Try it" a layer to fine-tune (docs/targets-mtp.md)
RANDOM_LAYER = (
    "a target written by python -m draftsmith.random_target gets a random one from python -m "
    "draftsmith.heads.mtp_random_layer DIRECTORY"
)


def text_fields(config: dict) -> dict:
    """A target config's (dict form) language-model fields: a vision-language wrapper's text_config."""
    return config.get("text_config") or config


def fed_back(layout: Layout, normed: Optional[bool]) -> Layout:
    """The layout as `drafter.feeds_back_normed` trains it (None: as it is, as the vLLM releases before its
    `feedback_changed_in` compute it); one line for a feedback no vLLM release checked computes."""
    if normed is None or normed == layout.feeds_back_normed:
        return layout
    if not layout.feedback_changed_in:
        fed = "after" if layout.feeds_back_normed else "before"
        raise UserError(
            f"drafter.feeds_back_normed={str(normed).lower()}: every vLLM release checked feeds {layout.vllm_model}'s "
            f"later draft steps the MTP layer's output {fed} its final norm; leave it null"
        )
    return replace(layout, feeds_back_normed=normed)


def first_position(layout: Layout, masked: Optional[bool]) -> Layout:
    """The layout as `drafter.masks_first_position` trains it (None: as vLLM computes it); one line for a zeroed first
    position where no engine checked zeroes it (SGLang's NextN models read it where vLLM's models zero it)."""
    if masked is None or masked == layout.masks_first_position:
        return layout
    if masked:
        served = f"vLLM's {layout.vllm_model}" if not layout.vllm_refused else "SGLang's model (no vLLM serves it)"
        raise UserError(
            f"drafter.masks_first_position=true: {served} does not zero the embedding at position 0, nor does an "
            "SGLang model draftsmith checked; leave it null"
        )
    return replace(layout, masks_first_position=False)


def check_target_folder(
    name_or_path: str, feeds_back_normed: Optional[bool] = None, masks_first_position: Optional[bool] = None
) -> None:
    """For a local target: its config names an MTP layout (one that computes `feeds_back_normed` and
    `masks_first_position`) and its weights hold the first MTP layer (the safetensors headers only); a Hub id is checked
    when the target loads."""
    folder = Path(name_or_path)
    if not (folder / "config.json").is_file():
        return
    config = json.loads((folder / "config.json").read_text())
    layout = first_position(fed_back(layout_of(config), feeds_back_normed), masks_first_position)
    check_ships_a_layer(config, layout, str(folder))
    prefix = layout.prefix(decoder_layers(text_fields(config)))
    if not any(name.startswith(prefix) for name in tensor_names(folder)):
        raise UserError(
            f"drafter.type=mtp: {folder}'s weights hold no MTP layer (no tensor named {prefix}*; transformers drops "
            f"it when it saves a model): point target.name_or_path at the released checkpoint ({RANDOM_LAYER})"
        )


@register
class Mtp(EagleBase):
    type = "mtp"
    TITLE = "MTP"
    Config = MtpConfig
    SERVED_BY = {"chain": ("vllm", "sglang"), "tree": ()}  # SGLang: one depth (formats/mtp_sglang.py)

    def __init__(self, config: MtpConfig, target: TargetShape):
        super().__init__(config, target)
        spec = config.decoder
        # transformers' loop over the experts (a block of a family with experts): runs forward and backward
        # on any device; from_pretrained would pick a kernel, a layer built alone gets none
        self.layer_config._experts_implementation = "eager"
        built = mtp_depths.layout_for(LAYOUTS[spec["architecture"]], self.layer_config)
        self.layout = first_position(fed_back(built, config.feeds_back_normed), config.masks_first_position)
        hidden, eps = target.hidden_size, norm_eps(self.layer_config)
        norm = import_qualified(spec["norm"])  # the target's RMSNorm (Qwen's computes x * (1 + w))
        if self.layout.gated:  # no final norm: the layer's own mixer feeds the lm_head
            mtp_gated.build(self, hidden, eps, norm, import_qualified(spec["collapse"]))
        else:
            self.embed_norm, self.hidden_norm = norm(hidden, eps=eps), norm(hidden, eps=eps)
            if self.layout.final_norm:
                self.final_norm = norm(hidden, eps=eps)
            if self.layout.streams:
                mtp_streams.build(self, hidden, import_qualified(spec["collapse"]))
            else:
                self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        if self.layout.own_embedding:  # frozen as the target's table is for the other layouts: a vocabulary's rows
            self.own_embed = nn.Embedding(target.vocab_size, hidden).requires_grad_(False)
        self.block = self.build_block(import_qualified(spec["layer"]))
        mtp_depths.build(self, norm, eps)  # a layout's later depths, one per draft step
        for block in (self.block, *(depth.block for depth in getattr(self, "depths", ()))):
            for module in block.modules():  # a layer built alone runs SDPA, which drops attention sinks (V4's)
                if isinstance(getattr(module, "sinks", None), nn.Parameter):
                    module.config._attn_implementation = "eager"  # as the target's class runs, and vLLM computes
            indexer = getattr(getattr(block, "self_attn", None), "indexer", None)
            if indexer is not None:
                # V3.2's sparse-attention indexer stays as shipped: transformers runs it without gradients (DeepSeek
                # trains it apart, on its own loss), and a parameter no loss reaches would stall DDP's reduction
                indexer.requires_grad_(False)

    def build_block(self, layer_class, config=None) -> nn.Module:  # `config`: a later depth's (heads/mtp_depths.py)
        if self.layout.stacked:
            return mtp_stacked.StackedBlock(layer_class, self.layer_config)
        layer = layer_class(config or self.layer_config, layer_idx=0)
        if self.layout.gated:
            return mtp_gated.GatedBlock(layer, self.rotary_emb)
        if self.layout.convolved:
            return mtp_convolved.ConvolvedBlock(layer)
        if self.layout.block_family:
            mtp_family.with_config_eps(layer, norm_eps(self.layer_config))
            mtp_family.with_scaled_norms(layer, self.config.decoder["norm_scales"])
        return mtp_plain.PlainBlock(layer) if self.layout.plain_block else layer

    @classmethod
    def for_target(cls, config: MtpConfig, target: TargetShape, target_config) -> MtpConfig:
        """The target's architecture, which decides whether the layer reads its streams (`features`), for a stage
        that builds no drafter (the capture); `from_target` records it with the layer's classes."""
        if config.decoder is not None:
            return config
        return replace(config, decoder={"architecture": (target_config.architectures or ["?"])[0]})

    @classmethod
    def features(cls, config: MtpConfig, target: TargetShape) -> FeatureRequest:
        layout = LAYOUTS.get(config.decoder["architecture"]) if config.decoder is not None else None
        return FeatureRequest(final=True, logits=True, streams=layout is not None and layout.streams)

    @classmethod
    def flop_profile(cls, config: MtpConfig) -> FlopProfile:
        return FlopProfile(passes=config.ttt_steps)

    @classmethod
    def max_chain(cls, config: MtpConfig) -> Optional[int]:
        return mtp_depths.longest_chain(config)  # several depths: D (vLLM's step i >= D shares a depth's cache)

    @classmethod
    def proposes_trees(cls, config: MtpConfig) -> bool:  # several depths: chains (DepthsProposer), as vLLM verifies
        return mtp_depths.longest_chain(config) is None

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, config: MtpConfig, target_model, name_or_path: str) -> Mtp:
        values = loaded_config(target_model)
        layout = layout_of(values)
        # the release's files at the commit the target was loaded from, whatever its Hub main holds now
        files = str(checkpoint_folder(name_or_path, READER, hub_revision(target_model)))
        if layout.count_at_top:  # beside the wrapper's text_config, which alone configures the loaded language model
            values |= {k: v for k, v in shipped_config(files, values).items() if k == layout.count_key}
        check_ships_a_layer(values, layout, files)
        later = mtp_depths.read_depths(files, values, layout, config.mtp_depths)
        return cls.from_layer(config, target_model, name_or_path, read_layer(files, values, layout) | later)

    @classmethod
    def from_layer(cls, config: MtpConfig, target_model, name_or_path: str, tensors: dict[str, torch.Tensor]) -> Mtp:
        """The drafter holding an MTP layer given as its checkpoint tensors (names under the layer's prefix)."""
        drafter = cls.unloaded(config, target_model, name_or_path)
        drafter.load_layer(tensors)
        return drafter

    @classmethod
    def unloaded(cls, config: MtpConfig, target_model, name_or_path: str) -> Mtp:
        """The drafter for this target with the layer's weights as its classes initialise them."""
        target_config, values = target_model.config, loaded_config(target_model)
        layout = layout_of(values)  # a target without a served MTP layout: its one line, before anything is built
        text = getattr(target_config, "text_config", None) or target_config
        inner = target_model.model
        spec = {
            "architecture": values["architectures"][0],
            "layer": qualified(type(inner.layers[0])),
            # a family without rotary embeddings (GLM-5-Next's NoPE attention) has no table
            "rotary": qualified(type(inner.rotary_emb)) if hasattr(inner, "rotary_emb") else None,
            "norm": qualified(type(final_norm_of(inner))),
            "config_class": qualified(type(text)),
            "config": layer_config(target_config, layout),
        }
        if layout.block_family:  # the block another family's layer, the wrapper's norms the target's
            spec |= mtp_family.block_spec(target_config, layout)
        if layout.streams:  # the layer's own collapse of its streams is the target's kind (its hc_head, or mixer)
            spec["collapse"] = qualified(type(inner.hyper_connection_mixer if layout.gated else inner.hc_head))
        drafter = cls(replace(config, decoder=spec), TargetShape.of(target_model, name_or_path))
        drafter.attach_target(target_model)
        return drafter

    def load_layer(self, tensors: dict[str, torch.Tensor]) -> None:
        block, (tensors, later) = self.layout.block(), mtp_depths.apart(tensors)
        wrapper = self.wrapper_names()
        missing = [name for name in wrapper.values() if name not in tensors]
        if missing:
            raise UserError(f"drafter.type=mtp: the checkpoint's MTP layer lacks {missing}")
        state = {own: tensors[theirs] for own, theirs in wrapper.items()}
        for own, tensor in state.items():
            expected = self.get_parameter(own).shape
            if tensor.shape != expected:
                raise UserError(
                    f"drafter.type=mtp: the checkpoint's MTP layer does not match the target ({wrapper[own]} is "
                    f"{list(tensor.shape)}, the target's hidden size makes it {list(expected)})"
                )
        apart = (*wrapper.values(), OWN_EMBEDDING)  # a stacked block holds the wrapper's tensors in its layers
        block_tensors = {n.removeprefix(block): t for n, t in tensors.items() if n.startswith(block) and n not in apart}
        if self.layout.own_embedding:
            state["own_embed.weight"] = tensors[OWN_EMBEDDING]
        converted = block_from_checkpoint(block_tensors, self.config.decoder, self.layout)
        state |= {f"block.{name}": t for name, t in converted.items()} | mtp_depths.state_of(self, later)
        dtype = self.embed_norm.weight.dtype
        self.load_state_dict({name: t.to(dtype) for name, t in state.items()})

    def wrapper_names(self) -> dict[str, str]:
        names = wrapper_names(self.layout)
        return mtp_stacked.placed(names, len(self.block)) if self.layout.stacked else names

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The layer under its checkpoint names (without the prefix): what formats/mtp.py writes."""
        out = {theirs: self.get_parameter(own).detach() for own, theirs in self.wrapper_names().items()}
        block = self.layout.block()
        saved = block_to_checkpoint(self.block, self.config.decoder, self.layout)
        out |= {block + name: t for name, t in saved.items()}
        if self.layout.target_scales and getattr(self.layer_config, "use_embed_norm", False):
            out[TARGET_EMBED_NORM] = self.target_modules()[0].embed_norm.weight.detach()  # frozen, as the target's
        out |= mtp_depths.checkpoint_tensors(self)
        return out | ({OWN_EMBEDDING: self.own_embed.weight.detach()} if self.layout.own_embedding else {})

    # -- the draft model ------------------------------------------------------------------------
    def draft(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        cache: Optional[DynamicCache] = None,
        depth: int = 0,
    ) -> torch.Tensor:
        """pre = block(proj(cat(embed_norm(e), hidden_norm(f)))), or a streams layout's (heads/mtp_streams.py);
        returns what a later step reads (see the module docstring), which `top_tokens` turns into logits (`depth`:
        heads/mtp_depths.py)."""
        held = mtp_depths.part(self, depth)
        embedded = (self.own_embed(tokens) if self.layout.own_embedding else self.embed(tokens)).to(features.dtype)
        if self.layout.masks_first_position:
            embedded = torch.where(positions[..., None] == 0, 0.0, embedded)
        if self.layout.target_scales and getattr(self.layer_config, "use_embed_norm", False):
            embedded = self.target_modules()[0].embed_norm(embedded)  # the target's, as its layers read it
        if self.layout.streams:
            parts = mtp_depths.streams_parts(self.layout)
            hidden = parts.combine(held, embedded, features)
            arguments = parts.block_arguments(self, hidden, positions, mask)
        else:
            inputs = [held.embed_norm(embedded), held.hidden_norm(features)]
            hidden = held.proj(torch.cat(inputs[::-1] if self.layout.hidden_first else inputs, dim=-1))
            # a family whose rotary tables differ by layer kind (Dots3-Note's) is given the block's
            kinds = self.layout.block_kind and "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
            kind = {"layer_type": self.layer_config.layer_types[0]} if kinds else {}
            arguments = {"attention_mask": mask, "position_embeddings": self.rotary_emb(hidden, positions, **kind)}
        pre = held.block(hidden, position_ids=positions, cache=cache, **arguments)
        if isinstance(pre, tuple):  # GLM-5's layer returns its top-k selection beside, for a later layer to share
            pre = pre[0]
        return held.final_norm(pre) if self.layout.feeds_back_normed else pre

    def head_input(self, fed_back: torch.Tensor, depth: int = 0) -> torch.Tensor:
        if self.layout.streams:
            return mtp_depths.streams_parts(self.layout).head_input(mtp_depths.part(self, depth), fed_back)
        as_fed = self.layout.feeds_back_normed or not self.layout.final_norm  # else depth's final norm
        normed = fed_back if as_fed else mtp_depths.part(self, depth).final_norm(fed_back)
        # vLLM's logits of a layout that scales them: the lm_head's on the state divided by the muP multiplier
        scale = getattr(self.layer_config, "logits_mup_width_multiplier", None) if self.layout.target_scales else None
        return normed / scale if scale else normed

    def top_tokens(self, feature: torch.Tensor, k: int, depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        _, lm_head = self.target_modules()
        logits = lm_head(self.head_input(feature, depth).to(lm_head.weight.dtype)).float()
        # Clamped so that rounding never lets a child outscore its parent (EagleProposer.grow).
        best = logits.log_softmax(-1).clamp(max=0).topk(k)
        return best.values, best.indices

    def committed_features(self, state: DraftState) -> Optional[torch.Tensor]:
        features = state.new_streams if self.layout.streams else state.new_final
        return None if features is None else features.to(self.embed_norm.weight.dtype)

    def proposer(self, temperature: float = 0.0):
        return mtp_depths.DepthsProposer(self) if hasattr(self, "depths") else super().proposer(temperature)

    def new_cache(self) -> DynamicCache:
        return mtp_convolved.new_cache() if self.layout.convolved else super().new_cache()

    def attention_window(self) -> Optional[int]:
        return sliding_window(self.layer_config)  # the block's (mtp_layer.layer_config): DeepSeek-V4's

    # -- training -------------------------------------------------------------------------------
    def loss(self, batch: dict, target_out: TargetOutput):
        """The training-time test over `ttt_steps` draft steps, teacher-forced on the data's tokens.

        With x_t = input_ids[:, t] and f_t the target's final hidden state at t, step i (0 first) at
        position t reads x_{t+i+1} and, for i = 0, f_t, else step i-1's output at t, sits at position t+i,
        and guesses x_{t+i+2}: its soft label is the target's distribution there (its logits at t+i+1). It
        attends to step 0's entries at positions <= t of its document and to its own earlier steps at t,
        as the decode loop's cache holds them when it drafts its (i+1)-th token. Counted where x_{t+i+2}
        is supervised and in t's document; summed over positions and steps (step i weighs ttt_decay**i).
        """
        if hasattr(self, "depths"):  # a depth per step, each over the whole sequence
            return mtp_depths.loss(self, batch, target_out)
        input_ids = batch["input_ids"]
        rows, length = input_ids.shape
        width, device, steps = length - 1, input_ids.device, self.config.ttt_steps
        docs, places = documents(batch), positions(batch)
        committed = causal_document_mask(docs[:, :width])  # step 0's entries, [B, 1, W, W]
        own = torch.eye(width, dtype=torch.bool, device=device).expand(rows, 1, width, width)
        cache = self.new_cache()
        fed = self.target_features(target_out)[:, :width].to(self.embed_norm.weight.dtype)
        window, keys = self.attention_window(), places[:, None, None, :width]
        outputs = []
        for step in range(steps):
            seen = committed
            if window is not None:  # step 0's entry at s, from position t + step: as decoding's window masks it
                seen = committed & within_window(places[:, None, :width, None] + step, keys, window)
            mask = torch.cat([seen] + [own] * step, dim=-1)
            fed = self.draft(shifted(input_ids, step + 1, width), fed, places[:, :width] + step, mask, cache)
            outputs.append(self.head_input(fed))
        _, lm_head = self.target_modules()
        chunk_rows = chunk_rows_for(self.loss_chunk_bytes, self.target.vocab_size)
        loss, stats = steps_ahead_loss(outputs, batch, target_out, lm_head.weight, self.config.ttt_decay, chunk_rows)
        return loss, self.loss_tokens(batch), stats

    def target_features(self, target_out: TargetOutput) -> torch.Tensor:
        """What step 0 reads of the target, [B, T, ..]: its final hidden state, or a streams layout's streams."""
        return target_out.streams if self.layout.streams else target_out.final


def final_norm_of(decoder: nn.Module) -> nn.Module:
    """The decoder's final norm, whose class the layer's norms are (Nemotron-H's `norm_f`; Qwen4-Exp's decoder ends
    in its mixer, whose norm is the family's)."""
    for name in ("norm", "norm_f"):
        if hasattr(decoder, name):
            return getattr(decoder, name)
    return decoder.hyper_connection_mixer.hc_norm


def wrapper_names(layout: Layout) -> dict[str, str]:
    """The drafter's parameters around the block -> their names in the checkpoint (under the layer's prefix)."""
    names = {f"{own}.weight": f"{theirs}.weight" for own, theirs in zip(mtp_depths.roles_of(layout), layout.names)}
    return names | (mtp_depths.streams_parts(layout).COLLAPSE_NAMES if layout.streams else {})
