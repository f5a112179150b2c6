"""An Inkling release shipping several MTP depths (`mtp_config.num_nextn_predict_layers` = 2 here, depth 1 attending in
a sliding window), with its chain norm or without one (`chain_hidden_post_norm` false): draftsmith trains and decodes
step i by depth i % 2, each over the whole sequence as vLLM 0.32's MultiModuleMTPSpeculator runs InklingMTP
(heads/mtp_depths.py), and exports every depth under `model.mtp.layers.{j}.`. vLLM's InklingMTP does not run on its
CPU build (its fused ops are Triton kernels, its sconv cache paged): the formula is written from its source
(models/inkling/nvidia/mtp.py, v1/worker/gpu/spec_decode/multi_module_mtp/speculator.py), as tests/test_mtp.py's
single-depth one is."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.repo import TargetInfo, check_tensors
from draftsmith.heads import drafter_class, mtp_depths
from draftsmith.heads.mtp_random_layer import write_random_layer
from draftsmith.heads.proposer import DraftState, DynamicTree
from draftsmith.random_target import write_random_target
from draftsmith.target import TargetShape, config_json, load_target, run_target
from tests.helpers import assert_one_line_error, run_entry_in_process, trains_one_step
from tests.test_mtp import (
    CONVOLVED,
    SHAPE,
    assert_exported_layer_decodes_losslessly,
    inkling_block,
    mtp_args,
    resumed_and_exported,
    rms,
    written_shapes,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")
# the release's mtp_config: two depths, depth 1 sliding; with its chain norm, or without (transformers' default)
BLOCKS = {
    "chained": {"num_nextn_predict_layers": 2, "local_layer_ids": [1]},
    "unchained": {"num_nextn_predict_layers": 2, "local_layer_ids": [1], "chain_hidden_post_norm": False},
}


def release_with_depths(directory: Path, block: dict) -> Path:
    folder = write_random_target(CONVOLVED, directory, released=True, **SHAPE)
    write_random_layer(folder, block=block)
    return folder


def built_releases(tmp_path_factory, write, config):
    """key -> (folder, model, drafter of `config`) of the release `write(folder, key)` writes, built once a key."""

    @functools.cache
    def build(key: str):
        folder = write(tmp_path_factory.mktemp(key), key)
        model = load_target(str(folder))
        return folder, model, MTP.from_target(config, model, str(folder)).eval()

    return build


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """name -> (folder, model, drafter) of a tiny Inkling release with the BLOCKS entry's depths, built once."""
    write = lambda folder, name: release_with_depths(folder, BLOCKS[name])  # noqa: E731
    return built_releases(tmp_path_factory, write, MTP.Config())


def vllm_step(release: dict, config: dict, depth: int, hidden, tokens, embed_norm, chained: bool):
    """InklingMultiTokenPredictor.forward at spec_step_idx = depth over a whole draft query (the multi-module
    speculator runs every depth over it): hidden [T, H] (the target's or the previous depth's outputs), tokens [T]
    (each position's token `depth + 1` ahead); embed_dual_rmsnorm_cat's [hidden_norm(h) | embed_norm(embed_norm_target(
    e))], input_proj, the depth's transformer_block (sliding where mtp_config.local_layer_ids lists it), chain_norm
    where the release has one. Returns what the next depth reads and what compute_logits scales and projects."""
    at, eps = f"model.mtp.layers.{depth}.", config["rms_norm_eps"]
    embedded = rms(
        rms(release["model.llm.embed.weight"][tokens], embed_norm, eps), release[at + "embed_norm.weight"], eps
    )
    combined = torch.cat([rms(hidden, release[at + "hidden_norm.weight"], eps), embedded], -1)
    block = {name.removeprefix(at + "transformer_block."): t for name, t in release.items() if name.startswith(at)}
    local = depth in config["mtp_local_layer_ids"]
    out = inkling_block(block, config, combined @ release[at + "input_proj.weight"].T, local)
    return rms(out, release["model.mtp.chain_norm.weight"], eps) if chained else out


def vllm_logits(release: dict, config: dict, out: torch.Tensor) -> torch.Tensor:
    """InklingMTP.compute_logits: the lm_head on the state divided by the muP multiplier."""
    return (out / config["logits_mup_width_multiplier"]) @ release["model.llm.unembed.weight"].T


def proposed_past_rejections(proposer, drafter, model, tokens: torch.Tensor, state, expected):
    """Proposals of two tokens after `tokens`, then after the first one's first draft and the next one's second were
    rejected (the target's token committed in its place), each `expected(tokens, fed)` (vLLM's chain), and one from
    scratch at the end alike; `state(tokens, since, fresh)`: (DraftState, what `expected` reads). Returns the
    proposer from scratch, for its caches."""
    with torch.no_grad():
        now, fed = state(tokens, 0, True)
        drafts = proposer.propose(now, 2).tokens.tolist()
        assert drafts == expected(tokens, fed)
        for accepted in (0, 1):
            kept = torch.cat([tokens, torch.tensor(drafts[:accepted], dtype=torch.long)])
            target_token = int(run_target(model, kept[None]).logits[0, -1].argmax())  # the target's in its place
            assert target_token != drafts[accepted]
            since, tokens = len(tokens) - 1, torch.cat([kept, torch.tensor([target_token])])
            now, fed = state(tokens, since, False)
            drafts = proposer.propose(now, 2).tokens.tolist()
            assert drafts == expected(tokens, fed)
        scratch = drafter.proposer()
        assert drafts == scratch.propose(state(tokens, 0, True)[0], 2).tokens.tolist()
    return scratch


def trained_embed_norm(model) -> torch.Tensor:
    """A trained-like target embed_norm put in place (a random target's is ones, and RMS-norming twice by ones is
    norming once, which would hide a missing one)."""
    norm = model.get_input_embeddings().embed_norm.weight
    norm.copy_(1 + torch.rand(norm.shape, generator=torch.Generator().manual_seed(1)))
    return norm


def token_run(model, drafter, length: int):
    """Random tokens (1, length) and the target's run over them, as the drafter's loss reads it."""
    ids = torch.randint(3, 4000, (1, length), generator=torch.Generator().manual_seed(0))
    return ids, run_target(model, ids, request=MTP.features(drafter.config, drafter.target))


def scored_outputs(drafter, ids, target_out, monkeypatch) -> list[torch.Tensor]:
    """What the drafter's loss over `ids` scores at each training step (its logits' input), the loss kept out."""
    scored = {}

    def kept_outputs(outputs, *args):
        scored["outputs"] = outputs
        return torch.zeros(()), {}

    monkeypatch.setattr(mtp_depths, "steps_ahead_loss", kept_outputs)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    with torch.no_grad():
        drafter.loss(batch | drafter.host_fields(batch), target_out)
    return scored["outputs"]


@pytest.mark.parametrize("name", list(BLOCKS))
def test_the_training_steps_run_depth_i_mod_2_over_the_whole_sequence_as_vllms_speculator(name, releases, monkeypatch):
    """The training-time test's three steps (ttt_steps=3) are vLLM's steps 0, 1, 2 at every position t: step i runs
    depth i % 2 on step i-1's outputs (step 0: the target's final hidden states) and x_{t+i+1}, causal over its own
    entries; what the loss scores is their logits' input, read from the release's names, past the sliding window."""
    folder, model, drafter = releases(name)
    release, config = load_file(str(folder / "model.safetensors")), drafter.layer_config.to_dict()
    length = 60
    ids, target_out = token_run(model, drafter, length)
    with torch.no_grad():
        embed_norm, shipped = trained_embed_norm(model), model.get_input_embeddings().embed_norm.weight.clone()
        outputs = scored_outputs(drafter, ids, target_out, monkeypatch)
        width, hidden = length - 3, target_out.final[0, : length - 3]
        for step in range(3):
            hidden = vllm_step(
                release, config, step % 2, hidden, ids[0, step + 1 : step + 1 + width], embed_norm, name == "chained"
            )
            ours = outputs[step][0, :width]
            assert torch.allclose(ours, hidden / config["logits_mup_width_multiplier"], atol=1e-4), step
        embed_norm.copy_(torch.ones_like(shipped))
    assert config["sliding_window_size"] < width and drafter.depths[0].block.self_attn.sliding_window is not None
    assert (name == "chained") == hasattr(drafter, "final_norm") == ("model.mtp.chain_norm.weight" in release)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_a_chain_drafts_vllms_tokens_and_its_caches_drop_what_read_a_rejected_draft(name, releases):
    """Proposals of three tokens: step i's query is the last committed position, its depth's entries over the
    committed sequence, the tokens past it the chain's own drafts (vLLM's speculator shifts them in); proposed again
    after some of them were rejected (another continuation committed), each step's cache computed again where it read
    one, the chain is the one drafted from scratch."""
    folder, model, drafter = releases(name)
    release, config = load_file(str(folder / "model.safetensors")), drafter.layer_config.to_dict()
    ids = torch.randint(3, 4000, (1, 40), generator=torch.Generator().manual_seed(3))
    final = run_target(model, ids).final[0]
    norm = model.get_input_embeddings().embed_norm.weight

    def expected(committed: int) -> list[int]:  # vLLM's chain after `committed` tokens
        tokens, hidden, drafts = ids[0, :committed], final[: committed - 1], []
        for step in range(3):
            ahead = torch.cat([tokens, torch.tensor(drafts, dtype=torch.long)])[step + 1 : step + committed]
            hidden = vllm_step(release, config, step % 2, hidden, ahead, norm, name == "chained")
            drafts.append(int(vllm_logits(release, config, hidden[-1]).argmax()))
        return drafts

    def state(committed: int, since: int, fresh: bool) -> DraftState:
        new = final[since : committed - 1]
        return DraftState(tokens=ids[0, :committed], final=new[-1], layers={}, new_final=new, fresh=fresh)

    proposer = drafter.proposer()
    with torch.no_grad():
        first = proposer.propose(state(30, 0, True), 3).tokens.tolist()
        again = proposer.propose(state(32, 29, False), 3).tokens.tolist()
        assert first == expected(30) and again == expected(32)
        scratch = drafter.proposer()
        assert again == scratch.propose(state(32, 0, True), 3).tokens.tolist()
    for kept, fresh in zip(proposer.caches, scratch.caches):  # the entries kept: 31 - i at step i, as from scratch
        assert torch.allclose(kept.layers[0].keys, fresh.layers[0].keys, atol=1e-5)
    assert [cache.get_seq_length() for cache in proposer.caches] == [31, 30, 29]
    assert first != ids[0, 30:33].tolist()  # the committed continuation rejects the first proposal
    with pytest.raises(UserError, match="chains only"):
        proposer.propose(state(33, 31, False), 3, DynamicTree(nodes=8, depth=3, topk=2))


def test_every_depth_trains_where_a_step_reaches_it(releases):
    """ttt_steps=3 runs depths 0, 1, 0: one training step moves both depths' weights; with ttt_steps=1 no loss
    reaches depth 1, which stays frozen as shipped."""
    folder, model, _ = releases("chained")
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    shipped = drafter.depths[0].proj.weight.detach().clone()
    trains_one_step(drafter, model, torch.randint(3, 4000, (2, 24), generator=torch.Generator().manual_seed(5)))
    assert not torch.equal(drafter.depths[0].proj.weight, shipped)
    alone = MTP.from_target(MTP.Config(ttt_steps=1), model, str(folder))
    assert not any(p.requires_grad for p in alone.depths[0].parameters())


@pytest.mark.parametrize("name", list(BLOCKS))
def test_every_depth_exports_under_the_releases_names_and_reads_back(name, releases, tmp_path):
    """The folder: the release's config.json as shipped, its depths counted in mtp_config and the text_config's copy,
    every depth under exactly its shipped names and shapes (`model.mtp.layers.{j}.*`), the chain norm where the release
    has one (vLLM refuses one where chain_hidden_post_norm is false), the target's `model.llm.embed_norm`; read back
    alike."""
    folder, model, drafter = releases(name)
    source = Source(
        drafter,
        tmp_path,
        model,
        TargetInfo(TargetShape.of(model, str(folder)), model.config.to_dict(), str(folder), config_json(model)),
    )
    exporter = exporter_for("mtp")
    repo = exporter.vllm(source, 3, tmp_path / "export")
    check_tensors(repo, "export")
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    assert all(torch.equal(t, back.state_dict()[n]) for n, t in drafter.state_dict().items())
    shipped = {n for n in load_file(str(folder / "model.safetensors")) if n.startswith("model.mtp.")}
    assert set(repo.tensors) == shipped | {"model.llm.embed_norm.weight"}
    assert any(n.startswith("model.mtp.layers.1.transformer_block.") for n in repo.tensors)
    release = json.loads((folder / "config.json").read_text())
    assert repo.config == release and release["mtp_config"]["num_nextn_predict_layers"] == 2
    assert exporter.recognises(repo.config, repo.tensors)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BLOCKS))
def test_an_inkling_release_with_two_depths_trains_resumes_exports_and_decodes_losslessly(
    name, tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a two-depth Inkling release: it trains (steps 0, 1, 2 by depths 0, 1, 0), stops after step 1,
    resumes, exports both depths under the release's names and shapes with its count, and draftsmith's eval, reading
    the folder back, decodes losslessly (chains)."""
    folder = release_with_depths(tmp_path / "target", BLOCKS[name])
    two = "eval.num_speculative_tokens=2"  # chains of at most the 2 depths (mtp_depths.longest_chain)
    vllm = resumed_and_exported(folder, tmp_path, small_data, token_cache, capsys, two, "eval.tree=0")
    config = json.loads((vllm / "config.json").read_text())
    assert config["mtp_config"]["num_nextn_predict_layers"] == 2 == config["text_config"]["num_mtp_layers"]
    shipped = load_file(str(folder / "model.safetensors"))
    exported = written_shapes(vllm)
    assert exported == {n: tuple(t.shape) for n, t in shipped.items() if n in exported}
    assert {n for n in exported if n.startswith("model.mtp.")} == {n for n in shipped if n.startswith("model.mtp.")}
    assert not torch.equal(
        load_file(str(vllm / "model.safetensors"))["model.mtp.layers.1.input_proj.weight"],
        shipped["model.mtp.layers.1.input_proj.weight"],
    )
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, 0, two)


@pytest.mark.slow  # the release's write and the target's load (about 3 s)
def test_a_train_run_asking_a_longer_chain_than_the_releases_depths_is_refused_before_its_first_step(
    tmp_path, small_data, token_cache, capsys
):
    """An Inkling release's count is read with its weights (the recipe names none): `train.py` with its eval stage at
    the default γ 3 on a two-depth release was refused by that stage, after the training; now once the drafter is
    built, one line, no checkpoint written."""
    folder = release_with_depths(tmp_path / "target", BLOCKS["chained"])
    run = tmp_path / "run"
    args = [
        *mtp_args(folder, run, small_data, token_cache),
        "eval.enabled=true",
        f"eval.data=[{small_data['eval']}]",
        "eval.tree=0",
    ]
    done = run_entry_in_process(["train.py", *args], capsys)
    assert_one_line_error(done, 2, "eval.num_speculative_tokens=3 but a mtp drafter with this config proposes at most")
    assert not list(run.glob("checkpoints/*")) and not (run / "final").exists()
