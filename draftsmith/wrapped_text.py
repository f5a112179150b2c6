"""The causal LM draftsmith runs for a vision-language wrapper that transformers has no causal LM class for: its
language model and lm_head (draftsmith.causal_lm.wraps_a_text_model says which wrappers), inside the language
model's own causal LM class where transformers has one, else `TextOfWrapper`; proven at load to compute the
wrapper's own logits. A module of its own: it imports transformers, which the modules a recipe check reads must not."""

from __future__ import annotations

import copy
from typing import Optional

import torch
from transformers import GenerationMixin, PreTrainedModel

from draftsmith.causal_lm import register_misfiled_causal_lms, text_has_causal_lm
from draftsmith.errors import UserError, one_line

# the tokens the load runs through the wrapper and the causal LM made of it, to prove they compute the same logits:
# enough for attention to mix positions, few enough to cost a fraction of a second beside the load
PROOF_TOKENS = 8


def language_causal_lm(wrapper, name_or_path: str):
    """The causal LM of a loaded wrapper (`wraps_a_text_model`): its language model and lm_head inside the language
    model's causal LM class (whose forward computes the logits as the family does, such as scaling the final state
    before the head), or a `TextOfWrapper` where transformers has no such class. Its weights are the wrapper's own
    modules, so it lives on the wrapper's device and dtype. A wrapper whose language model is not the model that
    class holds, or whose class leaves a weight the wrapper has none of, is refused in one line."""
    if not text_has_causal_lm(wrapper.config.to_dict()):
        return TextOfWrapper.of(wrapper)
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # parameters the wrapper's modules replace: none allocated
        model = built_language_causal_lm(wrapper.config, dtype=wrapper.dtype)
    decoder, own = wrapper.get_decoder(), getattr(model, model.base_model_prefix)
    if type(decoder) is not type(own):
        raise UserError(
            f"cannot load target {name_or_path!r}: its {type(wrapper).__name__}'s language model is a "
            f"{type(decoder).__name__}, not the {type(own).__name__} of {type(model).__name__}, the causal LM "
            "transformers has for it: give its language model as a causal LM"
        )
    head = wrapper.get_output_embeddings()
    setattr(model, model.base_model_prefix, decoder)
    model.set_output_embeddings(head)
    held = {id(parameter) for module in (decoder, head) if module is not None for parameter in module.parameters()}
    missing = [name for name, parameter in model.named_parameters() if id(parameter) not in held]
    if missing:
        raise UserError(
            f"cannot load target {name_or_path!r}: {type(model).__name__}, the causal LM transformers has for its "
            f"{type(wrapper).__name__}'s language model, has weights the wrapper holds none of: "
            f"{', '.join(missing[:3])}"
        )
    return model


def built_language_causal_lm(wrapper_config, dtype: Optional[torch.dtype] = None):
    """The causal LM `language_causal_lm` makes of a wrapper of `wrapper_config`, built from the config alone (with
    the weights its family initialises, or none on the meta device): the model a sharded load fills."""
    if not text_has_causal_lm(wrapper_config.to_dict()):
        return TextOfWrapper.built(wrapper_config, dtype=dtype)
    from transformers import AutoModelForCausalLM

    register_misfiled_causal_lms()
    return AutoModelForCausalLM.from_config(text_config_of(wrapper_config), dtype=dtype)


@torch.no_grad()
def check_computes_as_wrapper(model, wrapper, name_or_path: str) -> None:
    """Prove, once at load, that `model` (`language_causal_lm(wrapper)`) gives the wrapper's own logits on a few
    text tokens, or refuse the target in one line: a wrapper whose forward does on text what its language model's
    does not would otherwise train and export drafters of a different model, silently. The tokens leave out the ids
    the wrapper's config names (its image and audio placeholders), which its forward would read as media."""
    fields = wrapper.config.to_dict()
    named = {value for key, value in fields.items() if key.endswith("token_id") and isinstance(value, int)}
    drawn = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[token for token in drawn.tolist() if token not in named][:PROOF_TOKENS]])
    ids = ids.to(model.get_input_embeddings().weight.device)
    try:  # the wrapper's own code, which may need its media inputs: any failure is why the proof cannot be made
        own = wrapper(input_ids=ids).logits
    except Exception as err:
        raise UserError(
            f"cannot load target {name_or_path!r}: its {type(wrapper).__name__} does not run on text alone "
            f"({one_line(err, with_type=True)}), so its language model cannot be proven to compute its logits: "
            "give its language model as a causal LM"
        ) from err
    ours = model(input_ids=ids).logits
    # tolerant of the two paths' kernels summing in another order (bfloat16 on a GPU); a computation of its own (a
    # scale, a norm) moves the logits by far more than 1% of the largest
    try:
        torch.testing.assert_close(ours, own, rtol=0.016, atol=0.01 * own.detach().float().abs().max().item())
    except AssertionError:
        differs = f"{(ours - own).abs().max().item():.3g}" if ours.shape == own.shape else f"shape {tuple(ours.shape)}"
        raise UserError(
            f"cannot load target {name_or_path!r}: its language model as a causal LM ({type(model).__name__}) does "
            f"not compute its {type(wrapper).__name__}'s logits on text (differs by {differs} on {PROOF_TOKENS} "
            "tokens): give its language model as a causal LM"
        ) from None


class TextOfWrapper(PreTrainedModel, GenerationMixin):
    """The causal LM of a vision-language wrapper whose language model transformers has no causal LM class for
    (GLM-5-Next): its language model (`get_decoder()`) and lm_head, under the names a causal LM gives them (`model.*`,
    `lm_head`), configured by its text config, which names the wrapper's architecture (what an engine serves from its
    folder).
    Text prompts never reach the vision tower, so it is left out, as vLLM's text-only model class leaves it."""

    base_model_prefix = "model"
    # the attention and experts are the language model's, their implementations checked when transformers built it
    # (it reads the experts' from the class's source, which here holds none)
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = True
    _can_set_experts_implementation_cached_value = True

    def __init__(self, config, decoder: torch.nn.Module, head: torch.nn.Module):
        super().__init__(config)
        self.model, self.lm_head = decoder, head
        self.loss_type = "ForCausalLM"  # what transformers reads from a class's name, which this one's does not hold

    @classmethod
    def of(cls, wrapper) -> TextOfWrapper:
        return cls(text_config_of(wrapper.config), wrapper.model.get_decoder(), wrapper.get_output_embeddings())

    @classmethod
    def built(cls, wrapper_config, dtype: Optional[torch.dtype] = None, **kwargs) -> TextOfWrapper:
        """Built from the wrapper's config with the weights its family initialises (or none, on the meta device)."""
        from transformers import AutoModel

        config = text_config_of(wrapper_config)
        head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        model = cls(config, AutoModel.from_config(config, dtype=dtype, **kwargs), head)
        model.tie_weights()
        return model

    def tie_weights(self, *args, **kwargs) -> None:
        """The lm_head is the input embedding where the config ties them (as the wrapper's own lm_head is)."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.get_input_embeddings().weight

    def get_decoder(self):
        return self.model

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.lm_head

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=None,
        logits_to_keep=0,
        labels=None,
        **kwargs,
    ):
        """The language model's forward, then the lm_head on the last `logits_to_keep` positions (0: every one;
        a tensor: those indices), and with `labels` the next-token loss on those logits, as a causal LM's."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            **kwargs,
        )
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.capped(self.lm_head(outputs.last_hidden_state[:, kept, :]))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
        )

    def capped(self, logits: torch.Tensor) -> torch.Tensor:
        """The lm_head's logits as the wrapper's forward finishes them, where its text config has the fields (Muse's):
        scaled by `output_multiplier`, then soft-capped, cap × tanh(logits / cap), at `final_logit_softcapping`."""
        logits = logits * (getattr(self.config, "output_multiplier", None) or 1.0)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return cap * torch.tanh(logits / cap) if cap else logits


def text_config_of(wrapper_config):
    config = copy.deepcopy(wrapper_config.get_text_config(decoder=True))
    config.architectures = list(wrapper_config.architectures or [])
    return config
