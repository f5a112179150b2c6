"""Gemma-4's assistant: the small model Google releases beside each Gemma-4 target for multi-token
prediction (transformers' `gemma4_assistant`, vLLM 0.32's `gemma4_mtp`, served as `"method": "mtp"`),
trained or fine-tuned as the drafter. For a Gemma-4 Unified target it is that family's own assistant class
(`gemma4_unified_assistant`: the same module over the unified layers, which compute the same; vLLM maps it alike).

It is not a layer of the target's checkpoint (the `mtp` kind) but a decoder of its own whose attention
layers hold queries only: each reads the keys and values the target cached in its last non-KV-shared
layer of the same kind (sliding-window or full attention; the target config's `kv_sharing_modes` marks
them "store"). A proposal after the committed tokens x_0..x_{p-1} and the target's token x_p reads the
target's final (post-norm) hidden state f_{p-1}, the one that chose x_p:

    h = pre_projection(cat(e(x_p) * sqrt(H_target), f_{p-1}))      e: the target's embedding
    for each layer: queries at position p-1 over the target's keys and values at positions 0..p-1
    d = norm(h); logits = lm_head(d)                               its own vocabulary table
    next step: token = its guess, hidden = post_projection(d), the same position p-1 and keys

as vLLM 0.32 drafts (measured against transformers' own module: benchmarks/vllm_gemma4_assistant.py,
docs/results/vllm_gemma4_assistant.json; transformers' assisted generation puts the query at p instead and
drafts other tokens). A draft step therefore needs no cache of the drafter's own, and training needs
none either: for every position t, draft step k reads the token x_{t+k+1} and f_t (k = 0) or step k-1's
projected output, sits at position t over the target's keys 0..t, and is scored against the target's
distribution at t+k+1 (EAGLE's training-time test, unrolled `ttt_steps` deep).

The target's keys and values are not captured: the drafter asks for the inputs of the two "store"
layers (layer ids store - 1, draftsmith.target) and recomputes them with the target's own modules,
exactly (tests/test_gemma4_assistant.py compares them with transformers' `shared_kv_states`).

The assistant's `model.embed_tokens` is its vocabulary table only: vLLM feeds it the target's embedding
and ties its lm_head to that table, so the drafter holds it as `lm_head` (formats/gemma4_assistant.py
writes it back under the released name). With `drafter.released_assistant` (a released assistant's folder or Hub id,
or this kind's export) it starts from that assistant, its configuration and weights as released; otherwise from
random weights at the target's shape, its vocabulary table the target's embedding where the widths agree. Its
configuration is resolved once, into the checkpoint, so a warm start (`train.init_from`) or a resumed run
continues the same function. A released assistant whose lm_head is restricted by token
centroids (`use_ordered_embeddings`) drafts through them; training scores the full vocabulary and leaves
the centroids as released. A released assistant's generation config goes with it into the checkpoint and the
export: vLLM never drafts its `suppress_tokens` (their logits -inf), nor does the drafter here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn

from draftsmith.errors import UserError
from draftsmith.families import FULL, SLIDING, family_rotation, within_window
from draftsmith.heads import register
from draftsmith.heads.base import Drafter, FlopProfile, filled_from_target
from draftsmith.heads.gemma4_assistant_config import (
    ASSISTANTS,
    AssistantConfig,
    released_refusal,
    released_sizes,
    sizes_refusal,
)
from draftsmith.heads.packing import documents, positions, shifted
from draftsmith.heads.proposer import DraftState, DraftTree, Proposer, Tree
from draftsmith.heads.vocab_loss import chunk_rows_for, steps_ahead_loss
from draftsmith.model_files import TRANSFORMERS_LAYERS, read_pretrained
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape, local_target_config

FRESH_LAYERS = 2  # a fresh assistant's layers (drafter.num_layers null): a sliding-window one, a full-attention one
# The released names of the assistant's vocabulary table and the drafter's (module docstring).
OWN_TABLE, RELEASED_TABLE = "lm_head.weight", "model.embed_tokens.weight"
# The drafter config's (`decoder`) copy of a released assistant's generation config, which its export writes back.
GENERATION = "generation_config"
# Keys of the target's text config an assistant does not take over (the assistant's config class refuses
# per-layer inputs, experts and double-wide MLPs; its layers share every key and value).
NOT_INHERITED = ("architectures", "model_type", "transformers_version", "dtype", "num_kv_shared_layers")
# The per-layer inputs and experts an assistant goes without, set off where the target's family has them (a family
# without them, Gemma-4 Unified, has no such fields at all).
OFF_IN_ASSISTANT = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False}


def store_layers(values: dict) -> dict[str, int]:
    """Attention kind -> the target layer whose keys and values an assistant layer of that kind reads, from the
    target's config (dict form): the last layer of the kind before the KV-shared ones, as transformers marks it
    "store" (`kv_sharing_modes`) and vLLM wires it."""
    values = values.get("text_config") or values
    kinds = list(values.get("layer_types") or [])
    first_shared = len(kinds) - int(values.get("num_kv_shared_layers") or 0)
    stores = {}
    for kind in (SLIDING, FULL):
        found = [index for index, layer in enumerate(kinds[:first_shared]) if layer == kind]
        if not found:
            raise UserError(
                f"drafter.type=gemma4_assistant: the target has no {kind} layer whose cache an assistant could read "
                "(a Gemma-4 target has both kinds)"
            )
        stores[kind] = found[-1]
    return stores


def assistant_config(text_config, config: AssistantConfig) -> dict[str, Any]:
    """A fresh assistant's transformers config (dict form) for a target's text config: its text config at the
    target's shape (or `hidden_width`/`mlp_width`), `num_layers` layers, each with the head shape of
    the target layer it reads; the assistant's model type is the one transformers has for the target's family,
    its text config of the target's own type."""
    from transformers import AutoConfig

    target = text_config.to_dict()
    stores = store_layers(target)
    layers = config.num_layers or FRESH_LAYERS
    kinds = [SLIDING] * (layers - 1) + [FULL]
    per_layer = target.get("per_layer_config") or {}  # a layer's own head shape (Gemma-4's wider full layers)
    read = {str(i): str(stores[kind]) for i, kind in enumerate(kinds)}  # assistant layer -> the target layer it reads
    text = {key: value for key, value in target.items() if key not in NOT_INHERITED}
    text.update({key: value for key, value in OFF_IN_ASSISTANT.items() if key in target})
    text.update(
        num_hidden_layers=layers, layer_types=kinds, num_kv_shared_layers=layers, use_double_wide_mlp=False,
        per_layer_config={mine: per_layer[theirs] for mine, theirs in read.items() if theirs in per_layer},
        hidden_size=config.hidden_width or target["hidden_size"],
        intermediate_size=config.mlp_width or target["intermediate_size"],
    )  # fmt: skip
    family = target["model_type"]
    own = AutoConfig.for_model(family, **text)
    made = AutoConfig.for_model(ASSISTANTS[family], text_config=own, backbone_hidden_size=target["hidden_size"])
    made.architectures = [type(made).__name__.replace("Config", "ForCausalLM")]
    return made.to_dict()


def load_released(name_or_path: str, text_config):
    """A released assistant (a folder, or a Hub id), loaded by transformers; one line where it is not one for a
    target of this family (`text_config`: the target's) and width."""
    from transformers import AutoConfig, AutoModelForCausalLM

    key = f"drafter.released_assistant={name_or_path!r}"
    config = read_pretrained(AutoConfig.from_pretrained, name_or_path, f"cannot load {key}")
    if refusal := released_refusal(key, config.to_dict(), text_config.model_type, text_config.hidden_size):
        raise UserError(refusal)
    model, loading = read_pretrained(
        AutoModelForCausalLM.from_pretrained,
        name_or_path,
        f"cannot load {key}",
        dtype=torch.float32,
        use_safetensors=True,
        output_loading_info=True,
        **TRANSFORMERS_LAYERS,
    )
    if loading["missing_keys"]:  # initialised at random: its config.json asks for modules its weights do not hold
        missing = sorted(loading["missing_keys"])
        raise UserError(
            f"{key}: its weights hold no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}, which its "
            "config.json builds (transformers would start them at random)"
        )
    return model


@register
class Gemma4Assistant(Drafter):
    type = "gemma4_assistant"
    TITLE = "Gemma-4 assistant (MTP)"
    Config = AssistantConfig
    SERVED_BY = {"chain": ("vllm", "sglang")}  # vLLM 0.32's gemma4 proposer, SGLang's FROZEN_KV_MTP at topk 1: chains

    def __init__(self, config: AssistantConfig, target: TargetShape):
        super().__init__(config, target)
        if config.decoder is None:
            raise filled_from_target("decoder")
        from transformers import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING

        values = config.decoder["assistant"]  # its model type: Gemma-4's assistant, or its unified target's
        hf_config = CONFIG_MAPPING[values["model_type"]].from_dict(values)
        if not hf_config.tie_word_embeddings:
            raise UserError(
                "drafter.type=gemma4_assistant: this assistant's lm_head is untied from its embedding table "
                "(tie_word_embeddings false), which draftsmith does not read"
            )
        hf_config._attn_implementation = "sdpa"
        hf_config.text_config._attn_implementation = "sdpa"
        self.assistant = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)](hf_config)
        # Its embedding table is its lm_head (tied); the input embedding is the target's (module docstring).
        self.assistant.model.embed_tokens = None
        if self.assistant.masked_embedding is not None:  # the centroids stay as released (module docstring)
            self.assistant.masked_embedding.requires_grad_(False)
        self.kinds = list(hf_config.text_config.layer_types)
        self.stores = {kind: int(layer) for kind, layer in config.decoder["stores"].items()}
        self.window = hf_config.text_config.sliding_window
        # tokens the engine never drafts: vLLM 0.32's gemma4_mtp sets their logits to -inf, read from the
        # assistant folder's generation config (a released assistant's carries some)
        self.suppressed = list((config.decoder.get(GENERATION) or {}).get("suppress_tokens") or [])
        self.shared: Optional[tuple[nn.Module]] = None  # the target (attach_target)

    @classmethod
    def unshardable(cls, config) -> Optional[str]:
        return (
            "it recomputes the keys and values of two target layers with those layers' own norm and projections, "
            "outside the target's forward, where a sharded target's pieces are not gathered"
        )

    @classmethod
    def features(cls, config: AssistantConfig, target: TargetShape) -> FeatureRequest:
        stores = (config.decoder or {}).get("stores")
        if stores is None:  # before from_target: the target's config says (a Hub id's config: from the Hub)
            values = local_target_config(target.name_or_path)
            if values is None:
                from transformers import AutoConfig

                values = AutoConfig.from_pretrained(target.name_or_path).to_dict()
            stores = store_layers(values)
        return FeatureRequest(final=True, layers=tuple(sorted(int(s) - 1 for s in stores.values())), logits=True)

    @classmethod
    def flop_profile(cls, config: AssistantConfig) -> FlopProfile:
        return FlopProfile(passes=config.ttt_steps)

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, config: AssistantConfig, target_model, name_or_path: str) -> Gemma4Assistant:
        text = getattr(target_model.config, "text_config", None) or target_model.config
        shape = TargetShape.of(target_model, name_or_path)
        config.check(shape)
        start = config.released_assistant
        released = None if start is None else load_released(start, text)
        values = assistant_config(text, config) if released is None else released.config.to_dict()
        sizes = released_sizes(values["text_config"])
        if refusal := sizes_refusal(config, values["text_config"]):
            raise UserError(refusal)
        decoder = {"assistant": values, "stores": store_layers(text.to_dict())}
        if released is not None:  # its generation config, as transformers read it beside the weights
            decoder[GENERATION] = released.generation_config.to_diff_dict()
        drafter = cls(replace(config, **sizes, decoder=decoder), shape)
        drafter.attach_target(target_model)
        with torch.no_grad():
            if released is not None:
                state = {name: t for name, t in released.state_dict().items() if name != RELEASED_TABLE}
                drafter.assistant.load_state_dict(state)
            elif target_model.get_input_embeddings().weight.shape == drafter.assistant.lm_head.weight.shape:
                drafter.assistant.lm_head.weight.copy_(target_model.get_input_embeddings().weight)
        return drafter

    def attach_target(self, target_model) -> None:
        # A plain tuple: the target stays out of state_dict(), parameters() and `.to()`.
        self.shared = (target_model,)

    def target_model(self):
        if self.shared is None:
            raise RuntimeError(
                f"the {self.type} drafter has no target: load it with load_drafter(..., target_model=target)"
            )
        return self.shared[0]

    # -- the draft model ------------------------------------------------------------------------
    def shared_keys_values(self, layers: dict[int, torch.Tensor], places: torch.Tensor) -> dict[str, tuple]:
        """The keys and values [B, KV heads, T, D] the target's store layers cache at `places` [B, T], from
        their inputs (`layers`: layer id -> [B, T, H]), computed as the target's attention computes them."""
        decoder = self.target_model().get_decoder()
        shared = {}
        for kind, store in self.stores.items():
            layer = decoder.layers[store]
            attention = layer.self_attn
            hidden = layer.input_layernorm(layers[store - 1].to(layer.input_layernorm.weight.dtype))
            shape = (*hidden.shape[:-1], -1, attention.head_dim)
            keys = attention.k_proj(hidden).view(shape)
            values = attention.v_proj(hidden).view(shape) if attention.v_proj is not None else keys
            cos, sin = decoder.rotary_emb(hidden, places, kind)
            keys = family_rotation(attention)(attention.k_norm(keys), cos, sin, unsqueeze_dim=2).transpose(1, 2)
            shared[kind] = (keys, attention.v_norm(values).transpose(1, 2))
        return shared

    def step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        places: torch.Tensor,
        shared: dict[str, tuple],
        masks: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for [B, q] tokens and their [B, q, H_target] hidden states at [B, q] positions over
        the target's keys and values (`masks`: kind -> [B, 1, q, keys] bool): (its normed output [B, q, H],
        which the lm_head reads, and its projection back to the target's width, the next step's hidden)."""
        assistant = self.assistant
        weight = assistant.pre_projection.weight
        embedded = self.target_model().get_input_embeddings()(tokens).to(weight.dtype)  # scaled by sqrt(H)
        x = assistant.pre_projection(torch.cat([embedded, hidden.to(weight.dtype)], dim=-1))
        model = assistant.model
        rope = {kind: model.rotary_emb(x, places, kind) for kind in set(self.kinds)}
        kv = {kind: (k.to(x.dtype), v.to(x.dtype)) for kind, (k, v) in shared.items()}
        for kind, layer in zip(self.kinds, model.layers):
            # by keyword: a Gemma-4 layer's second argument is its per-layer input (none here), a unified one's is not
            x = layer(x, shared_kv_states=kv, position_embeddings=rope[kind], attention_mask=masks[kind],
                      position_ids=places)  # fmt: skip
        normed = model.norm(x)
        return normed, assistant.post_projection(normed)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The draft's logits [..., V] as vLLM drafts from them: restricted to its centroids' tokens where it has
        them, the suppressed tokens at -inf."""
        assistant = self.assistant
        if assistant.masked_embedding is not None:
            logits = assistant.masked_embedding(normed, assistant.lm_head.weight).float()
        else:
            logits = assistant.lm_head(normed).float()
        if self.suppressed:
            logits[..., self.suppressed] = -torch.inf
        return logits

    def masks(self, query_places: torch.Tensor, key_places: torch.Tensor, allowed: torch.Tensor) -> dict[str, Any]:
        """kind -> [B, 1, q, keys]: `allowed` [B, q, keys], within the sliding window for the sliding layers."""
        window = within_window(query_places[:, :, None], key_places[:, None, :], self.window)
        return {SLIDING: (allowed & window)[:, None], FULL: allowed[:, None]}

    # -- training -------------------------------------------------------------------------------
    def loss(self, batch: dict, target_out: TargetOutput):
        """The training-time test over `ttt_steps` draft steps, teacher-forced on the data's tokens.

        With x_t = input_ids[:, t] and f_t the target's final hidden state at t, step i (0 first) at
        position t reads x_{t+i+1} and, for i = 0, f_t, else step i-1's projected output at t; its queries
        sit at position t over the target's keys at positions <= t of t's document (and inside the sliding
        window for its sliding layers), and it guesses x_{t+i+2}: its soft label is the target's
        distribution there (its logits at t+i+1). Counted where x_{t+i+2} is supervised and in t's document;
        summed over positions and steps (step i weighs ttt_decay**i).
        """
        input_ids = batch["input_ids"]
        length = input_ids.shape[1]
        width, device, steps = length - 1, input_ids.device, self.config.ttt_steps
        docs, places = documents(batch), positions(batch)
        shared = self.shared_keys_values(target_out.layers, places)
        key_index = torch.arange(length, device=device)
        allowed = (key_index[None, :] <= key_index[:width, None]) & (docs[:, :width, None] == docs[:, None, :])
        masks = self.masks(places[:, :width], places, allowed)
        fed, outputs = target_out.final[:, :width], []
        for step in range(steps):
            normed, fed = self.step(shifted(input_ids, step + 1, width), fed, places[:, :width], shared, masks)
            outputs.append(normed)
        weight = self.assistant.lm_head.weight
        chunk_rows = chunk_rows_for(self.loss_chunk_bytes, self.target.vocab_size)
        loss, stats = steps_ahead_loss(outputs, batch, target_out, weight, self.config.ttt_decay, chunk_rows)
        return loss, self.loss_tokens(batch), stats

    # -- decoding -------------------------------------------------------------------------------
    def proposer(self, temperature: float = 0.0) -> AssistantProposer:
        return AssistantProposer(self)


class AssistantProposer(Proposer):
    """The assistant drafting for one sequence: the target's keys and values over the committed positions,
    recomputed from the store layers' inputs as positions are committed (only committed positions' states
    reach it, so nothing is ever taken back), and a greedy chain from them. Deterministic (probs None), so
    the loop's exact rule treats q as one-hot."""

    def __init__(self, drafter: Gemma4Assistant):
        self.drafter = drafter
        self.features = drafter.request
        self.shared: dict[str, tuple] = {}

    @torch.no_grad()
    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        drafter, tokens = self.drafter, state.tokens
        if state.new_final is None or not state.new_layers:
            raise ValueError(f"{drafter.type} needs the target's states at the newly committed positions")
        committed = len(tokens) - 1  # positions whose target states are known: 0..committed-1
        start = committed - len(state.new_final)
        if state.fresh:
            self.shared = {}
        held = next(iter(self.shared.values()))[0].shape[2] if self.shared else 0
        if held != start:
            raise RuntimeError(f"{drafter.type} holds {held} committed positions, the new states start at {start}")
        new_places = torch.arange(start, committed, device=tokens.device)[None]
        new = drafter.shared_keys_values({layer: h[None] for layer, h in state.new_layers.items()}, new_places)
        self.shared = {
            kind: tuple(torch.cat([old, fresh], dim=2) for old, fresh in zip(self.shared[kind], new[kind]))
            if self.shared
            else new[kind]
            for kind in new
        }
        place = torch.tensor([[committed - 1]], device=tokens.device)
        keys = torch.arange(committed, device=tokens.device)[None]
        masks = drafter.masks(place, keys, torch.ones(1, 1, committed, dtype=torch.bool, device=tokens.device))
        token, hidden, drafted = tokens[-1:][None], state.final[None, None], []
        for _ in range(num_tokens):
            normed, hidden = drafter.step(token, hidden, place, self.shared, masks)
            token = drafter.logits(normed).argmax(-1)
            drafted.append(token[0, 0])
            self.draft_forwards += 1
        return DraftTree.chain(torch.stack(drafted))
