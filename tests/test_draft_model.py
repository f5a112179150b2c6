"""The draft_model drafter: built from the target's first layers, the distillation losses by hand,
LoRA training through the real trainer, lossless decoding (greedy and exact sampling with the
draft's own q), the vocabulary check; and data_prep.regenerate's resumable output."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate
from draftsmith.eval.sampling import Sampling
from draftsmith.heads import drafter_class
from draftsmith.heads.base import TargetShape, load_drafter
from draftsmith.heads.distill import distill_loss, divergences, forward_kl, reverse_kl, total_variation
from draftsmith.recipe import load_recipe
from draftsmith.target import TargetOutput, load_target
from tests.helpers import (
    REFERENCE_TARGET,
    SAMPLES,
    VOCAB,
    assert_one_line_error,
    exact_conditionals,
    exact_joint,
    exactness_pvalues,
    perturbed_draft,
    speculative_samples,
    tiny_llama,
    train_in_process,
)

DraftModel = drafter_class("draft_model")

pytestmark = pytest.mark.usefixtures("one_thread")


# -- building -------------------------------------------------------------------------------------
def test_layers_init_reproduces_the_targets_first_layers(tmp_path):
    target = tiny_llama(layers=3)
    drafter = DraftModel.from_target(DraftModel.Config(num_layers=2), target, "tiny")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = target(ids, output_hidden_states=True).hidden_states
        mine = drafter.model(ids, output_hidden_states=True)
    # Embeddings and layer 0's output are the same tensors; the draft's last state has the final
    # norm applied (transformers' convention), so it is the target's layer-1 output, normed.
    torch.testing.assert_close(mine.hidden_states[0], theirs[0])
    torch.testing.assert_close(mine.hidden_states[1], theirs[1])
    torch.testing.assert_close(mine.hidden_states[2], target.model.norm(theirs[2]))
    torch.testing.assert_close(mine.logits, target.lm_head(target.model.norm(theirs[2])))

    drafter.save_pretrained(tmp_path)  # a plain HF architecture rebuilt from the stored config
    loaded = load_drafter(tmp_path, TargetShape.of(target, "tiny"))
    torch.testing.assert_close(loaded.model(ids).logits, mine.logits)


def test_a_tied_lm_head_saves_and_loads(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    target = LlamaForCausalLM(config).eval()
    drafter = DraftModel.from_target(DraftModel.Config(num_layers=1), target, "tied")
    drafter.save_pretrained(tmp_path)  # safetensors refuses shared memory unless the copy is untied
    loaded = load_drafter(tmp_path, TargetShape.of(target, "tied"))
    ids = torch.arange(2, 12)[None]
    torch.testing.assert_close(loaded.model(ids).logits, drafter.model(ids).logits)


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path):
    target = tiny_llama(vocab=96)
    tiny_llama(vocab=64).save_pretrained(tmp_path / "other")
    with pytest.raises(UserError, match="vocab_size 64 but the target 'tiny' has 96"):
        DraftModel.from_target(DraftModel.Config(name_or_path=str(tmp_path / "other")), target, "tiny")
    tiny_llama(vocab=96, layers=1, seed=3).save_pretrained(tmp_path / "same")
    drafter = DraftModel.from_target(DraftModel.Config(name_or_path=str(tmp_path / "same")), target, "tiny")
    assert drafter.model.config.num_hidden_layers == 1


# -- distillation losses --------------------------------------------------------------------------
def test_distillation_losses_by_hand():
    p = torch.tensor([[0.5, 0.5, 0.0]])  # a zero in p: its log is -inf
    q = torch.tensor([[0.25, 0.75, 0.0]])
    teacher, student = p.log(), q.log()
    fkl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    rkl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    tvd = 0.5 * (0.25 + 0.25)
    assert forward_kl(student, teacher).item() == pytest.approx(fkl, abs=1e-6)
    assert reverse_kl(student, teacher).item() == pytest.approx(rkl, abs=1e-6)
    assert total_variation(student, teacher).item() == pytest.approx(tvd, abs=1e-6)
    terms = divergences(student, teacher)
    mixed = distill_loss(terms, "mix", (0.5, 0.25, 2.0))
    assert mixed.item() == pytest.approx(0.5 * fkl + 0.25 * rkl + 2.0 * tvd, abs=1e-6)
    assert distill_loss(terms, "rkl").item() == pytest.approx(rkl, abs=1e-6)

    # Temperature 2 softens both: p stays uniform on its support, q becomes sqrt(q) renormalised.
    soft_q = torch.tensor([0.25, 0.75]).sqrt() / torch.tensor([0.25, 0.75]).sqrt().sum()
    assert total_variation(student, teacher, 2.0).item() == pytest.approx(
        0.5 * float((soft_q - 0.5).abs().sum()), abs=1e-6
    )

    # Zero probabilities keep values and gradients finite.
    logits = student.clone().requires_grad_(True)
    distill_loss(divergences(logits, teacher), "mix", (1.0, 1.0, 1.0)).sum().backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("chunk_rows", [5, 100_000], ids=["chunked", "one-chunk"])
def test_chunked_distillation_equals_the_loss_on_every_position_at_once(chunk_rows):
    """The draft model's loss runs its rows in chunks (heads/vocab_loss.py rows_loss): loss, statistics and
    gradients equal the divergences computed on the whole [B, T, V] logits as the loss did before."""
    target = tiny_llama(layers=2)
    config = DraftModel.Config(num_layers=1, loss="mix", mix_weights=[1.0, 0.5, 2.0], ce_weight=0.3, temperature=2.0)
    drafter = DraftModel.from_target(config, target, "tiny").train()
    drafter.loss_chunk_bytes = 4 * 96 * chunk_rows
    ids = torch.randint(4, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 4:], loss_mask[1, 7:] = 1, 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    with torch.no_grad():
        teacher = target(input_ids=ids).logits
    loss, _, stats = drafter.loss(batch, TargetOutput(logits=teacher))
    got = torch.autograd.grad(loss, list(drafter.parameters()))

    student = drafter.model(input_ids=ids).logits[:, :-1].float()
    mask = loss_mask[:, 1:].bool()
    terms = divergences(student, teacher[:, :-1], 2.0)
    terms["ce"] = torch.nn.functional.cross_entropy(student.transpose(1, 2), ids[:, 1:], reduction="none")
    per_token = distill_loss(terms, "mix", [1.0, 0.5, 2.0]) + 0.3 * terms["ce"]
    expected = torch.where(mask, per_token, 0.0).sum()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for mine, theirs in zip(got, torch.autograd.grad(expected, list(drafter.parameters()))):
        assert (mine - theirs).norm() <= 1e-5 * theirs.norm()
    for name in ("fkl", "rkl", "tvd", "ce"):  # per document: the sums over its scored positions
        torch.testing.assert_close(stats[f"step1/{name}"][:, 0], (terms[name] * mask).sum(1).detach(), msg=name)


# -- LoRA through the real trainer ----------------------------------------------------------------
@pytest.mark.slow
def test_lora_training_moves_only_adapters_and_the_merged_model_matches(tmp_path, small_data, token_cache):
    from peft import PeftModel

    from draftsmith.heads.draft_model import ADAPTER_DIR, layers_of

    recipe = tmp_path / "lora.yaml"
    recipe.write_text(
        "drafter: {type: draft_model, num_layers: 1, loss: mix, ce_weight: 0.1, lora: {r: 4, alpha: 8}}\n"
        f"target: {{name_or_path: '{REFERENCE_TARGET}'}}\n"
        f"output_dir: '{tmp_path / 'run'}'\n"
    )
    final, _ = train_in_process([
        f"recipe={recipe}", f"data.train=[{small_data['train']}]", f"data.cache_dir={token_cache}",
        "data.max_length=64", "data.max_conversations=8", "train.micro_batch_size=4", "train.max_steps=2",
        "train.lr=1e-2", "eval.enabled=false",
    ])  # fmt: skip

    target = load_target(str(REFERENCE_TARGET))
    original = layers_of(target, DraftModel.Config(num_layers=1)).state_dict()
    trained = load_file(str(next((tmp_path / "run" / "checkpoints").iterdir()) / "model.safetensors"))
    adapters = {name: value for name, value in trained.items() if "lora_" in name}
    assert adapters and any(
        value.abs().sum() > 0 for name, value in adapters.items() if "lora_B" in name
    )  # B starts at 0
    for name, value in trained.items():
        if "lora_" not in name:  # every base weight is still the target's copy
            plain = name.removeprefix("model.base_model.model.").replace(".base_layer", "")
            torch.testing.assert_close(value, original[plain], msg=name)

    merged = load_drafter(final, TargetShape.of(target, str(REFERENCE_TARGET)))
    assert not any("lora" in name for name in merged.state_dict())  # a plain model
    base = layers_of(target, DraftModel.Config(num_layers=1))
    adapted = PeftModel.from_pretrained(base, final / ADAPTER_DIR).eval()
    ids = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged.model(ids).logits, adapted(ids).logits, atol=1e-4, rtol=1e-4)


# -- decoding is lossless -------------------------------------------------------------------------
def test_greedy_speculative_equals_plain():
    target = tiny_llama(layers=2)
    drafter = perturbed_draft(target).proposer()  # one instance across prompts: its cache must reset itself
    generator = torch.Generator().manual_seed(1)
    accepted = drafted = 0
    for length in (5, 11, 17):
        prompt = torch.randint(3, 96, (length,), generator=generator).tolist()
        plain = generate(target, prompt, 40)
        fast = generate(target, prompt, 40, drafter, gamma=4)
        assert fast.tokens == plain.tokens
        accepted, drafted = accepted + fast.counts.accepted, drafted + fast.counts.drafted
    assert 0 < accepted < drafted  # both acceptances and rejections (cache rollback) were exercised


# -- PARD: one draft forward per chain -----------------------------------------------------------
MASK = 3  # a token of the tiny target's vocabulary


def pard_draft(target, depths: int = 4, noise: float = 0.05):
    config = DraftModel.Config(parallel_drafting=True, mask_token_id=MASK, parallel_tokens=depths)
    drafter = DraftModel.from_target(config, target, "tiny")
    generator = torch.Generator().manual_seed(0)
    for parameter in drafter.parameters():
        parameter.data += noise * torch.randn(parameter.shape, generator=generator)
    return drafter.eval()


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_pard_training_gives_every_depth_the_logits_of_the_one_decoding_forward(packed):
    """Anchor t's group-k logits in the training forward equal the decoding forward's after the
    committed tokens x_0..x_t of the same document followed by masks, at mask k: so what training
    teaches at depth k + 1 is what decoding reads there, whatever text follows the anchor."""
    from draftsmith.heads.draft_model import parallel_inputs

    target = tiny_llama(layers=2, attn="eager" if packed else "sdpa")
    drafter, depths = pard_draft(target), 4
    ids = torch.randint(4, 96, (2, 14), generator=torch.Generator().manual_seed(3))
    if packed:  # row 0 holds two documents (0..5, 6..13); row 1 one document and 3 padding positions
        positions = torch.tensor([list(range(6)) + list(range(8)), list(range(11)) + [0, 1, 2]])
        docs = torch.tensor([[0] * 6 + [1] * 8, [2] * 11 + [-1] * 3])
        batch = {"input_ids": ids, "position_ids": positions, "document_ids": docs}
    else:
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        positions, docs = torch.arange(14).expand(2, -1), torch.tensor([[0] * 14, [1] * 14])
    with torch.no_grad():
        trained = drafter.model(**parallel_inputs(drafter.model, batch, depths, MASK), use_cache=False).logits
        for row, anchor in [(0, 0), (0, 4), (0, 7), (0, 12), (1, 9)]:
            start = int((docs[row] == docs[row, anchor]).nonzero()[0])  # the anchor's document starts here
            committed = ids[row, start : anchor + 1].tolist()
            decoded = drafter.model(
                input_ids=torch.tensor([committed + [MASK] * (depths - 1)]), use_cache=False
            ).logits[0]
            for depth in range(depths):
                assert int(positions[row, anchor]) + depth == len(committed) - 1 + depth
                torch.testing.assert_close(
                    trained[row, depth * 14 + anchor], decoded[len(committed) - 1 + depth], atol=1e-4, rtol=1e-4
                )


def test_pard_greedy_is_lossless_with_one_draft_forward_per_cycle():
    target = tiny_llama(layers=2)
    proposer = pard_draft(target, noise=0.02).proposer()
    generator = torch.Generator().manual_seed(1)
    accepted = drafted = 0
    for length in (5, 11, 17):
        prompt = torch.randint(4, 96, (length,), generator=generator).tolist()
        plain = generate(target, prompt, 40)
        before = proposer.draft_forwards
        fast = generate(target, prompt, 40, proposer, gamma=3)
        assert fast.tokens == plain.tokens
        accepted, drafted = accepted + fast.counts.accepted, drafted + fast.counts.drafted
        assert proposer.draft_forwards - before == fast.counts.reached[0]  # one forward per cycle that drafted
    assert 0 < accepted < drafted  # acceptances and rollbacks of the cache (masks included) were exercised


def test_pard_loss_scores_each_depth_against_the_target_ahead():
    """Depth k's loss at anchor t is the divergence from the target's distribution at t + k (the
    token t + k + 1), recomputed here by hand from the decoding forward."""
    from draftsmith.heads.distill import distill_loss, divergences
    from draftsmith.target import TargetOutput

    target = tiny_llama(layers=2)
    drafter = pard_draft(target, depths=3)
    ids = torch.randint(4, 96, (1, 10), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    with torch.no_grad():
        teacher = target(input_ids=ids).logits
        loss, count, stats = drafter.loss(batch, TargetOutput(logits=teacher))
        expected = 0.0
        for depth in range(3):
            per_anchor = []
            for anchor in range(10 - depth - 1):
                decoded = drafter.model(input_ids=torch.tensor([ids[0, : anchor + 1].tolist() + [MASK] * depth])).logits
                terms = divergences(decoded[0, -1:], teacher[0, anchor + depth : anchor + depth + 1], 1.0)
                per_anchor.append(distill_loss(terms, "fkl", [1.0, 0.0, 1.0]))
            expected += torch.cat(per_anchor).sum()  # a sum over tokens (heads/base.py, "The loss contract")
    assert float(loss) == pytest.approx(float(expected), rel=1e-4) and int(count) == 10
    assert {"step1/top1", "step2/top1", "step3/top1"} <= set(stats)


def test_pard_settings_are_checked_before_anything_loads():
    for overrides, fragment in (
        (["drafter.parallel_drafting=true"], "needs drafter.mask_token_id"),
        (["drafter.parallel_drafting=true", "drafter.mask_token_id=5", "drafter.parallel_tokens=1"], "must be >= 2"),
        (["drafter.parallel_drafting=true", "drafter.mask_token_id=5", "eval.num_speculative_tokens=5",
          "drafter.parallel_tokens=4"], "4"),
    ):  # fmt: skip
        with pytest.raises(UserError, match=fragment):
            load_recipe(["recipe=draft", *overrides])


@pytest.mark.slow
def test_train_then_eval_a_draft_recipe_is_lossless(tmp_path, small_data, token_cache):
    train_in_process([
        "recipe=draft", f"target.name_or_path={REFERENCE_TARGET}", f"data.train=[{small_data['train']}]",
        f"data.eval=[{small_data['eval']}]", f"data.cache_dir={token_cache}", "data.max_length=64",
        "data.max_conversations=8", "train.micro_batch_size=4", "train.max_steps=2", "train.save_every=0",
        "eval.max_prompts=1", "eval.max_new_tokens=8", f"output_dir={tmp_path}",
    ])  # fmt: skip
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["drafter"]["type"] == "draft_model"
    assert all(rows["chain"]["lossless"] for rows in report["domains"].values())
    accuracy = json.loads((tmp_path / "eval_accuracy.json").read_text())["trained"]["all"]
    assert accuracy["step1/accept"] == pytest.approx(1 - accuracy["step1/tvd"])


# the rejection rule is proven in the fast tier by tests/test_eval.py; here the draft model's own q (9 s)
@pytest.mark.slow
def test_sampling_with_the_drafts_own_q_matches_the_target_distribution():
    target = tiny_llama(vocab=VOCAB, hidden=16, layers=2, seed=5, logit_scale=8.0)
    drafter = perturbed_draft(target, noise=0.3)
    prompt, sampling = [1, 5, 2, 7], Sampling(1.0)
    # what the eval builds for a sampled run; each row's draws seeded from its seed (`Proposer.start`)
    counts, accepted = speculative_samples(target, prompt, lambda: drafter.proposer(1.0), gamma=2, sampling=sampling)
    assert 0.1 * SAMPLES < accepted < 1.9 * SAMPLES  # both acceptances and rejections were exercised
    pvalues = exactness_pvalues(counts, exact_joint(exact_conditionals(target, prompt, sampling)))
    assert min(pvalues.values()) > 1e-3, pvalues


# -- data_prep.regenerate -------------------------------------------------------------------------
class CountingTarget:
    """The target with `generate` counted, dying at call number `die_at` like a killed job."""

    def __init__(self, model, die_at: int = 0):
        self.model, self.die_at, self.calls, self.prompts = model, die_at, 0, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate(self, **kwargs):
        self.calls += 1
        self.prompts += [row[mask.bool()].tolist() for row, mask in zip(kwargs["input_ids"], kwargs["attention_mask"])]
        if self.calls == self.die_at:
            raise KeyboardInterrupt("killed")
        return self.model.generate(**kwargs)


@pytest.mark.slow
def test_regeneration_resumes_without_redoing_finished_conversations(tmp_path, small_data):
    from draftsmith.data_prep.conversations import load_conversations
    from draftsmith.data_prep.local_files import REGENERATE_SETTINGS
    from draftsmith.data_prep.regenerate import regenerate
    from draftsmith.target import load_tokenizer

    def recipe(output, *extra):
        return load_recipe([
            "recipe=draft", f"target.name_or_path={REFERENCE_TARGET}", f"data.train=[{small_data['train']}]",
            "data.max_conversations=5", f"data.regenerate.output={output}", "data.regenerate.batch_size=2",
            "data.regenerate.max_new_tokens=3", f"output_dir={tmp_path}", *extra,
        ])  # fmt: skip

    model, tokenizer = load_target(str(REFERENCE_TARGET)), load_tokenizer(str(REFERENCE_TARGET))
    original = load_conversations([str(small_data["train"])], 5)
    rounds = [sum(m["role"] == "assistant" for m in row["messages"]) for row in original]
    calls_per_chunk = [max(rounds[i : i + 2]) for i in range(0, 5, 2)]  # one generate call per assistant round

    killed = CountingTarget(model, die_at=calls_per_chunk[0] + 1)  # dies in the second chunk
    with pytest.raises(KeyboardInterrupt):
        regenerate(recipe(tmp_path / "resumed"), killed, tokenizer)
    assert sorted(p.name for p in (tmp_path / "resumed").glob("part-*")) == ["part-00000.jsonl.gz"]
    # the folder is read once all its parts are written (training read the first part alone, saying nothing of the
    # rest); its part files by a glob, as they are
    with pytest.raises(UserError, match=r"is a regeneration that has not finished \(1 of its 3 parts written\)"):
        load_conversations([str(tmp_path / "resumed")])
    assert len(load_conversations([str(tmp_path / "resumed" / "part-*.jsonl.gz")])) == 2

    resumed = CountingTarget(model)
    result = regenerate(recipe(tmp_path / "resumed"), resumed, tokenizer)
    assert (result.conversations, result.generated) == (5, 3)  # the first chunk's 2 were not redone
    assert resumed.calls == sum(calls_per_chunk[1:])

    fresh = regenerate(recipe(tmp_path / "fresh"), CountingTarget(model), tokenizer)  # greedy: the same output
    assert fresh.generated == 5
    out = load_conversations([str(tmp_path / "resumed")])
    assert out.to_list() and [r["messages"] for r in out] == [
        r["messages"] for r in load_conversations([str(tmp_path / "fresh")])
    ]
    assert out["domain"] == original["domain"]
    for new, old in zip(out, original):
        assert [(m["role"], m["content"]) for m in new["messages"] if m["role"] != "assistant"] == [
            (m["role"], m["content"]) for m in old["messages"] if m["role"] != "assistant"
        ]
    raw = [json.loads(line) for line in gzip.open(tmp_path / "resumed" / "part-00001.jsonl.gz", "rt")]
    assert set(raw[0]) == {"messages", "domain", "regenerated_by"} and raw[0]["regenerated_by"] == str(REFERENCE_TARGET)
    assert any(
        m["content"] != o["content"] for r, row in zip(out, original) for m, o in zip(r["messages"], row["messages"])
    )

    assert (tmp_path / "resumed" / REGENERATE_SETTINGS).is_file()
    with pytest.raises(UserError, match="other settings.*max_new_tokens"):
        regenerate(recipe(tmp_path / "resumed", "data.regenerate.max_new_tokens=4"), model, tokenizer)


def test_a_finished_regeneration_is_known_by_its_conversations_not_their_path(tmp_path, small_data):
    """The same conversations read through another file (a moved or re-installed source, another machine,
    edited loading code) resume the finished directory without generating anything; other
    conversations are refused, naming `data` and saying what it is; a folder of other files is not written into."""
    from draftsmith.data_prep.regenerate import regenerate
    from draftsmith.target import load_tokenizer

    def recipe(source, count=3, output=tmp_path / "out"):
        return load_recipe([
            "recipe=draft", f"target.name_or_path={REFERENCE_TARGET}", f"data.train=[{source}]",
            f"data.max_conversations={count}", f"data.regenerate.output={output}",
            "data.regenerate.max_new_tokens=2", "data.regenerate.max_turns=1", f"output_dir={tmp_path}",
        ])  # fmt: skip

    model, tokenizer = load_target(str(REFERENCE_TARGET)), load_tokenizer(str(REFERENCE_TARGET))
    assert regenerate(recipe(small_data["train"]), model, tokenizer).generated == 3
    elsewhere = tmp_path / "elsewhere" / "copy.jsonl"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(small_data["train"].read_bytes())
    assert regenerate(recipe(elsewhere), model, tokenizer).generated == 0
    with pytest.raises(UserError, match=r"other settings \(data: '\w+' -> '\w+'\): data is the digest of the conv"):
        regenerate(recipe(elsewhere, count=4), model, tokenizer)
    # nor into a folder of the user's own files, which a training run on it would read with the parts as one data set
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.jsonl").write_text("{}")
    with pytest.raises(UserError, match=r"mine holds files no regeneration wrote \(notes.jsonl\): data.train="):
        regenerate(recipe(elsewhere, output=tmp_path / "mine"), model, tokenizer)
    assert sorted(path.name for path in (tmp_path / "mine").iterdir()) == ["notes.jsonl"]


def test_max_turns_answers_the_first_turns_and_ends_the_conversation_there():
    from omegaconf import OmegaConf

    from draftsmith.data_prep.answer_engines import Answer
    from draftsmith.data_prep.regenerate import regenerate_batch
    from draftsmith.target import load_tokenizer

    class Answers:  # a stand-in engine: which prompts were asked is what this test is about
        def __init__(self):
            self.asked = []

        def answers(self, prompts, seeds):
            self.asked += prompts
            return [Answer(f"answer {i}", cut=False) for i in range(len(prompts))]

    def turn(role, content):
        return {"role": role, "content": content}

    batch = [
        [turn("user", "a"), turn("assistant", "x"), turn("user", "b"), turn("assistant", "y"), turn("user", "c")],
        [turn("system", "s"), turn("user", "d"), turn("assistant", "z")],
    ]
    tokenizer, engine = load_tokenizer(str(REFERENCE_TARGET)), Answers()
    out, ended, _ = regenerate_batch(engine, tokenizer, batch, OmegaConf.create({"max_turns": 1}), 1024)
    assert out == [
        [turn("user", "a"), turn("assistant", "answer 0")],
        [turn("system", "s"), turn("user", "d"), turn("assistant", "answer 1")],
    ]
    assert len(engine.asked) == 2 and ended == [None, None]
    everything, _, _ = regenerate_batch(Answers(), tokenizer, batch, OmegaConf.create({"max_turns": None}), 1024)
    # max_turns null: every user turn answered, the trailing one too (data_prep/regenerate.py)
    assert [m["role"] for m in everything[0]] == ["user", "assistant"] * 3


def test_an_empty_answer_ends_its_conversation_at_the_turn_before_it():
    """A sampled target may end its turn at once: an empty turn is nothing to train on, and the data loader
    refuses one (a sampled SmolLM2 folder held one in 8,300 first turns): the conversation ends at the
    answer before it, or is left out when fewer than min_turns answers are left."""
    from omegaconf import OmegaConf

    from draftsmith.data_prep.answer_engines import Answer
    from draftsmith.data_prep.records import normalize_record
    from draftsmith.data_prep.regenerate import regenerate_batch
    from draftsmith.target import load_tokenizer

    class Answers:  # the third conversation's first answer and the second's second are empty
        def __init__(self):
            self.calls = 0

        def answers(self, prompts, seeds):
            self.calls += 1
            empty = {1: 2, 2: 0}[self.calls]  # round 1 asks all four conversations, round 2 the second and fourth
            return [Answer("" if i == empty else f"answer {self.calls}.{i}", cut=False) for i in range(len(prompts))]

    batch = [exchange("a", "x"), exchange("b", "y", "c", "z"), exchange("d", "w"), exchange("e", "v", "f", "u")]
    tokenizer = load_tokenizer(str(REFERENCE_TARGET))
    section = OmegaConf.create({"max_turns": None, "min_turns": 1})
    out, ended, _ = regenerate_batch(Answers(), tokenizer, batch, section, 1024)
    assert out == [
        exchange("a", "answer 1.0"),
        exchange("b", "answer 1.1"),  # ends before its empty second answer
        None,  # no answer left
        exchange("e", "answer 1.3", "f", "answer 2.1"),
    ]
    assert ended == [None, "empty answer", "empty answer", None]
    for number, messages in enumerate(m for m in out if m is not None):
        normalize_record({"messages": messages}, source="test", number=number)  # the loader takes every one


def write_conversations(path, conversations) -> str:
    path.write_text("".join(json.dumps({"messages": messages, "domain": "chat"}) + "\n" for messages in conversations))
    return str(path)


def exchange(*texts):
    """A conversation of user/assistant turns, alternating from the user's."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(texts)]


@pytest.mark.slow
def test_later_turns_reuse_the_first_answers_resume_and_keep_held_out_prompts_out(tmp_path):
    """min_turns=2 with reuse: a first-turn regeneration's answers stand for the first turns, so the engine is
    asked only the second ones, each with the target's own first answer before it; the held-out conversation
    and the one-turn one are not regenerated; a killed run resumes; the settings know the data and the reused
    answers by content."""
    from draftsmith.data_prep.conversations import load_conversations
    from draftsmith.data_prep.local_files import REGENERATE_SETTINGS
    from draftsmith.data_prep.regenerate import check_reusable, regenerate
    from draftsmith.data_prep.template import render_prompt
    from draftsmith.target import load_tokenizer

    two_turns = [exchange(f"Name a number above {i}.", "5", "And one below it?", "4") for i in range(5)]
    train = write_conversations(tmp_path / "train.jsonl", [*two_turns, exchange("Say hi.", "hi")])
    held_out = write_conversations(tmp_path / "held_out.jsonl", [exchange("Name a number above 4.", "9")])

    def recipe(output, *extra):
        return load_recipe([
            "recipe=draft", f"target.name_or_path={REFERENCE_TARGET}", f"data.train=[{train}]",
            f"output_dir={tmp_path}", f"data.regenerate.output={tmp_path / output}", "data.regenerate.batch_size=2",
            "data.regenerate.max_new_tokens=3", *extra,
        ])  # fmt: skip

    later = [f"data.regenerate.reuse=[{tmp_path / 'first'}]", f"data.regenerate.exclude=[{held_out}]",
             "data.regenerate.min_turns=2"]  # fmt: skip
    model, tokenizer = load_target(str(REFERENCE_TARGET)), load_tokenizer(str(REFERENCE_TARGET))
    assert regenerate(recipe("first", "data.regenerate.max_turns=1"), model, tokenizer).generated == 6
    with pytest.raises(KeyboardInterrupt):  # one generate call a part (the second turns): dies in the second part
        regenerate(recipe("later", *later), CountingTarget(model, die_at=2), tokenizer)
    resumed = CountingTarget(model)
    result = regenerate(recipe("later", *later), resumed, tokenizer)
    # the resumed part's two conversations: their first answers taken from `first`, their second ones asked
    assert (result.conversations, result.generated, result.reused, result.excluded, result.short) == (4, 2, 2, 1, 1)
    assert resumed.calls == 1

    first = {
        r["messages"][0]["content"]: r["messages"][1]["content"] for r in load_conversations([str(tmp_path / "first")])
    }
    out = load_conversations([str(tmp_path / "later")])
    assert [m["content"] for r in out for m in r["messages"] if m["role"] == "user"] == [
        text for i in range(4) for text in (f"Name a number above {i}.", "And one below it?")
    ]
    assert all(r["messages"][1]["content"] == first[r["messages"][0]["content"]] for r in out)
    assert resumed.prompts == [
        render_prompt(tokenizer, exchange(question, first[question], "And one below it?", "?"))[0]
        for question in ("Name a number above 2.", "Name a number above 3.")
    ]

    settings = json.loads((tmp_path / "later" / REGENERATE_SETTINGS).read_text())
    assert settings["min_turns"] == 2 and settings["reuse"] not in (None, [str(tmp_path / "first")])
    with pytest.raises(UserError, match=r"other settings \(data: '\w+' -> '\w+'\)"):  # the held-out one would mix in
        regenerate(recipe("later", *later[:1], "data.regenerate.min_turns=2"), model, tokenizer)
    with pytest.raises(UserError, match=r"reuse: .*first was answered with other settings \(max_new_tokens: 3 -> 4\)"):
        check_reusable([tmp_path / "first"], {**settings, "max_new_tokens": 4})
    # a regeneration made before answers cut at max_new_tokens were marked: its cut answers would read as finished
    made_before = {key: value for key, value in settings.items() if key != "marks"}
    (tmp_path / "later" / REGENERATE_SETTINGS).write_text(json.dumps(made_before))
    with pytest.raises(UserError, match="later was regenerated before draftsmith marked answers cut at"):
        regenerate(recipe("later", *later), model, tokenizer)
    with pytest.raises(UserError, match="leave it out of data.regenerate.reuse, and regenerate"):
        check_reusable([tmp_path / "later"], settings)


def test_sampled_answers_are_seeded_draws_that_resume_into_the_same_bytes(tmp_path, small_data):
    """samples=2 at temperature 1: each kept prompt written twice with its own draw; a run killed in its
    second part resumes into an uninterrupted run's bytes; the held-out prompt is not answered."""
    from draftsmith.data_prep.conversations import load_conversations
    from draftsmith.data_prep.regenerate import regenerate
    from draftsmith.target import load_tokenizer

    source = load_conversations([str(small_data["train"])], 3)
    held_out = write_conversations(tmp_path / "held_out.jsonl", [source[2]["messages"]])

    def recipe(output, *extra):
        return load_recipe([
            "recipe=draft", f"target.name_or_path={REFERENCE_TARGET}", f"data.train=[{small_data['train']}]",
            "data.max_conversations=3", f"data.regenerate.output={tmp_path / output}", "data.regenerate.batch_size=2",
            "data.regenerate.max_new_tokens=4", "data.regenerate.max_turns=1", "data.regenerate.temperature=1.0",
            "data.regenerate.samples=2", f"data.regenerate.exclude=[{held_out}]", f"output_dir={tmp_path}", *extra,
        ])  # fmt: skip

    model, tokenizer = load_target(str(REFERENCE_TARGET)), load_tokenizer(str(REFERENCE_TARGET))
    whole = regenerate(recipe("whole"), model, tokenizer)
    assert (whole.conversations, whole.excluded) == (4, 1)
    with pytest.raises(KeyboardInterrupt):
        regenerate(recipe("resumed"), CountingTarget(model, die_at=2), tokenizer)
    assert regenerate(recipe("resumed"), model, tokenizer).generated == 2
    parts = sorted((tmp_path / "whole").glob("part-*"))
    assert [p.read_bytes() for p in parts] == [(tmp_path / "resumed" / p.name).read_bytes() for p in parts]
    rows = [r["messages"] for r in load_conversations([str(tmp_path / "whole")])]
    assert [m[0]["content"] for m in rows] == [source[i]["messages"][0]["content"] for i in (0, 0, 1, 1)]
    assert rows[0][1]["content"] != rows[1][1]["content"] or rows[2][1]["content"] != rows[3][1]["content"]
    with pytest.raises(UserError, match="samples=2 needs temperature > 0"):
        recipe("greedy", "data.regenerate.temperature=0")


@pytest.mark.slow
def test_an_answer_cut_at_max_new_tokens_is_marked_and_its_end_of_turn_is_not_trained_on(tmp_path, capsys):
    """The target's answer to one prompt ends within max_new_tokens, to the other it is cut there (given more
    tokens it goes on): the cut one is written marked `"cut": true` and counted, the finished one as before;
    training on the output keeps both answers in the loss mask, and the end-of-turn after the finished one
    only, as the target generated that one and not the other."""
    from draftsmith.data_prep.answer_engines import generate as generate_answers
    from draftsmith.data_prep.conversations import load_conversations
    from draftsmith.data_prep.dataset import tokenize_conversations
    from draftsmith.data_prep.regenerate import regenerate
    from draftsmith.data_prep.template import render_prompt
    from draftsmith.target import load_tokenizer

    questions = ["Say hi.", "Name a number above 3."]
    train = write_conversations(tmp_path / "train.jsonl", [exchange(question, "?") for question in questions])
    cfg = load_recipe([
        "recipe=draft", f"target.name_or_path={REFERENCE_TARGET}", f"data.train=[{train}]", f"output_dir={tmp_path}",
        f"data.regenerate.output={tmp_path / 'out'}", "data.regenerate.max_new_tokens=48",
    ])  # fmt: skip
    model, tokenizer = load_target(str(REFERENCE_TARGET)), load_tokenizer(str(REFERENCE_TARGET))
    assert regenerate(cfg, model, tokenizer).cut_answers == 1
    written = [json.loads(line) for line in gzip.open(tmp_path / "out" / "part-00000.jsonl.gz", "rt")]
    cut, finished = (record["messages"][1] for record in written)
    assert cut["cut"] is True and "cut" not in finished

    prompts = [render_prompt(tokenizer, exchange(question, "?"))[0] for question in questions]
    longer = generate_answers(model, tokenizer, prompts, cfg.data.regenerate, max_new_tokens=96)
    assert longer[0].text.startswith(cut["content"]) and len(longer[0].text) > len(cut["content"])  # it went on
    assert (longer[1].text, longer[1].cut) == (finished["content"], False)  # it had ended on its own

    tokenized = tokenize_conversations(
        load_conversations([str(tmp_path / "out")]), tokenizer, 512, cache_dir=str(tmp_path)
    )
    trained = [
        tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m], skip_special_tokens=False)
        for row in tokenized
    ]
    assert trained == [cut["content"], finished["content"] + tokenizer.eos_token]

    # the same folder as a regeneration made before the marks: benchmarks/mark_cut_answers.py infers them from the
    # answers' lengths (at least max_new_tokens - 2 tokens), and regenerate then resumes it (nothing left to answer)
    from draftsmith.data_prep.local_files import REGENERATE_SETTINGS
    from draftsmith.data_prep.regenerate import write_part
    from tests.helpers import run_entry_in_process

    settings = json.loads((tmp_path / "out" / REGENERATE_SETTINGS).read_text())
    (tmp_path / "out" / REGENERATE_SETTINGS).write_text(json.dumps({k: v for k, v in settings.items() if k != "marks"}))
    unmarked = [{**r, "messages": [{k: v for k, v in m.items() if k != "cut"} for m in r["messages"]]} for r in written]
    write_part(tmp_path / "out" / "part-00000.jsonl.gz", unmarked)
    with pytest.raises(UserError, match="was regenerated before draftsmith marked answers cut"):
        regenerate(cfg, model, tokenizer)
    done = run_entry_in_process(["benchmarks/mark_cut_answers.py", str(tmp_path / "out")], capsys)
    assert done.returncode == 0 and json.loads(done.stdout)["marked"] == 1, done.stderr[-2000:]
    assert [json.loads(line) for line in gzip.open(tmp_path / "out" / "part-00000.jsonl.gz", "rt")] == written
    assert json.loads((tmp_path / "out" / REGENERATE_SETTINGS).read_text()) == settings
    assert regenerate(cfg, model, tokenizer).generated == 0


def test_regenerate_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    from tests.helpers import run_entry_in_process

    done = run_entry_in_process(
        ["-m", "data_prep.regenerate", "recipe=draft", "data.regenerate.batch_size=0", f"output_dir={tmp_path}"], capsys
    )
    line = assert_one_line_error(done, 2, alone=True)
    assert line == "error: data.regenerate.batch_size=0 must be >= 1"  # the bad key alone


def test_a_tree_is_refused_by_the_recipe_check_before_any_model_loads():
    """proposes_trees said yes for a plain draft model, whose proposer drafts chains only: eval.tree was refused
    at the eval after a whole training run."""
    from draftsmith.recipe import load_recipe

    with pytest.raises(UserError, match="eval.tree=4 but this draft_model drafter, as configured, proposes chains"):
        load_recipe(["recipe=draft", "eval.tree=4"])
