"""Several MTP depths, one per draft step, as vLLM 0.32 serves them: Inkling's release count (`mtp_config`, with a
chain norm or none, `chain_hidden_post_norm`) or `drafter.mtp_depths` of a layout whose vLLM model reads the step
(`Layout.step_depths`: DeepSeek-V3's, V3.2's, GLM-4.5's, GLM-5's, HY-V3's and Dots3-Note's layers N + j, DeepSeek-V4's
`mtp.{j}.`, HY-V4's `model.mtp_layers.{j}.`, Qwen3-Next's, Qwen3.5's, Exaone-MoE's and Exaone-4.5's blocks
`mtp.layers.{j}.`).
V3.2's, GLM-5's and HY-V4's depths are sparse-attention layers: each its own indexer, and each step's cache its
indexer's keys beside its keys, cut with them (`cut`), as vLLM builds each depth's indexer key cache; DeepSeek-V4's
and Dots3-Note's attend in a sliding window, each step's cache every key, the masks hiding those out of the window;
DeepSeek-V4's pass hyper-connection streams, each depth its own collapse (hc_head) of them.

Those models run depth `spec_step_idx % count` at draft step i (InklingMTP builds min(depths, num_speculative_tokens));
vLLM's model runner V2 (the default where Triton is) hands them step i through MultiModuleMTPSpeculator
(v1/worker/gpu/spec_decode/multi_module_mtp/speculator.py, `use_multi_module_mtp`: a `num_nextn_predict_layers` and
num_speculative_tokens both above 1).
That speculator runs each depth over the whole draft query, not at one position ahead: step i feeds depth i the
previous depth's outputs at the same positions and the tokens shifted left once more, so depth i's KV cache (and
its convolutions' history) holds its own entries over the committed sequence, re-prefilled where a token they read
was a rejected draft. With x_t the tokens, f_t the target's final hidden state and h^{-1} = f:

    h^i_t  = chain_norm(depth_i(h^{i-1}_t, x_{t+i+1}))   causal over its own entries h^i_{<=t} of t's document
    logits = lm_head(h^i_t) / logits_mup_width_multiplier   guess x_{t+i+2}

(no chain norm: h^i_t is the block's output, read as is by the lm_head and the next depth, as vLLM's
`chain_norm = None`; another layout's h^i is its one-layer formula, heads/mtp.py, by depth i's block and the wrapper
modules depth i ships, its final norm among them, which vLLM's compute_logits reads at step i). Training (`loss`)
computes exactly that for every t, step i by depth i % D; decoding (`DepthsProposer`) keeps each step's cache over
the committed positions whose tokens it read were committed. vLLM's V1 model runner (the CPU build's) passes no step
(EagleProposer): it would run depth 0 at every step. A step i >= D runs depth i % D here on a cache of its own, where
vLLM's speculator writes its entries into that depth's cache at the query's slots: the eval's and the export's chains
are held to D (`longest_chain`), training's steps are not.
Depth 0 is the drafter's own modules (heads/mtp.py); depth j >= 1 is `depths[j - 1]`, exported under its release
names (`prefix`; named `depths.{j}.` in the drafter's checkpoint tensors), and the count with them.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
from safetensors import safe_open
from torch import nn

from draftsmith.errors import UserError
from draftsmith.families import within_window
from draftsmith.heads import mtp_gated, mtp_streams
from draftsmith.heads.eagle_base import import_qualified
from draftsmith.heads.mtp_family import decoder_layers
from draftsmith.heads.mtp_layer import (
    READER,
    Layout,
    block_from_checkpoint,
    block_to_checkpoint,
)
from draftsmith.heads.mtp_layouts import LAYOUTS, check_layer_0_kind, layout_of
from draftsmith.heads.packing import causal_document_mask, documents, positions, shifted
from draftsmith.heads.proposer import DraftState, DraftTree, Proposer, Tree
from draftsmith.heads.vocab_loss import chunk_rows_for, steps_ahead_loss
from draftsmith.model_files import checkpoint_folder, tensor_names

DEPTHS = "depths."  # how the drafter names a later depth's tensors: depths.{j}.<name under its release prefix>
# The drafter's modules around the block, by role, in a layout's `names` order: a depth owns those the release
# stores under its prefix (`own_roles`).
WRAPPER = ("embed_norm", "hidden_norm", "proj", "final_norm")


def streams_parts(layout: Layout):
    """The module computing a streams layout's layer around its block: DeepSeek-V4's, or gated residuals'."""
    return mtp_gated if layout.gated else mtp_streams


def roles_of(layout: Layout) -> tuple[str, ...]:
    """The wrapper's roles in `Layout.names` order: a streams layout's two projections (DeepSeek-V4's, or gated
    residuals'), else one."""
    return streams_parts(layout).ROLES if layout.streams else WRAPPER


def count(layer_config) -> int:
    """The depths a layer config (the target's text config, where transformers copies the release's `mtp_config`)
    counts: 1 where it names none."""
    return int(getattr(layer_config, "num_mtp_layers", None) or 1)


def shipped(config: dict, layout: Layout) -> int:
    """The depths a target config (dict form) counts where vLLM reads the count: 1 where it names none."""
    text = config.get("text_config") or config
    if layout.count_block:  # transformers' copy in text_config where the block is not kept
        value = (config.get(layout.count_block) or {}).get(layout.count_key, text.get("num_mtp_layers"))
    else:
        value = config.get(layout.count_key, text.get(layout.count_key))
    return int(value or 1)


def requested(depths: Optional[int], config: dict, layout: Layout) -> int:
    """The depths a drafter trains: `drafter.mtp_depths`, else the release's count of a layout counting them in a block
    (Inkling's, all served), else 1 (vLLM's V1 runner and a count of 1 run layer 0 at every step)."""
    return depths or (shipped(config, layout) if layout.count_block else 1)


def check_requested(config: dict, layout: Layout, depths: Optional[int]) -> None:
    """`drafter.mtp_depths` against the target's layout and release (config dict form): one line where vLLM would not
    serve them as trained."""
    if depths is None or depths == 1:
        return
    if not layout.step_depths:
        raise UserError(
            f"drafter.mtp_depths={depths}: vLLM 0.32's {layout.vllm_model} runs its first MTP layer at every "
            "draft step (it reads no step index, or builds one layer), so one depth trains as served: set "
            "drafter.mtp_depths=1"
        )
    kinds = layout.reads_mtp_fields and (config.get("text_config") or config).get("mtp_layer_types") or []
    alike = next((j for j, kind in enumerate(kinds) if kind != kinds[0]), len(kinds))  # depth 0's kind, from the start
    if alike < min(depths, len(kinds)):  # Dots3-Note's: vLLM builds depth j's attention as its entry
        raise UserError(
            f"drafter.mtp_depths={depths}: the target's mtp_layer_types name {kinds[:depths]}, vLLM 0.32 builds depth "
            f"j's attention as entry j, and draftsmith builds every depth as depth 0's ({kinds[0]}): set "
            f"drafter.mtp_depths to at most {alike}"
        )
    if depths > shipped(config, layout):
        raise UserError(
            f"drafter.mtp_depths={depths}: the target ships {shipped(config, layout)} MTP "
            f"depth{'' if shipped(config, layout) == 1 else 's'} ({layout.count_key}), "
            "and each trains from its shipped layer: set drafter.mtp_depths to at most that"
        )
    if layout.kind_of_layer_0:  # Exaone's: depth j attends as mtp_layer_types[j] (where read), else layer j
        check_layer_0_kind(config.get("text_config") or config, layout, depths)


def check_target_depths(name_or_path: str, depths: Optional[int]) -> None:
    """`check_requested` for a local target, at the recipe's check (a Hub id is checked when its layer is read)."""
    path = Path(name_or_path) / "config.json"
    if depths is not None and path.is_file():
        config = json.loads(path.read_text())
        check_requested(config, layout_of(config), depths)


def longest_chain(config) -> Optional[int]:
    """The longest chain a drafter of `config` (MtpConfig) serves as it trained (`Mtp.max_chain`, refused past, not
    capped): its depth count D where D > 1 (a step i >= D: the module docstring), else None (one layer, any length)."""
    return total if (total := depth_count(config) or 1) > 1 else None


def depth_count(config) -> Optional[int]:
    """The depths a drafter of `config` (MtpConfig) holds: drafter.mtp_depths, else the release's count of a layout
    counting them in a block, else 1; None where a null count waits for `decoder` (from_target's, or a checkpoint's)."""
    decoder = config.decoder or {}
    if config.mtp_depths is not None or "config" not in decoder:
        return config.mtp_depths
    return count(SimpleNamespace(**decoder["config"])) if LAYOUTS[decoder["architecture"]].count_block else 1


def prefix(layout: Layout, depth: int, num_hidden_layers: int) -> str:
    """Where depth `depth`'s tensors are named in the release: layer N + j after the decoder's, `{under}{j}.` where
    each depth ships its wrapper beside its block, else its block's `{under}layers.{j}.` (the wrapper shared)."""
    if layout.after_layers:
        return f"{layout.decoder_prefix}layers.{num_hidden_layers + depth}."
    return f"{layout.under}{'' if layout.own_prefix else layout.block().removesuffix('0.')}{depth}."


def own_roles(layout: Layout) -> tuple[str, ...]:
    """The wrapper modules each depth ships for itself: those under its prefix (one stored outside, Inkling's chain
    norm, is every depth's), none where the depths share the wrapper."""
    if not (layout.after_layers or layout.own_prefix):
        return ()
    outside = dict(layout.outside)
    return tuple(role for role, name in zip(roles_of(layout), layout.names) if f"{name}.weight" not in outside)


def block_at(layout: Layout) -> str:
    """Where a later depth's block sits under its prefix."""
    return layout.block() if own_roles(layout) else ""


def own_names(layout: Layout) -> dict[str, str]:
    """A depth's wrapper parameters -> their names under its prefix (a streams layout's collapse, its hc_head, too)."""
    names, roles = dict(zip(roles_of(layout), layout.names)), own_roles(layout)
    collapse = streams_parts(layout).COLLAPSE_NAMES if layout.streams and roles else {}
    return {f"{role}.weight": f"{names[role]}.weight" for role in roles} | collapse


def layout_for(layout: Layout, layer_config) -> Layout:
    """A count-block layout as its config builds it: without a chain norm (`chain_hidden_post_norm` false, vLLM's
    and transformers' default), the block's output is what the lm_head and the next depth read."""
    if not layout.count_block or getattr(layer_config, "chain_hidden_post_norm", False):
        return layout
    chain = f"{layout.names[3]}.weight"
    outside = tuple(pair for pair in layout.outside if pair[0] != chain)
    return replace(layout, names=layout.names[:3], final_norm=False, feeds_back_normed=False, outside=outside)


def depth_config(spec: dict, layout: Layout, depth: int) -> dict:
    """The layer spec of depth `depth`: its attention sliding where the config lists it among `mtp_local_layer_ids`
    (vLLM's `is_local`), else `block_kind`'s; depth 0's where the layout has no local kind (vLLM builds every depth as
    the layer past the decoder's)."""
    if not layout.local_kind:
        return spec
    config = spec["config"]
    local = depth in (config.get("mtp_local_layer_ids") or ())
    kind = layout.local_kind if local else layout.block_kind[0]
    return {**spec, "config": {**config, "layer_types": [kind]}}


class Depth(nn.Module):
    """Depth j >= 1: the wrapper modules it ships for itself (`own_roles`) and its block, named as the drafter names
    depth 0's."""

    def __init__(self, drafter: nn.Module, depth: int, norm, eps: float):
        super().__init__()
        hidden = drafter.target.hidden_size
        wide = {"proj": 2 * hidden, "embed_proj": hidden, "hidden_proj": hidden}  # a projection's input width
        for role in own_roles(drafter.layout):
            setattr(self, role, nn.Linear(wide[role], hidden, bias=False) if role in wide else norm(hidden, eps=eps))
        spec = depth_config(drafter.config.decoder, drafter.layout, depth)
        if drafter.layout.streams:  # its own collapse of its streams (hc_head) before its own final norm
            self.collapse = import_qualified(spec["collapse"])(drafter.layer_config)
        config = import_qualified(spec["config_class"]).from_dict(spec["config"])
        config._attn_implementation = drafter.layer_config._attn_implementation
        config._experts_implementation = "eager"  # as depth 0's (heads/mtp.py)
        self.block = drafter.build_block(import_qualified(spec["layer"]), config)


def build(drafter: nn.Module, norm, eps: float) -> None:
    """Depths 1.. (`drafter.mtp_depths`; null: the release's count of a layout counting them in a block, else 1);
    those no training step reaches (ttt_steps < D) stay as shipped, frozen (a parameter no loss reaches would stall
    DDP's reduction)."""
    total = drafter.config.mtp_depths or (count(drafter.layer_config) if drafter.layout.count_block else 1)
    if total > 1:
        drafter.depths = nn.ModuleList(Depth(drafter, j, norm, eps) for j in range(1, total))
        for j, depth in enumerate(drafter.depths, start=1):
            depth.requires_grad_(j < drafter.config.ttt_steps)


def part(drafter: nn.Module, depth: int):
    """Depth `depth`'s wrapper modules and block, by role: a later depth's own, else the drafter's (shared)."""
    if depth == 0:
        return drafter
    own = drafter.depths[depth - 1]
    every = (*WRAPPER, *mtp_streams.ROLES, *mtp_gated.ROLES, "collapse", "block")
    roles = (role for role in dict.fromkeys(every) if hasattr(own, role) or hasattr(drafter, role))
    return SimpleNamespace(**{role: getattr(own if hasattr(own, role) else drafter, role) for role in roles})


def depths_of(drafter: nn.Module) -> int:
    depths = getattr(drafter, "depths", None)
    return 1 + (len(depths) if depths is not None else 0)


# -- the checkpoint ---------------------------------------------------------------------------------
def read_depths(name_or_path: str, config: dict, layout: Layout, depths: Optional[int]) -> dict[str, torch.Tensor]:
    """Depths 1.. (`requested`) of the target's release, named `depths.{j}.<name under its prefix>` (headers and the
    files holding them); a depth the release lacks is refused when the layer loads."""
    check_requested(config, layout, depths)
    total = requested(depths, config, layout)
    tensors: dict[str, torch.Tensor] = {}
    if total == 1:
        return tensors
    for name, path in tensor_names(checkpoint_folder(name_or_path, READER)).items():
        own = later_depth(layout, name, decoder_layers(config), total)
        if own:
            with safe_open(str(path), "pt") as f:
                tensors[own] = f.get_tensor(name)
    return tensors


def later_depth(layout: Layout, name: str, num_hidden_layers: int, total: int) -> str:
    """A release tensor's name in depths 1..total-1 (`depths.{j}.<name under its prefix>`), else "": another depth's,
    the decoder's, or a depth's copy of the embedding or lm_head, which vLLM does not read (it shares the target's),
    as depth 0's (`Layout.shared`)."""
    own = layer_name(layout, name, num_hidden_layers)
    found = re.match(re.escape(DEPTHS) + r"(\d+)\.", own)
    kept = found and int(found[1]) < total and not own.removeprefix(found[0]).startswith(layout.shared())
    return own if kept else ""


def apart(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A layer's checkpoint tensors: depth 0's, and the later depths' (`depths.{j}.`, `state_of`'s)."""
    later = {name: t for name, t in tensors.items() if name.startswith(DEPTHS)}
    return {name: t for name, t in tensors.items() if name not in later}, later


def state_of(drafter: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Depths 1..'s parameters from their checkpoint tensors (`read_depths`' names); a depth lacking a tensor, or
    holding one of another shape than depth 0's (the target's hidden size, its decoder layer's), is one line naming
    it under its release name, before anything trains (load_state_dict's size mismatch was a traceback, exit 70)."""
    layout, state = drafter.layout, {}
    for j in range(1, depths_of(drafter)):
        at, under = f"{DEPTHS}{j}.", prefix(layout, j, drafter.target.num_hidden_layers)
        wrapper = {own: at + theirs for own, theirs in own_names(layout).items()}
        block = at + block_at(layout)
        apart_from = set(wrapper.values())
        named = {n.removeprefix(block): t for n, t in tensors.items() if n.startswith(block) and n not in apart_from}
        missing = [name for name in wrapper.values() if name not in tensors] or ([] if named else [f"{block}*"])
        if missing:
            released = [under + name.removeprefix(at) for name in missing[:3]]
            raise UserError(f"drafter.type=mtp: the checkpoint's MTP depth {j} lacks {released}")
        depth = drafter.depths[j - 1]
        for own, theirs in wrapper.items():
            shape, expected = list(tensors[theirs].shape), list(depth.get_parameter(own).shape)
            if shape != expected:
                raise UserError(
                    f"drafter.type=mtp: the checkpoint's MTP depth {j} does not match the target "
                    f"({under}{theirs.removeprefix(at)} is {shape}, the target's hidden size makes it {expected})"
                )
        state |= {f"depths.{j - 1}.{own}": tensors[theirs] for own, theirs in wrapper.items()}
        try:
            converted = block_from_checkpoint(named, depth_config(drafter.config.decoder, layout, j), layout)
        except UserError as error:  # its line names the tensor under the block, not which depth's block it is
            raise UserError(
                f"drafter.type=mtp: MTP depth {j} ({under}{block_at(layout)}*): "
                + str(error).removeprefix("drafter.type=mtp: ")
            ) from None
        state |= {f"depths.{j - 1}.block.{name}": t for name, t in converted.items()}
    return state


def checkpoint_tensors(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """Depths 1.. under their checkpoint names (`read_depths`' names)."""
    layout, out = drafter.layout, {}
    for j in range(1, depths_of(drafter)):
        own, at = drafter.depths[j - 1], f"{DEPTHS}{j}."
        out |= {at + theirs: own.get_parameter(ours).detach() for ours, theirs in own_names(layout).items()}
        saved = block_to_checkpoint(own.block, depth_config(drafter.config.decoder, layout, j), layout)
        out |= {at + block_at(layout) + name: t for name, t in saved.items()}
    return out


def release_name(layout: Layout, name: str, num_hidden_layers: int) -> str:
    """`Layout.release_name`, a later depth's tensors under its `prefix`."""
    found = re.match(re.escape(DEPTHS) + r"(\d+)\.", name)
    if found is None:
        return layout.release_name(name, num_hidden_layers)
    return prefix(layout, int(found[1]), num_hidden_layers) + name.removeprefix(found[0])


def layer_name(layout: Layout, name: str, num_hidden_layers: int) -> str:
    """`release_name`'s inverse (a layout with one served depth names its layers otherwise: Nemotron-H's stack)."""
    first = num_hidden_layers if layout.after_layers else 0  # the index of depth 0's prefix
    found = re.match(re.escape(prefix(layout, 0, 0).removesuffix("0.")) + r"(\d+)\.", name)
    if not layout.step_depths or found is None or int(found[1]) <= first:
        return layout.layer_name(name, num_hidden_layers)
    return f"{DEPTHS}{int(found[1]) - first}.{name.removeprefix(found[0])}"


def shipped_depth_shapes(name_or_path: str, config: dict, layout: Layout, total: int) -> dict[str, tuple[int, ...]]:
    """Release name -> shape of depths 1..total-1's tensors in the target's checkpoint (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    if total == 1:
        return shapes
    for name, path in tensor_names(checkpoint_folder(name_or_path, READER)).items():
        if later_depth(layout, name, decoder_layers(config), total):
            with safe_open(str(path), "pt") as f:
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


# -- training -----------------------------------------------------------------------------------------
def loss(drafter: nn.Module, batch: dict, target_out):
    """Step i (0 first) at every position t runs depth i % D on step i-1's output at t (step 0: f_t) and x_{t+i+1},
    causal over its own entries at t's document's positions <= t, and guesses x_{t+i+2} (the module docstring);
    weighed and counted as `Mtp.loss`' steps are."""
    input_ids = batch["input_ids"]
    width, total = input_ids.shape[1] - 1, depths_of(drafter)
    mask = causal_document_mask(documents(batch)[:, :width])
    places = positions(batch)[:, :width]
    window = drafter.attention_window()
    if window is not None:  # a sliding-window block (Dots3-Note's): each depth's entries at the query's positions
        mask = mask & within_window(places[:, None, :, None], places[:, None, None, :], window)
    fed = drafter.target_features(target_out)[:, :width].to(drafter.embed_norm.weight.dtype)
    outputs = []
    for step in range(drafter.config.ttt_steps):
        fed = drafter.draft(shifted(input_ids, step + 1, width), fed, places, mask, None, depth=step % total)
        outputs.append(drafter.head_input(fed, step % total))
    _, lm_head = drafter.target_modules()
    chunk_rows = chunk_rows_for(drafter.loss_chunk_bytes, drafter.target.vocab_size)
    loss_sum, stats = steps_ahead_loss(outputs, batch, target_out, lm_head.weight, drafter.config.ttt_decay, chunk_rows)
    return loss_sum, drafter.loss_tokens(batch), stats


# -- decoding -----------------------------------------------------------------------------------------
class DepthsProposer(Proposer):
    """Greedy chains, step i by depth i % D, each step with its own cache over the committed sequence: entry p of
    step i reads step i-1's output at p and x_{p+i+1}; after a proposal each step keeps the entries whose token was
    committed (p <= n - 2 - i of n committed tokens), the others (read a draft) are computed again next time, as
    vLLM's speculator re-prefills them. Deterministic (probs None)."""

    def __init__(self, drafter: nn.Module):
        self.drafter = drafter
        self.features = drafter.request
        self.caches: list = []
        self.outputs: list[torch.Tensor] = []  # step i's outputs at the positions its cache keeps

    @torch.no_grad()
    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        if tree is not None:
            raise UserError(
                "an MTP drafter with several depths proposes chains only (vLLM verifies chains): set eval.tree=0"
            )
        drafter = self.drafter
        fed = drafter.committed_features(state)
        if fed is None or len(fed) == 0:
            raise ValueError(f"{drafter.type} needs the target's hidden states at the newly committed positions")
        tokens = state.tokens
        committed, device = len(tokens) - 1, tokens.device
        start = committed - len(fed)
        if state.fresh:
            self.caches, self.outputs = [], []
        drafts: list[int] = []
        outputs, window = fed, drafter.attention_window()
        for step in range(num_tokens):
            if step == len(self.caches):
                self.caches.append(drafter.new_cache())
                self.outputs.append(fed.new_zeros(0, *fed.shape[1:]))  # [.., H], a streams layout's [.., S, H]
            held = self.caches[step].get_seq_length()
            if step == 0 and held < start:
                raise RuntimeError(f"{drafter.type} cache holds {held} positions, the committed sequence needs {start}")
            begin = start if step == 0 else min(held, committed - 1)
            self.caches[step] = cache = cut(self.caches[step], begin, drafter)
            if step > 0:  # step i-1's outputs from begin on: those kept and this proposal's
                fed = outputs[begin:]
            ahead = torch.arange(begin, committed, device=device) + step + 1  # the token each entry reads
            known = tokens[ahead.clamp(max=committed)]
            drafted = torch.tensor(drafts + [0], device=device)[(ahead - committed - 1).clamp(min=0)]
            inputs = torch.where(ahead <= committed, known, drafted)
            mask = torch.ones(1, 1, len(inputs), committed, dtype=torch.bool, device=device).tril(begin)
            places = torch.arange(begin, committed, device=device)[None]
            if window is not None:  # the cache keeps every key, the mask hides those out of the window
                mask = mask & within_window(places[..., None], torch.arange(committed, device=device), window)
            out = drafter.draft(inputs[None], fed[None], places, mask, cache, depth=step % depths_of(drafter))[0]
            outputs = torch.cat([self.outputs[step][:begin], out])  # at positions 0..committed-1
            _, best = drafter.top_tokens(out[-1], 1, step % depths_of(drafter))
            drafts.append(int(best[0]))
            kept = max(committed - step, 0)  # entries p <= committed - 1 - step read committed tokens only
            self.caches[step] = cut(cache, kept, drafter)
            self.outputs[step] = outputs[:kept]
        self.draft_forwards += num_tokens
        return DraftTree.chain(torch.tensor(drafts, dtype=torch.long, device=device))


def cut(cache, length: int, drafter: nn.Module):
    """A cache's first `length` entries (the convolutions' inputs beside follow its keys: mtp_convolved)."""
    if cache.get_seq_length() <= length:
        return cache
    if not length:
        return drafter.new_cache()
    cache.crop(length - cache.get_seq_length())  # minus the count to drop
    return cache
