"""The causal LM draftsmith runs for a vision-language wrapper that transformers has no causal LM class for: its
language model and lm_head (draftsmith.causal_lm.wraps_a_text_model says which wrappers). A module of its own: it
imports transformers, which the modules a recipe check reads must not."""

from __future__ import annotations

import copy
from typing import Optional

import torch
from transformers import GenerationMixin, PreTrainedModel


class TextOfWrapper(PreTrainedModel, GenerationMixin):
    """The causal LM of a vision-language wrapper that transformers has no causal LM class for (GLM-5-Next): its
    language model (`get_decoder()`) and lm_head, under the names a causal LM gives them (`model.*`, `lm_head`),
    configured by its text config, which names the wrapper's architecture (what an engine serves from its folder).
    Text prompts never reach the vision tower, so it is left out, as vLLM's text-only model class leaves it."""

    base_model_prefix = "model"
    # the attention and experts are the language model's, their implementations checked when transformers built it
    # (it reads the experts' from the class's source, which here holds none)
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = True
    _can_set_experts_implementation_cached_value = True

    def __init__(self, config, decoder: torch.nn.Module, head: torch.nn.Module):
        super().__init__(config)
        self.model, self.lm_head = decoder, head

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
        **kwargs,
    ):
        """The language model's forward, then the lm_head on the last `logits_to_keep` positions (0: every one;
        a tensor: those indices), as a causal LM's."""
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
        return CausalLMOutputWithPast(
            logits=self.lm_head(outputs.last_hidden_state[:, kept, :]),
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
        )


def text_config_of(wrapper_config):
    config = copy.deepcopy(wrapper_config.get_text_config(decoder=True))
    config.architectures = list(wrapper_config.architectures or [])
    return config
