"""run_target: the logits it returns are the model's own, and a caller that does not read them does not
pay for them (the forward skips the lm_head and `TargetOutput.logits` applies it on first access) —
unless the model's logits are more than its lm_head's output (soft-capping), which is found on the
model's first forward and then always run the model's way."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM

from draftsmith.target import FeatureRequest, run_target
from tests.helpers import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

REQUEST = FeatureRequest(final=True, layers=(0,))


def head_rows(model) -> list[int]:
    """Records how many positions each call of the model's lm_head projects."""
    rows: list[int] = []
    model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: rows.append(args[0].shape[:-1].numel())
    )
    return rows


def test_logits_are_the_models_own_and_computed_only_when_read():
    model = tiny_llama(vocab=40, logit_scale=4.0)
    rows = head_rows(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (3, 11), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        rows.clear()
        for _ in range(2):  # the first forward checks the lm_head, the later ones skip it
            out = run_target(model, ids, mask, REQUEST)
        assert rows[-1] == 0  # the forward projected no position
        assert torch.equal(out.logits, expected) and rows[-1] == ids.numel()  # on first access, all of them
        assert out.logits is out.logits  # once
        index = torch.tensor([0, 7, 12, 32])
        rows.clear()
        at = run_target(model, ids, mask, REQUEST).logits_at(index)
        assert rows == [0, len(index)]
        torch.testing.assert_close(at, expected.flatten(0, 1)[index], rtol=1e-6, atol=1e-6)

        # With a KV cache, as the eval loop runs it: the same logits as the model's own forward.
        cache, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
        first = run_target(model, ids[:, :6], mask[:, :6], REQUEST, cache=cache, use_cache=True)
        own_first = model(ids[:, :6], attention_mask=mask[:, :6], cache=theirs, use_cache=True).logits
        second = run_target(model, ids[:, 6:], mask, REQUEST, cache=cache, use_cache=True)
        assert torch.equal(first.logits, own_first)
        # a 6-token forward need not round like the 11-token one: equal to float32 precision
        torch.testing.assert_close(first.logits, expected[:, :6], rtol=1e-5, atol=1e-5)
        assert torch.equal(second.logits, model(ids[:, 6:], attention_mask=mask, cache=theirs, use_cache=True).logits)


def test_soft_capped_logits_stay_the_models_own():
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=0.5,  # small, so capping changes every logit
        attn_implementation="eager",
    )
    model = Gemma2ForCausalLM(config).eval().requires_grad_(False)
    ids = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        assert not torch.allclose(expected, model.lm_head(model(ids, output_hidden_states=True).hidden_states[-1]))
        for _ in range(2):
            out = run_target(model, ids, request=REQUEST)
            assert torch.equal(out.logits, expected)
        assert torch.equal(out.logits_at(torch.tensor([3, 10])), expected.flatten(0, 1)[[3, 10]])
