"""The `mtp` kind: a target's own multi-token-prediction layer, read from its checkpoint, fine-tuned and
written back under the checkpoint's names (heads/mtp.py, formats/mtp.py).

On tiny random targets of each family vLLM 0.32 serves an MTP layer for (GLM-4.5's, DeepSeek-V3's and V3.2's
layout, `model.layers.{N}.*`; Qwen3-Next's, Qwen3.5's and Qwen3.5-MoE's, `mtp.*`), each given a random first
MTP layer in its family's layout (`heads.mtp.write_random_layer`, as a released checkpoint ships one): the layer
reads back exactly, is the block vLLM builds (the family's attention and experts), computes vLLM's
formula, trains and decodes losslessly (V3.2's sparse-attention block with its indexer keys in the drafter's
cache; V4's layer on hyper-connection streams, `mtp.0.*`, its sliding window kept alike in training and decoding;
HY-V4's, `model.mtp_layers.0.*`, and GLM-5-Next's, under its wrapper's language model, each a decoder layer without
its hyper-connections, GLM-5-Next's pooled sparse attention on the drafter's masks; Qwen4-Exp's, `mtp.*`, on the
target's streams laid side by side, its QSA indexer's pools on the drafter's masks; Dots3-Note's, a sliding-window
dense block with an embedding of its own; MiniMax-M3's, `language_model.model.mtp.layers.0.*` in its release written
whole, its block-sparse attention on the drafter's masks; Inkling's, `model.mtp.layers.0.*` and `model.mtp.chain_norm`
in its release written whole, its block's short convolutions, relative bias and a local depth's window on the
drafter's masks and cache);
Qwen3.5's vision-language wrappers, as released, train and export as
their language models; targets without one are refused in one line before anything loads. The real engine
serving the export: tests/test_mtp_vllm.py.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import stat
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate
from draftsmith.export.run import served_config
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.repo import TargetInfo, check_tensors
from draftsmith.heads import drafter_class
from draftsmith.heads.mtp_layer import read_layer, shipped_shapes
from draftsmith.heads.mtp_layouts import LAYOUTS
from draftsmith.heads.mtp_random_layer import write_random_layer
from draftsmith.model_files import names_in, tensor_names
from draftsmith.random_target import write_random_target
from draftsmith.recipe import load_recipe
from draftsmith.target import FeatureRequest, TargetShape, config_json, load_target, local_target_shape, run_target
from tests.helpers import (
    REFERENCE_TARGET,
    assert_one_line_error,
    benchmark_module,
    drafts_along_plain_decoding,
    fast_tier,
    first_records,
    run_entry_in_process,
    save_drafter,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = (
    "glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "hy_v4",
    "glm5_next",
)  # fmt: skip
WRAPPED = ("glm5_next",)  # a wrapper transformers has no causal LM class for: draftsmith loads its language model
# a wrapper whose language model transformers has a causal LM class for, written whole as its releases ship it (its
# MTP layer is under the wrapper's names, and vLLM maps only the wrapper's model type to its MTP model)
RELEASED = ("minimax_m3_vl",)
# a release written whole whose layer convolves over the last tokens beside its attention (Inkling's); not in RELEASED:
# its block is dense whatever the target's layers (the shared read-back test compares it with the last layer)
CONVOLVED = "inkling_mm_model"
LOCAL = "+local"  # a family's target (`targets`) whose MTP depth 0 attends in a sliding window
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}  # 4 layers: Qwen's 4th is full attention
MTP = drafter_class("mtp")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """family -> (folder, model) of a tiny target with a random MTP layer, built once."""

    @functools.cache
    def build(family: str):
        model_type, local = family.removesuffix(LOCAL), family.endswith(LOCAL)
        released = model_type in (*RELEASED, CONVOLVED)
        folder = write_random_target(model_type, tmp_path_factory.mktemp(family), released=released, **SHAPE)
        if local:  # the release's depth 0 attends in a sliding window (its mtp_config's local_layer_ids)
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, "mtp_config": {"local_layer_ids": [0]}}))
        write_random_layer(folder)
        if model_type in (*WRAPPED, *RELEASED, CONVOLVED):
            model = load_target(str(folder))
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
        return folder, model

    return build


def layout(folder):
    """The target's config.json (a wrapper's text_config, naming the wrapper's architecture) and its MTP layout."""
    config = json.loads((folder / "config.json").read_text())
    architecture = config["architectures"][0]
    return {**config.get("text_config", config), "architectures": [architecture]}, LAYOUTS[architecture]


STREAMS_FAMILIES = ("qwen4_exp",)  # a layer on the target's streams whose block is its decoder layer (not V4's)
# the per-family tests' fast tier: latent attention, linear attention, a release written whole; the rest slow
FAST_FAMILIES = ("deepseek_v3", "qwen3_next", "minimax_m3_vl")


@pytest.mark.parametrize("family", fast_tier([*FAMILIES, *STREAMS_FAMILIES, *RELEASED], FAST_FAMILIES.__contains__))
def test_the_layer_reads_back_under_the_checkpoints_names_as_the_block_vllm_builds(family, targets):
    folder, model = targets(family)
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    config, chosen = layout(folder)
    shipped = read_layer(str(folder), config, chosen)
    written = drafter.checkpoint_tensors()
    assert written.keys() == shipped.keys() and all(torch.equal(written[n], shipped[n]) for n in shipped)
    # the block is the family's layer past the dense ones, with full attention: its experts and attention kind
    block = {name for name, _ in drafter.block.named_parameters()}
    last = {name for name, _ in model.model.layers[-1].named_parameters()}
    assert any("experts" in name for name in block) == any("experts" in name for name in last)
    attention = {n for n in block if n.startswith("self_attn.") and ".indexer." not in n}
    assert attention == {n for n in last if n.startswith("self_attn.") and ".indexer." not in n}
    # its own indexer where the target's layers have one: vLLM builds it so where the last layer shares an earlier
    # layer's selection (HY-V4's `indexer_types`)
    indexed = any(".indexer." in name for name, _ in model.model.named_parameters())
    assert any(".indexer." in n for n in block) == indexed


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool = False) -> torch.Tensor:
    x = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return x * ((1 + weight.float()) if one_plus else weight.float())


@pytest.mark.parametrize("family", FAMILIES)
def test_one_draft_step_computes_vllms_formula_from_the_checkpoint(family, targets):
    """Written from vLLM 0.32's `*_mtp.py` (docs/results/vllm-0.32-source-2026-families.md), reading the
    checkpoint's wrapper tensors by name: DeepSeek's and GLM's plain RMSNorms and masked first embedding,
    Qwen's (1 + w) norms; the block is the drafter's own (its equality with the shipped layer is above)."""
    folder, model = targets(family)
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    config, chosen = layout(folder)
    shipped = read_layer(str(folder), config, chosen)
    embed_norm, hidden_norm, proj, final_norm = (shipped[f"{name}.weight"] for name in chosen.names)
    qwen, eps = chosen.names[0] == "pre_fc_norm_embedding", config["rms_norm_eps"]
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    features = run_target(model, ids).final
    positions = torch.arange(6)[None]
    embedded = model.get_input_embeddings().weight[ids]
    if chosen.masks_first_position:
        embedded[:, 0] = 0
    hidden = torch.cat([rms(embedded, embed_norm, eps, qwen), rms(features, hidden_norm, eps, qwen)], -1) @ proj.T
    rope = drafter.rotary_emb(hidden, positions)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]  # V3.2's sparse attention takes it explicit
    with torch.no_grad():
        pre = drafter.block(hidden, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        pre = pre[0] if isinstance(pre, tuple) else pre  # GLM-5's layer returns its top-k selection beside
        expected = model.lm_head(rms(pre, final_norm, eps, qwen))[0, -1].argmax()
        fed = drafter.draft(ids, features, positions, causal)
    assert drafter.top_tokens(fed[0, -1], 1)[1].item() == expected.item()
    # what a later step reads: the normed output (DeepSeek, Qwen) or the block's output itself (GLM)
    assert torch.allclose(fed, rms(pre, final_norm, eps, qwen) if chosen.feeds_back_normed else pre, atol=1e-5)


@pytest.mark.parametrize(
    "family",
    fast_tier(
        [*FAMILIES, "deepseek_v4", *STREAMS_FAMILIES, "dots3_note_text", *RELEASED, CONVOLVED],
        FAST_FAMILIES.__contains__,
    ),
)
def test_it_trains_several_steps_ahead_and_decodes_losslessly(family, targets):
    trains_ahead_and_decodes_losslessly(*targets(family), rounds=8, prompt_length=20)


def trains_ahead_and_decodes_losslessly(folder, model, rounds: int, prompt_length: int) -> None:
    """Three training-time-test steps on random tokens lower the loss, every trained tensor of the layer in it, report
    each step's accuracy, and the drafter then decodes a random prompt losslessly in chains of 3."""
    drafter = MTP.from_target(MTP.Config(ttt_steps=3), model, str(folder))
    ids = torch.randint(3, 4000, (2, 40), generator=torch.Generator().manual_seed(6))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    target_out = run_target(model, ids, request=MTP.features(drafter.config, drafter.target))
    optimizer = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(rounds):
        loss_sum, count, stats = drafter.loss(batch, target_out)
        (loss_sum / count).backward()
        # every trained tensor is in the loss (DDP refuses one that is not): DeepSeek-V4's attention sinks were not,
        # its block run on transformers' SDPA, which drops them
        assert not [name for name, p in drafter.named_parameters() if p.requires_grad and p.grad is None]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss_sum.detach() / count))
    assert losses[-1] < losses[0]
    assert {f"step{i}/top1" for i in (1, 2, 3)} <= stats.keys()
    prompt = torch.randint(3, 4000, (prompt_length,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = generate(model, prompt, 24).tokens
    assert generate(model, prompt, 24, drafter=drafter.eval().proposer(), gamma=3).tokens == plain


def test_targets_without_a_served_mtp_layer_are_refused_in_one_line(tmp_path):
    """Before any model or data loads (the target's config.json and safetensors headers only)."""
    shape = local_target_shape(str(REFERENCE_TARGET))
    # what draftsmith reads, not a claim about what vLLM serves (vLLM 0.32 serves more MTP families)
    known = r"draftsmith reads the MTP layers of .*Qwen4ExpForConditionalGeneration targets only, each checked"
    with pytest.raises(UserError, match=f"no MTP layer layout is known for a LlamaForCausalLM target: {known}"):
        MTP.Config().check(shape)
    gemma = write_random_target("gemma4_text", tmp_path / "gemma")  # its MTP is a model of its own
    with pytest.raises(UserError, match=r"Gemma4ForCausalLM target ships no MTP layer: .* \(an assistant model: "):
        MTP.Config().check(local_target_shape(str(gemma)))
    bare = write_random_target("qwen3_next", tmp_path / "bare", **SHAPE)  # no MTP layer count, no MTP tensor
    said = (
        r"ships no MTP layer \(its config.json has no num_nextn_predict_layers and its weights no tensor named "
        r"mtp.layers.{j}.\*\): point target.name_or_path at the released checkpoint \(transformers drops the layer "
        r"when it saves a model; .* draftsmith.heads.mtp_random_layer DIRECTORY\), or train another kind$"
    )
    with pytest.raises(UserError, match=said):
        MTP.Config().check(local_target_shape(str(bare)))
    saved = write_random_target("glm4_moe", tmp_path / "saved", **SHAPE)  # a count, but saved by transformers
    with pytest.raises(UserError, match=r"weights hold no MTP layer \(no tensor named model.layers.4.\*"):
        MTP.Config().check(local_target_shape(str(saved)))
    config = json.loads((saved / "config.json").read_text())  # an FP8 release: weights beside block scales
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"checkpoint is quantized \(fp8 .* at the model's BF16 release"):
        MTP.Config().check(local_target_shape(str(saved)))


def mtp_args(folder: Path, run: Path, small_data, token_cache, save_every: int = 0) -> list[str]:
    """`recipe=mtp` on the target at `folder`, 2 quick steps into `run`, no eval stage."""
    return [
        "recipe=mtp", f"target.name_or_path={folder}", f"data.train=[{small_data['train']}]", "data.eval=[]",
        f"data.cache_dir={token_cache}", "data.max_length=64", "train.max_steps=2", "train.micro_batch_size=2",
        "train.warmup_steps=0", f"train.save_every={save_every}", "eval.enabled=false", f"output_dir={run}",
    ]  # fmt: skip


def train_and_export(folder: Path, tmp_path: Path, small_data, token_cache, capsys) -> None:
    """`recipe=mtp` on the target at `folder` trained 2 steps into tmp_path/run and exported to tmp_path/export
    through the real entry points."""
    run = tmp_path / "run"
    args = mtp_args(folder, run, small_data, token_cache)
    assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
    export = ["-m", "export", *args, f"checkpoint={run / 'final'}", f"export.output={tmp_path / 'export'}"]
    assert run_entry_in_process(export, capsys).returncode == 0


@pytest.mark.slow
def test_a_runs_own_export_warm_starts_it_and_a_null_depth_count_is_the_count_it_stands_for(
    tmp_path, small_data, token_cache, capsys
):
    """`drafter.mtp_depths` null (the recipe's) is the release's count, else 1: a warm start from the run's own export
    (which reads its count from the folder: 1) was refused as `another architecture ... drafter.mtp_depths=null (the
    folder has 1)`, and so was a resume saying 1 of a run begun with null; the monitor's retraining warm-starts from
    the served export the same way. Both run now; another count is still refused (by the release's count). The layer's
    writer keeps the weights' file mode (it left 0600, unreadable to a serving process of another user)."""
    folder = write_random_target("glm4_moe", tmp_path / "target", **SHAPE)
    (folder / "model.safetensors").chmod(0o644)  # as a release's download is (save_pretrained's file is 0600)
    write_random_layer(folder)
    assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == 0o644
    run = tmp_path / "run"
    args = mtp_args(folder, run, small_data, token_cache, save_every=1)
    assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
    export = ["-m", "export", *args, f"checkpoint={run / 'final'}", f"export.output={tmp_path / 'export'}"]
    assert run_entry_in_process(export, capsys).returncode == 0
    warm = mtp_args(folder, tmp_path / "warm", small_data, token_cache)
    started = run_entry_in_process(["train.py", *warm, f"train.init_from={tmp_path / 'export' / 'vllm'}"], capsys)
    assert started.returncode == 0 and "warm start from" in started.stderr, started.stderr
    shutil.rmtree(run / "checkpoints" / "step_0000002")
    shutil.rmtree(run / "final")
    resumed = run_entry_in_process(["train.py", *args, "train.resume=true", "drafter.mtp_depths=1"], capsys)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr
    shutil.rmtree(tmp_path / "warm")
    other = run_entry_in_process(
        ["train.py", *warm, f"train.init_from={tmp_path / 'export' / 'vllm'}", "drafter.mtp_depths=2"], capsys
    )
    assert "drafter.mtp_depths=2" in assert_one_line_error(other, 2)  # the release ships one: refused at its check
    # another family's target: refused before any data or model loads, naming its family (it was said after the
    # target had loaded and the data been tokenized, in nine keys: a newcomer's journey, 2026-12-07)
    deepseek = write_random_target("deepseek_v3", tmp_path / "deepseek", **SHAPE)
    write_random_layer(deepseek)
    unreadable = tmp_path / "unreadable.jsonl"
    unreadable.write_text("not json\n")
    other = mtp_args(deepseek, tmp_path / "other", {**small_data, "train": unreadable}, token_cache)
    line = assert_one_line_error(
        run_entry_in_process(["train.py", *other, f"train.init_from={tmp_path / 'export' / 'vllm'}"], capsys), 2
    )
    assert line.endswith(
        "its config.json is another family's target than this one's, from which draftsmith builds the MTP layer (vLLM "
        'builds it from the folder\'s): model_type="glm4_moe" (the target\'s: "deepseek_v3"); architectures='
        '["Glm4MoeForCausalLM"] (the target\'s: ["DeepseekV3ForCausalLM"])'
    ), line


@pytest.mark.slow
def test_a_qwen3_next_release_without_a_count_in_its_config_trains_its_shipped_layer_and_exports_its_config(
    tmp_path, small_data, token_cache, capsys
):
    """Qwen3-Next-80B-A3B's config.json holds no num_nextn_predict_layers, its checkpoint `mtp.*` all the same, and
    vLLM 0.32 defaults the count to 1 (qwen3_next_mtp.py): `recipe=mtp` trains that layer and exports it, the
    folder's config.json the target's as shipped (no `_name_or_path`, none of transformers' to_dict() keys) with
    the count vLLM reads. A count of 0 is the config's word, whatever the tensors."""
    folder = write_random_target("qwen3_next", tmp_path / "target", **SHAPE)
    write_random_layer(folder)
    shipped = json.loads((folder / "config.json").read_text())
    del shipped["num_nextn_predict_layers"]
    (folder / "config.json").write_text(json.dumps(shipped))
    train_and_export(folder, tmp_path, small_data, token_cache, capsys)
    written = json.loads((tmp_path / "export" / "vllm" / "config.json").read_text())
    assert written == {**shipped, "num_nextn_predict_layers": 1}
    (folder / "config.json").write_text(json.dumps({**shipped, "num_nextn_predict_layers": 0}))
    with pytest.raises(UserError, match=r"ships no MTP layer \(num_nextn_predict_layers is 0 in its config.json\)"):
        MTP.Config().check(local_target_shape(str(folder)))


# Qwen3.5's releases: vision-language wrapper -> its language model's family (random_target builds that alone)
MATRIX = benchmark_module("target_matrix")  # its wrappers, as the benchmark's rows serve them
WRAPPERS = MATRIX.WRAPPERS


@pytest.mark.parametrize("model_type", WRAPPERS)
def test_a_released_vision_language_wrappers_layer_trains_and_exports_as_its_language_models(model_type, tmp_path):
    """transformers' AutoModelForCausalLM loads the wrapper's language model alone (its ForCausalLM class, the
    wrapper's text_config, which names no architecture); the layer is read from the top of the checkpoint
    (`mtp.*`), trains, decodes losslessly, and exports as for a text-only target: the language model's config
    with one MTP layer, which vLLM 0.32 serves as Qwen3_5MTP / Qwen3_5MoeMTP, and the layer under the shipped
    names and shapes (the experts fused as the MoE releases ship them)."""
    folder = MATRIX.write_random_wrapper(model_type, tmp_path, **SHAPE)
    write_random_layer(folder)  # the MTP layer at the top of the checkpoint, as the releases ship it
    MTP.Config().check(local_target_shape(str(folder)))  # the wrapper's config.json and safetensors headers
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    architecture = type(model).__name__
    assert model.config.architectures is None and architecture.endswith("ForCausalLM")
    drafter = MTP.from_target(MTP.Config(ttt_steps=2), model, str(folder))
    shipped = read_layer(str(folder), model.config.to_dict(), LAYOUTS[architecture])
    written = drafter.checkpoint_tensors()
    assert written.keys() == shipped.keys() and all(torch.equal(written[n], shipped[n]) for n in shipped)
    ids = torch.randint(3, 4000, (2, 24), generator=torch.Generator().manual_seed(6))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    loss_sum, count, _ = drafter.loss(
        batch, run_target(model, ids, request=MTP.features(drafter.config, drafter.target))
    )
    (loss_sum / count).backward()
    prompt = torch.randint(3, 4000, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = generate(model, prompt, 12).tokens
    assert generate(model, prompt, 12, drafter=drafter.eval().proposer(), gamma=3).tokens == plain
    shape = TargetShape.of(model, str(folder))
    source = Source(
        drafter, tmp_path, model, TargetInfo(shape, model.config.to_dict(), str(folder), config_json(model))
    )
    repo = exporter_for("mtp").vllm(source, 3, tmp_path / "export")
    check_tensors(repo, "export")  # exactly the shipped layer's names and shapes
    assert repo.config["architectures"] == [architecture] and repo.config["mtp_num_hidden_layers"] == 1
    assert repo.config["model_type"] == WRAPPERS[model_type] and "vision_config" not in repo.config


@pytest.mark.parametrize("family", ["glm4_moe"])
def test_a_shipped_layer_of_another_shape_is_one_line(family, targets):
    """A wrapper tensor (eh_proj) or a block tensor of another shape than the target's layer was exit 70 (torch's
    size-mismatch or transformers' ignore_mismatched_sizes error)."""
    folder, model = targets(family)
    config, chosen = layout(folder)
    shipped = read_layer(str(folder), config, chosen)
    for name in ("eh_proj.weight", next(n for n in shipped if n.endswith("self_attn.q_proj.weight"))):
        cut = {**shipped, name: shipped[name][:-1]}
        with pytest.raises(UserError, match=r"MTP layer does not match the target.* is \[\d+, \d+\]") as err:
            MTP.from_layer(MTP.Config(), model, str(folder), cut)
        assert name.rsplit(".", 2)[-2] in str(err.value) and "\n" not in str(err.value)


def test_a_start_reads_the_checkpoints_tensor_names_once_and_again_when_its_weights_change(targets, tmp_path):
    """The recipe's check, the drafter's own when it is built and reading its layer each ask for the target's tensor
    names (a release's index or safetensors headers: megabytes): one read serves a start, until the files change."""
    folder, model = targets("glm4_moe")
    names_in.cache_clear()
    cfg = load_recipe(["recipe=mtp", f"target.name_or_path={folder}", f"output_dir={tmp_path / 'run'}"])
    MTP.from_target(OmegaConf.to_object(cfg.drafter), model, str(folder))
    assert (names_in.cache_info().misses, names_in.cache_info().hits) == (1, 2)
    copy = Path(shutil.copytree(folder, tmp_path / "target"))
    weights = copy / "model.safetensors"
    assert "extra.weight" not in tensor_names(copy)
    save_file({**load_file(weights), "extra.weight": torch.zeros(1)}, weights, metadata={"format": "pt"})
    assert tensor_names(copy)["extra.weight"] == weights


def test_train_refuses_a_target_without_one_before_loading_it(capsys):
    result = run_entry_in_process(["train.py", "recipe=mtp", f"target.name_or_path={REFERENCE_TARGET}"], capsys)
    assert_one_line_error(result, 2, "drafter.type=mtp: no MTP layer layout is known for a LlamaForCausalLM target")


@pytest.mark.slow
def test_the_export_is_the_shipped_layers_form_and_evaluates_like_the_checkpoint(small_data, tmp_path, capsys):
    """On the demo MTP target (recipes/mtp.yaml): the vLLM folder is the target's config with one MTP layer
    and the layer under exactly the shipped names and shapes; read back by draftsmith's eval, it decodes as
    the checkpoint does (chain and tree)."""
    from draftsmith.eval.report import run_eval

    name = load_recipe(["recipe=mtp"]).target.name_or_path
    target = load_target(name)
    checkpoint = save_drafter("mtp", target, tmp_path / "ckpt", seed=3, target_name=name)
    export = ["-m", "export", "recipe=mtp", f"checkpoint={checkpoint}", f"export.output={tmp_path / 'export'}"]
    assert run_entry_in_process([*export, f"output_dir={tmp_path / 'run'}"], capsys).returncode == 0
    folder = tmp_path / "export" / "vllm"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Glm4MoeForCausalLM"] and config["num_nextn_predict_layers"] == 1
    written = {n: tuple(t.shape) for n, t in load_file(str(folder / "model.safetensors")).items()}
    assert written == shipped_shapes(name, config, LAYOUTS["Glm4MoeForCausalLM"])
    info = json.loads((folder / "draftsmith_export.json").read_text())
    assert info["speculative_config"]["method"] == "mtp"
    prompt = first_records(small_data["eval"], tmp_path / "eval.jsonl", 1)
    quick = [f"eval.data=[{prompt}]", "eval.max_new_tokens=16", "eval.tree=6", "eval.ngram_baseline=false"]
    rows = {}
    for label, path in (("checkpoint", checkpoint), ("vllm", folder)):
        report = run_eval(
            load_recipe(["recipe=mtp", f"output_dir={tmp_path / label}", *quick]), str(path), target=target
        )
        rows[label] = {
            (d, m): (row["new_tokens"], row["target_forwards"], row["accepted"], row["lossless"])
            for d in report["domains"]
            for m, row in report["domains"][d].items()
        }
    assert rows["vllm"] == rows["checkpoint"]
    proposed = drafts_along_plain_decoding(checkpoint, target, name)
    assert len({tuple(p) for p in proposed}) > 1 and drafts_along_plain_decoding(folder, target, name) == proposed


def test_loading_a_target_names_its_mtp_layers_in_one_line_and_keeps_transformers_report_for_anything_else(
    targets, tmp_path, caplog
):
    """A checkpoint's MTP layer stored past num_hidden_layers (transformers leaves out only the released sizes'
    indices) is one info line at load, not transformers' table of its tensors; any other tensor the model does not
    read keeps transformers' report."""
    folder, _ = targets("glm4_moe")
    reports = []
    handler = logging.Handler()
    handler.emit = lambda record: reports.append(record.getMessage())
    transformers_logger = logging.getLogger("transformers.modeling_utils")
    transformers_logger.addHandler(handler)
    try:
        with caplog.at_level("INFO", logger="draftsmith.target"):
            load_target(str(folder))
        assert not any("LOAD REPORT" in report for report in reports), reports
        assert any("multi-token-prediction layers, which its forward does not run" in r.message for r in caplog.records)
        stray = tmp_path / "stray"
        stray.mkdir()
        for path in folder.iterdir():
            if path.name != "model.safetensors":
                (stray / path.name).symlink_to(path)
        weights = load_file(str(folder / "model.safetensors"))
        save_file({**weights, "model.stray.weight": torch.zeros(2)}, str(stray / "model.safetensors"))
        load_target(str(stray))
    finally:
        transformers_logger.removeHandler(handler)
    assert any("LOAD REPORT" in report and "model.stray.weight" in report for report in reports), reports


@pytest.mark.parametrize("family", ["deepseek_v32", "hy_v4", "glm5_next"])
def test_the_sparse_attention_blocks_cache_keeps_and_cuts_its_indexer_keys_as_one_forward_reads_them(family, targets):
    """DeepSeek-V3.2's indexer (HY-V4's alike, its block with attention sinks; GLM-5-Next's over pools of keys, on the
    drafter's masks) picks `index_topk` (64 here) of the keys for each query: past that many positions, draft steps on
    the drafter's cache (decoding) compute what one forward over the sequence does (training), after a rejected draft
    was cut away with its indexer keys (as EagleProposer.catch_up crops it)."""
    from transformers import DynamicCache

    folder, model = targets(family)
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    length, cached = 90, 80
    assert drafter.layer_config.index_topk < cached
    ids = torch.randint(3, 4000, (1, length), generator=torch.Generator().manual_seed(2))
    features, positions = run_target(model, ids).final, torch.arange(length)[None]
    cache = DynamicCache(config=drafter.layer_config)

    def causal(new: int, past: int = 0) -> torch.Tensor:  # the mask the sparse block's indexer scores are masked by
        return torch.ones(new, past + new, dtype=torch.bool).tril(past)[None, None]

    with torch.no_grad():
        whole = drafter.draft(ids, features, positions, causal(length))
        drafter.draft(ids[:, :cached], features[:, :cached], positions[:, :cached], causal(cached), cache)
        rejected = slice(cached, cached + 3)
        wrong = ids[:, rejected].flip(-1)
        drafter.draft(wrong, features[:, rejected], positions[:, rejected], causal(3, cached), cache)
        cache.crop(-3)
        steps = [
            drafter.draft(ids[:, p : p + 1], features[:, p : p + 1], positions[:, p : p + 1], causal(1, p), cache)
            for p in range(cached, length)
        ]
    assert cache.layers[0].indexer_keys.shape[1] == length
    assert torch.allclose(torch.cat(steps, 1), whole[:, cached:], atol=1e-4)


@pytest.mark.slow
def test_a_deepseek_v32_targets_sparse_attention_layer_trains_decodes_losslessly_and_exports_under_its_names(
    tmp_path, small_data, token_cache, capsys
):
    """DeepSeek-V3.2's MTP block is its sparse-attention decoder layer (was refused: the drafter's cache held no
    indexer keys). `recipe=mtp` trains it, the export writes it under DeepSeek-V3's names and shapes with the target's
    config (vLLM 0.32's GPU builds serve it as DeepseekV32MTP; its CPU build runs no sparse attention, as the folder
    says), and draftsmith's eval, reading the folder back, decodes losslessly with it."""
    from draftsmith.eval.report import run_eval

    folder = write_random_target("deepseek_v32", tmp_path / "target", **SHAPE)
    write_random_layer(folder)
    train_and_export(folder, tmp_path, small_data, token_cache, capsys)
    vllm = tmp_path / "export" / "vllm"
    config = json.loads((vllm / "config.json").read_text())
    architecture = "DeepseekV32ForCausalLM"
    assert config["architectures"] == [architecture] and config["num_nextn_predict_layers"] == 1
    written = load_file(str(vllm / "model.safetensors"))
    assert {n: tuple(t.shape) for n, t in written.items()} == shipped_shapes(str(folder), config, LAYOUTS[architecture])
    # the indexer as shipped (transformers runs it without gradients), the rest of the layer trained
    prefix = LAYOUTS[architecture].prefix(config["num_hidden_layers"])
    shipped = {prefix + name: t for name, t in read_layer(str(folder), config, LAYOUTS[architecture]).items()}
    indexer = [name for name in written if ".self_attn.indexer." in name]
    assert indexer and all(torch.equal(written[n], shipped[n].to(written[n].dtype)) for n in indexer)
    assert not torch.equal(written[prefix + "eh_proj.weight"], shipped[prefix + "eh_proj.weight"])
    assert "not its CPU build" in (vllm / "draftsmith_export.json").read_text()
    prompt = first_records(small_data["eval"], tmp_path / "eval.jsonl", 1)
    quick = [f"eval.data=[{prompt}]", "eval.max_new_tokens=16", "eval.tree=6", "eval.ngram_baseline=false"]
    recipe = ["recipe=mtp", f"target.name_or_path={folder}", f"output_dir={tmp_path / 'eval'}", *quick]
    report = run_eval(load_recipe(recipe), str(vllm))
    rows = [row for domain in report["domains"].values() for row in domain.values() if row.get("lossless") is not None]
    assert rows and all(row["lossless"] for row in rows)


def v4_layer(targets):
    """The tiny DeepSeek-V4 target with a random `mtp.0.*` layer, its drafter and the shipped layer's tensors."""
    folder, model = targets("deepseek_v4")
    config, chosen = layout(folder)
    return (
        folder,
        model,
        MTP.from_target(MTP.Config(), model, str(folder)).eval(),
        read_layer(str(folder), config, chosen),
    )


def test_a_deepseek_v4_layer_reads_back_under_its_release_names_as_the_sliding_window_block_vllm_builds(targets):
    """DeepSeek-V4 releases its MTP layer as `mtp.0.*` in DeepSeek's original names, wrapper and block side by side;
    vLLM builds the block as target layer num_hidden_layers, whose trailing compress ratio 0 is plain sliding-window
    attention (no compressor) and whose experts are routed top-k (not hashed)."""
    folder, model, drafter, shipped = v4_layer(targets)
    written = drafter.checkpoint_tensors()
    assert written.keys() == shipped.keys() and all(torch.equal(written[n], shipped[n]) for n in shipped)
    wrapper = {"enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight", "hc_head_fn"}
    assert wrapper | {"attn.wq_a.weight", "attn.attn_sink", "hc_attn_fn", "ffn.gate.bias"} <= shipped.keys()
    assert drafter.block.self_attn.compressor is None and not drafter.block.mlp.is_hash
    assert drafter.attention_window() == model.config.sliding_window
    assert MTP.features(drafter.config, drafter.target).streams


def test_a_deepseek_v4_layer_is_refused_captured_features_in_one_line(
    targets, tmp_path, small_data, token_cache, capsys
):
    """A capture holds one state a position (data_prep/features.py), never the last layer's streams the V4 layer
    reads: the capture command refuses to capture for it, and training refuses a capture (here one made for Medusa,
    on the same target and data) before the first step, each in one line."""
    folder, _ = targets("deepseek_v4")
    data = [
        f"target.name_or_path={folder}", f"data.train=[{small_data['train']}]", "data.eval=[]",
        f"data.cache_dir={token_cache}", "data.max_length=64", "data.max_conversations=4",
    ]  # fmt: skip
    capture = ["-m", "data_prep.capture", "recipe=mtp", *data, f"data.capture.output={tmp_path / 'mtp'}"]
    assert assert_one_line_error(run_entry_in_process(capture, capsys), 2).startswith(
        "error: draftsmith capture: drafter.type=mtp reads the target's last layer's residual streams"
    )
    assert not any((tmp_path / "mtp").glob("*.json"))
    medusa = ["-m", "data_prep.capture", "recipe=medusa", *data, f"data.capture.output={tmp_path / 'medusa'}"]
    assert run_entry_in_process(medusa, capsys).returncode == 0
    train = [
        "train.py", "recipe=mtp", *data, f"data.features={tmp_path / 'medusa'}", "train.max_steps=2",
        "eval.enabled=false", f"output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    assert assert_one_line_error(run_entry_in_process(train, capsys), 2).startswith(
        "error: data.features: drafter.type=mtp reads the target's last layer's residual streams"
    )
    assert not (tmp_path / "run" / "final").exists()


def test_one_deepseek_v4_draft_step_computes_vllms_formula_from_the_checkpoint(targets):
    """Written from vLLM 0.32's DeepSeekV4MTP (models/deepseek_v4/nvidia/mtp.py, the eager reference of its fused
    input norm): the target's last layer's streams before its hc_head (what vLLM copies into `_mtp_hidden_buffer`),
    hnorm per stream, h_proj(streams) + e_proj(embedding) broadcast over the streams, the block, then the layer's own
    hc_head and shared_head.norm; a later step reads the block's streams themselves."""
    folder, model, drafter, shipped = v4_layer(targets)
    config = json.loads((folder / "config.json").read_text())
    eps, hc_eps = config["rms_norm_eps"], config["hc_eps"]
    ids = torch.randint(3, 4000, (1, 6), generator=torch.Generator().manual_seed(0))
    out = run_target(model, ids, request=FeatureRequest(streams=True))
    streams = out.streams
    assert torch.allclose(model.model.norm(model.model.hc_head(streams)), out.final, atol=1e-6)
    positions = torch.arange(6)[None]
    embedded = model.get_input_embeddings().weight[ids].clone()
    embedded[:, 0] = 0
    hidden = rms(streams, shipped["hnorm.weight"], eps, False) @ shipped["h_proj.weight"].T
    hidden = hidden + (rms(embedded, shipped["enorm.weight"], eps, False) @ shipped["e_proj.weight"].T)[..., None, :]
    causal = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    with torch.no_grad():
        rope = {"main": drafter.rotary_emb(hidden, positions, layer_type="main")}
        pre = drafter.block(hidden, attention_mask=causal[None, None], position_ids=positions, position_embeddings=rope)
        flat = pre.flatten(2)
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
        mixes = torch.sigmoid(flat @ shipped["hc_head_fn"].T * shipped["hc_head_scale"] + shipped["hc_head_base"])
        collapsed = ((mixes + hc_eps)[..., None] * pre).sum(-2)
        normed = rms(collapsed, shipped["norm.weight"], eps, False)
        fed = drafter.draft(ids, streams, positions, torch.ones(6, 6, dtype=torch.bool).tril()[None, None])
    assert fed.shape == streams.shape and torch.allclose(fed, pre, atol=1e-5)
    assert torch.allclose(drafter.head_input(fed), normed, atol=1e-5)
    assert drafter.top_tokens(fed[0, -1], 1)[1].item() == model.lm_head(normed)[0, -1].argmax().item()


def test_a_deepseek_v4_layers_window_is_kept_alike_in_training_and_on_its_decoding_cache(targets):
    """The block's sliding window (128 here) past its length: one forward over the sequence with the window masked
    (what the training loss's first step computes) equals draft steps on the drafter's cache (decoding), after a
    rejected draft was cropped away; the cache keeps every key (the masks hide those out of the window)."""
    from draftsmith.families import within_window

    _, model, drafter, _ = v4_layer(targets)
    window = drafter.attention_window()
    length, cached = window + 22, window + 12
    ids = torch.randint(3, 4000, (1, length + 1), generator=torch.Generator().manual_seed(2))
    streams = run_target(model, ids, request=FeatureRequest(streams=True)).streams
    features, tokens, positions = streams[:, :length], ids[:, 1:], torch.arange(length)[None]

    def seen(new: int, past: int = 0) -> torch.Tensor:
        query, key = torch.arange(past, past + new)[:, None], torch.arange(past + new)[None]
        return ((key <= query) & within_window(query, key, window))[None, None]

    firsts = []
    draft = drafter.draft
    drafter.draft = lambda *args, **kwargs: firsts.append(draft(*args, **kwargs)) or firsts[-1]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    with torch.no_grad():
        drafter.loss(batch, run_target(model, ids, request=MTP.features(drafter.config, drafter.target)))
        del drafter.draft
        whole = drafter.draft(tokens, features, positions, seen(length))
        cache = drafter.new_cache()
        drafter.draft(tokens[:, :cached], features[:, :cached], positions[:, :cached], seen(cached), cache)
        rejected = slice(cached, cached + 3)
        drafter.draft(
            tokens[:, rejected].flip(-1), features[:, rejected], positions[:, rejected], seen(3, cached), cache
        )
        cache.crop(-3)
        steps = [
            drafter.draft(tokens[:, p : p + 1], features[:, p : p + 1], positions[:, p : p + 1], seen(1, p), cache)
            for p in range(cached, length)
        ]
    assert torch.allclose(firsts[0], whole, atol=1e-5)  # the loss's first step
    assert cache.get_seq_length() == length
    assert torch.allclose(torch.cat(steps, 1), whole[:, cached:], atol=1e-4)


def test_a_deepseek_v4_layer_exports_under_its_release_names_with_the_config_vllm_builds_it_from(targets, tmp_path):
    """The folder: the target's config with one MTP layer and `compress_ratios` one entry longer than its layers, the
    MTP layer's 0 (vLLM reads compress_ratios[num_hidden_layers] for it; transformers' config names the kinds in
    layer_types instead), the layer under exactly the shipped names and shapes, read back as the same layer; vLLM's
    CPU build, which stubs V4's MTP model, is named as the build that cannot check it."""
    folder, model, drafter, shipped = v4_layer(targets)
    shape = TargetShape.of(model, str(folder))
    source = Source(
        drafter, tmp_path, model, TargetInfo(shape, model.config.to_dict(), str(folder), config_json(model))
    )
    exporter = exporter_for("mtp")
    repo = exporter.vllm(source, 3, tmp_path / "export")
    check_tensors(repo, "export")
    assert set(repo.tensors) == {f"mtp.0.{name}" for name in shipped}
    config = repo.config
    assert config["num_nextn_predict_layers"] == 1 and config["architectures"] == ["DeepseekV4ForCausalLM"]
    rates = config["compress_rates"]
    assert config["compress_ratios"] == [*(rates[kind] for kind in config["layer_types"]), 0]
    assert "not implemented on CPU" in repo.cpu_build_limit
    back = exporter.read(tmp_path, config, repo.tensors, model, {})
    read_back = back.checkpoint_tensors()
    assert all(torch.equal(t, read_back[n]) for n, t in drafter.checkpoint_tensors().items())


@pytest.mark.parametrize(
    "edit, said",
    [({"rms_norm_eps": 0.1}, "rms_norm_eps=0.1 \\(the target's: 1e-06\\)"),
     ({"routed_scaling_factor": 9.0}, "routed_scaling_factor=9.0"), ({"kv_lora_rank": 8}, "kv_lora_rank=8"),
     ({"num_nextn_predict_layers": 0}, "num_nextn_predict_layers=0")],
    ids=["eps", "routing", "latent-rank", "no-depth"],
)  # fmt: skip
def test_an_mtp_folder_whose_config_is_not_the_targets_is_refused(edit, said, targets, tmp_path):
    """vLLM builds the MTP layer from the folder's config.json, draftsmith from the target's: a folder whose config
    differs from the target's (edited by hand) evaluated as the target's layer while vLLM would run another function or
    fail to load it. It is refused in one line naming each key; the folder as exported reads."""
    folder, model = targets("deepseek_v3")
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    shape = TargetShape.of(model, str(folder))
    exporter = exporter_for("mtp")
    repo = exporter.vllm(
        Source(drafter, tmp_path, model, TargetInfo(shape, model.config.to_dict(), str(folder), config_json(model))),
        1,
        tmp_path,
    )
    exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    with pytest.raises(UserError, match=rf"{tmp_path}: its config.json is not the target's, .*: {said}"):
        exporter.read(tmp_path, {**repo.config, **edit}, repo.tensors, model, {})


def trained_resumed_and_exported(family: str, tmp_path, small_data, token_cache, capsys) -> tuple[Path, Path]:
    """`recipe=mtp` through the entry points on a `family` target with a random layer: trained, stopped after step 1,
    resumed, exported; (the target, the export's vllm folder)."""
    folder = write_random_target(family, tmp_path / "target", released=family in (*RELEASED, CONVOLVED), **SHAPE)
    write_random_layer(folder)
    return folder, resumed_and_exported(folder, tmp_path, small_data, token_cache, capsys)


def resumed_and_exported(folder: Path, tmp_path, small_data, token_cache, capsys, *settings: str) -> Path:
    """`recipe=mtp` through the entry points on the release at `folder` (with `settings`): trained, stopped after
    step 1, resumed, exported; the export's vllm folder."""
    run = tmp_path / "run"
    args = [*mtp_args(folder, run, small_data, token_cache, save_every=1), *settings]
    assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
    shutil.rmtree(run / "checkpoints" / "step_0000002")  # as if stopped after step 1: the resume trains step 2
    shutil.rmtree(run / "final")
    resumed = run_entry_in_process(["train.py", *args, "train.resume=true"], capsys)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr and "step_0000001" in resumed.stderr
    export = ["-m", "export", *args, f"checkpoint={run / 'final'}", f"export.output={tmp_path / 'export'}"]
    assert run_entry_in_process(export, capsys).returncode == 0
    return tmp_path / "export" / "vllm"


def written_shapes(vllm: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in load_file(str(vllm / "model.safetensors")).items()}


def assert_exported_layer_decodes_losslessly(
    folder: Path, vllm: Path, tmp_path, small_data, tree: int, *settings: str
) -> None:
    """draftsmith's eval, reading the exported folder back, decodes losslessly (one prompt; `tree` nodes, 0: chains;
    `settings`: recipe keys over those)."""
    from draftsmith.eval.report import run_eval

    prompt = first_records(small_data["eval"], tmp_path / "eval.jsonl", 1)
    quick = [f"eval.data=[{prompt}]", "eval.max_new_tokens=16", f"eval.tree={tree}", "eval.ngram_baseline=false"]
    quick += settings
    recipe = ["recipe=mtp", f"target.name_or_path={folder}", f"output_dir={tmp_path / 'eval'}", *quick]
    report = run_eval(load_recipe(recipe), str(vllm))
    rows = [row for domain in report["domains"].values() for row in domain.values() if row.get("lossless") is not None]
    assert rows and all(row["lossless"] for row in rows)


@pytest.mark.slow
def test_a_deepseek_v4_targets_layer_trains_resumes_exports_and_decodes_losslessly_through_the_entry_points(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a DeepSeek-V4 target (was refused: its layer passes hyper-connection streams): it trains,
    resumes, exports under the release's names, and draftsmith's eval, reading the folder back, decodes losslessly
    (chains, one prompt at a time: V4's compressed attention)."""
    folder, vllm = trained_resumed_and_exported("deepseek_v4", tmp_path, small_data, token_cache, capsys)
    config = json.loads((vllm / "config.json").read_text())
    assert written_shapes(vllm) == shipped_shapes(str(folder), config, LAYOUTS["DeepseekV4ForCausalLM"])
    assert len(config["compress_ratios"]) == config["num_hidden_layers"] + 1 and config["compress_ratios"][-1] == 0
    assert "not its CPU build" in (vllm / "draftsmith_export.json").read_text()  # it stubs V4's MTP model
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, tree=0)


def test_a_hy_v4_layers_block_is_its_decoder_layer_on_one_stream_with_its_attention_sinks(targets):
    """vLLM 0.32's HYV4MTP builds the block without the decoder layer's hyper-connections (`enable_ihc = False`; the
    release ships none for it): h = x + attention(input_layernorm(x)), out = h + mlp(post_attention_layernorm(h)), the
    attention's sinks counted (transformers' SDPA would drop them)."""
    folder, model = targets("hy_v4")
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    config, chosen = layout(folder)
    shipped = read_layer(str(folder), config, chosen)
    assert not any("hc_" in name for name in shipped) and not any("_hc." in n for n, _ in drafter.named_parameters())
    assert any(".hc_pre." in name for name in tensor_names(folder))  # the target's own layers have them
    block = drafter.block
    hidden = torch.randn(1, 6, config["hidden_size"], generator=torch.Generator().manual_seed(3))
    positions = torch.arange(6)[None]
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(6, 6).masked_fill(~causal[0, 0], torch.finfo(torch.float32).min)[None, None]
    rope = drafter.rotary_emb(hidden, positions)
    with torch.no_grad():
        out = block(hidden, attention_mask=causal, position_ids=positions, position_embeddings=rope)[0]
        attended = block.self_attn(
            hidden_states=block.input_layernorm(hidden), attention_mask=additive, position_ids=positions,
            position_embeddings=rope,
        )[0]  # fmt: skip
        after = hidden + attended
        assert torch.allclose(out, after + block.mlp(block.post_attention_layernorm(after)), atol=1e-5)
        block.self_attn.sinks.add_(3.0)
        assert not torch.allclose(
            block(hidden, attention_mask=causal, position_ids=positions, position_embeddings=rope)[0], out
        )
        block.self_attn.sinks.sub_(3.0)


def exported_and_read_back(family: str, targets, tmp_path) -> tuple[dict, dict, object]:
    """A `family` target's shipped layer, exported for vLLM and read back as the same layer: (the target's config as
    shipped, the layer's tensors as shipped, the export's repo)."""
    folder, model = targets(family)
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    config, chosen = layout(folder)
    shipped = read_layer(str(folder), config, chosen)
    shape = TargetShape.of(model, str(folder))
    source = Source(
        drafter, tmp_path, model, TargetInfo(shape, model.config.to_dict(), str(folder), config_json(model))
    )
    exporter = exporter_for("mtp")
    repo = exporter.vllm(source, 3, tmp_path / "export")
    check_tensors(repo, "export")
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    read_back = back.checkpoint_tensors()
    assert all(torch.equal(t, read_back[n]) for n, t in drafter.checkpoint_tensors().items())
    return config, shipped, repo


def test_a_hy_v4_layer_exports_under_its_release_names_with_the_targets_config(targets, tmp_path):
    """The folder: the target's config.json as shipped with one MTP layer, the layer under exactly the shipped names
    and shapes (`model.mtp_layers.0.*`, vLLM's HYV4MTP maps them to layer num_hidden_layers), read back alike."""
    config, shipped, repo = exported_and_read_back("hy_v4", targets, tmp_path)
    assert set(repo.tensors) == {f"model.mtp_layers.0.{name}" for name in shipped}
    assert repo.config == {**config, "num_nextn_predict_layers": 1}


@pytest.mark.slow
def test_a_hy_v4_targets_layer_trains_resumes_exports_and_decodes_losslessly_through_the_entry_points(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a HY-V4 target: it trains, resumes, exports under the release's names and shapes, and
    draftsmith's eval, reading the folder back, decodes losslessly."""
    folder, vllm = trained_resumed_and_exported("hy_v4", tmp_path, small_data, token_cache, capsys)
    config = json.loads((vllm / "config.json").read_text())
    assert written_shapes(vllm) == shipped_shapes(str(folder), config, LAYOUTS["HYV4ForCausalLM"])
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, tree=6)


def test_a_glm5_next_blocks_pooled_sparse_attention_is_transformers_on_a_causal_sequence(targets):
    """GLM-5-Next's block attention runs on the drafter's explicit masks (heads/mtp_pooled.py); on one causal sequence
    longer than its index_topk (64 here: 4 pools of 16 and the tail) it is transformers' Glm5NextTextAttention, which
    reads causality from the sequence itself, and the block has no hyper-connections (vLLM's `is_mtp_layer` path)."""
    from draftsmith.heads import mtp_pooled

    folder, model = targets("glm5_next")
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    attn = drafter.block.self_attn
    length = 120
    assert attn.indexer.index_topk < length and not any("_hc." in n for n, _ in drafter.named_parameters())
    hidden = torch.randn(2, length, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None].expand(2, 1, -1, -1)
    with torch.no_grad():
        ours = mtp_pooled.attention(attn, hidden, causal)
        theirs = attn(hidden_states=hidden, attention_mask=torch.ones(2, length, dtype=torch.bool))[0]
        q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
        picked = mtp_pooled.selection(attn.indexer, hidden, q_resid, causal[:, 0], None)
    assert torch.allclose(ours, theirs, atol=1e-5)
    # every earlier key while they fit in index_topk, fewer past it: the selection is tested
    topk = attn.indexer.index_topk
    assert torch.equal(picked[:, :topk], causal[:, 0, :topk]) and not picked[:, -1].all()


@pytest.mark.parametrize(
    "family, feature, selected",
    [
        ("glm5_next", "final", lambda drafter: drafter.block.self_attn.indexer.index_topk + 16),
        ("qwen4_exp", "streams", lambda d: d.layer_config.indexer_budget + d.layer_config.indexer_compress_ratio),
        ("minimax_m3_vl", "final", lambda d: (d.layer_config.index_topk_blocks + 1) * d.layer_config.index_block_size),
        (CONVOLVED, "final", lambda d: d.layer_config.conv_kernel_size),
        (CONVOLVED + LOCAL, "final", lambda d: d.layer_config.sliding_window_size),
    ],
)
def test_later_draft_steps_pool_their_own_entries_in_training_as_in_decoding(family, feature, selected, targets):
    """The training-time test's later steps attend to step 0's entries and their own earlier steps' (stored after
    them); pooled by rank, these are the pools vLLM's decoding builds over positions: past the indexer's budget
    (`selected` keys), the loss's steps 1 and 2 at position t are the chain a decoder drafts from t on its cache.
    GLM-5-Next's and MiniMax-M3's (blocks of keys, by rank) layers read the target's final state, Qwen4-Exp's its
    streams; Inkling's convolves the inputs of the entries it sees last (by rank: its own earlier steps' after step
    0's), its relative bias and a local depth's window counted by rank too."""
    folder, model = targets(family)
    drafter = MTP.from_target(MTP.Config(ttt_steps=3), model, str(folder)).eval()
    length, t = 101, 90
    ids = torch.randint(3, 4000, (1, length), generator=torch.Generator().manual_seed(5))
    target_out = run_target(model, ids, request=MTP.features(drafter.config, drafter.target))
    steps = []
    draft = drafter.draft
    drafter.draft = lambda *args, **kwargs: steps.append(draft(*args, **kwargs)) or steps[-1]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    features = getattr(target_out, feature)[:, : t + 1]
    with torch.no_grad():
        drafter.loss(batch, target_out)
        del drafter.draft
        cache = drafter.new_cache()
        seen = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()[None, None]
        fed = drafter.draft(ids[:, 1 : t + 2], features, torch.arange(t + 1)[None], seen, cache)
        chain = [fed[:, -1:]]
        for step in (1, 2):
            seen = torch.ones(1, 1, 1, t + 1 + step, dtype=torch.bool)
            token, position = ids[:, t + 1 + step : t + 2 + step], torch.tensor([[t + step]])
            chain.append(drafter.draft(token, chain[-1], position, seen, cache))
    assert selected(drafter) < t
    for step in (0, 1, 2):
        assert torch.allclose(steps[step][:, t : t + 1], chain[step], atol=1e-4), step


def test_a_glm5_next_layer_exports_under_the_wrappers_names_with_its_config(targets, tmp_path):
    """The folder: the wrapper's config.json as shipped (vLLM maps its model_type glm5_next to glm5_next_mtp) with one
    MTP layer in its text_config, the layer under exactly the shipped names and shapes (`model.language_model.layers.
    {N}.*`, which vLLM's Glm5NextMTP reads without the prefix), read back as the same layer."""
    config, shipped, repo = exported_and_read_back("glm5_next", targets, tmp_path)
    prefix = f"model.language_model.layers.{config['num_hidden_layers']}."
    assert set(repo.tensors) == {prefix + name for name in shipped}
    assert any(".mlp.experts.0.gate_proj." in name for name in repo.tensors)  # per expert, as the release's layers
    wrapper = json.loads((targets("glm5_next")[0] / "config.json").read_text())
    assert repo.config == {**wrapper, "text_config": {**wrapper["text_config"], "num_nextn_predict_layers": 1}}
    assert exporter_for("mtp").recognises(repo.config, repo.tensors)


def test_a_target_whose_later_draft_steps_share_the_first_ones_selection_is_served_selecting_at_every_step(
    targets, tmp_path
):
    """index_share_for_mtp_iteration: vLLM's later draft steps would reuse step 0's sparse-attention selection, which
    the drafter does not compute (each of its steps selects its own keys). It trains as any target, and the export's
    speculative config turns the sharing off (`"index_share_for_mtp_iteration": false`, which vLLM 0.32.0 to 0.34.0
    read from it over the draft's config); a target without it gets no such key. It was refused."""
    folder, model = targets("glm5_next")
    copy = Path(shutil.copytree(folder, tmp_path / "shared"))
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["index_share_for_mtp_iteration"] = True
    (copy / "config.json").write_text(json.dumps(config))
    MTP.Config().check(local_target_shape(str(copy)))
    exporter = exporter_for("mtp")
    for target, shared in ((copy, True), (folder, False)):
        drafter = MTP.from_target(MTP.Config(), model, str(target))
        info = TargetInfo(TargetShape.of(model, str(target)), model.config.to_dict(), str(target), config_json(model))
        repo = exporter.vllm(Source(drafter, tmp_path, model, info), 3, tmp_path / "export")
        assert repo.options == ({"index_share_for_mtp_iteration": False} if shared else {})
        assert ("selection" in repo.conventions) == shared
        assert served_config(repo, 3, None, drafter).get("index_share_for_mtp_iteration", True) is not shared


@pytest.mark.parametrize("kept", [{"sparse_init_block": 1}, {"sparse_local_block": 2}])
def test_a_target_whose_sparse_attention_keeps_other_blocks_is_refused_in_one_line(targets, tmp_path, kept):
    """vLLM's block-sparse MTP layer always attends to the first sparse_init_block blocks and the query's last
    sparse_local_block; the drafter keeps the query's own block alone (a release's 0 and 1): others refused before
    anything loads."""
    folder, _ = targets("minimax_m3_vl")
    copy = Path(shutil.copytree(folder, tmp_path / "kept"))
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["sparse_attention_config"] = {"sparse_init_block": 0, "sparse_local_block": 1, **kept}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"sparse_attention_config keeps sparse_init_block=") as err:
        MTP.Config().check(local_target_shape(str(copy)))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_glm5_next_targets_layer_trains_resumes_exports_and_decodes_losslessly_through_the_entry_points(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a GLM-5-Next target (a vision-language wrapper draftsmith runs as its language model): it
    trains, resumes, exports under the wrapper's names and shapes, and draftsmith's eval, reading the folder back,
    decodes losslessly."""
    folder, vllm = trained_resumed_and_exported("glm5_next", tmp_path, small_data, token_cache, capsys)
    config = json.loads((vllm / "config.json").read_text())
    text = {**config["text_config"], "architectures": config["architectures"]}
    assert written_shapes(vllm) == shipped_shapes(str(folder), text, LAYOUTS["Glm5NextForConditionalGeneration"])
    # chains: the target's linear attention verifies no tree
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, tree=0)


def test_one_qwen4_exp_draft_step_computes_vllms_formula_from_the_checkpoint(targets):
    """Written from vLLM 0.32's Qwen4ExpMTP (models/qwen4_exp/nvidia/mtp.py, its gated residuals' kernels in
    nvidia/ops/hc.py): the target's last layer's hc_count streams before its final mixer (vLLM's `_mtp_hidden_buffer`),
    pre_fc_norm_hidden over all S*H of them, fc_hidden per stream, fc_embedding(pre_fc_norm_embedding(e)) added to
    each (position 0 not masked), transformers' decoder layer (its QSA indexer picking blocks past its budget: 64
    here) on a causal sequence, then the layer's own mixer for the lm_head; a later step reads the streams."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextDecoderLayer

    folder, model = targets("qwen4_exp")
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    config, chosen = layout(folder)
    shipped = read_layer(str(folder), config, chosen)
    eps, count, width, length = config["rms_norm_eps"], config["hc_count"], config["hidden_size"], 100
    ids = torch.randint(3, 4000, (1, length), generator=torch.Generator().manual_seed(0))
    out = run_target(model, ids, request=FeatureRequest(streams=True))
    streams = out.streams
    assert streams.shape[-2:] == (count, width)
    assert torch.allclose(model.model.hyper_connection_mixer(streams.flatten(-2)), out.final, atol=1e-6)
    positions = torch.arange(length)[None]
    embedded = rms(model.get_input_embeddings().weight[ids], shipped["pre_fc_norm_embedding.weight"], eps, True)
    joint = rms(streams.flatten(-2), shipped["pre_fc_norm_hidden.weight"], eps, True).unflatten(-1, (count, width))
    hidden = joint @ shipped["fc_hidden.weight"].T + (embedded @ shipped["fc_embedding.weight"].T)[..., None, :]
    layer = Qwen4ExpTextDecoderLayer(drafter.layer_config, layer_idx=0).eval()
    layer.load_state_dict(drafter.block.state_dict())
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        rope = drafter.rotary_emb(hidden, positions)
        pre = layer(hidden.flatten(-2), position_embeddings=rope, attention_mask=causal).unflatten(-1, (count, width))
        normed = rms(pre, shipped["hyper_connection_mixer.hc_norm.weight"].view(count, width), eps, True).flatten(-2)
        low = normed @ shipped["hyper_connection_mixer.input_mix_weight_down.weight"].T / count
        gate = torch.sigmoid(low * torch.sigmoid(low) @ shipped["hyper_connection_mixer.input_mix_weight_up.weight"].T)
        mixed = (gate * normed).unflatten(-1, (count, width)).mean(-2)
        fed = drafter.draft(ids, streams, positions, causal)
    assert fed.shape == streams.shape and torch.allclose(fed, pre, atol=1e-4)
    assert torch.allclose(drafter.head_input(fed), mixed, atol=1e-4)
    assert drafter.top_tokens(fed[0, -1], 1)[1].item() == model.lm_head(mixed)[0, -1].argmax().item()
    assert drafter.layer_config.indexer_budget < length


def test_a_qwen4_exp_layers_draft_steps_on_its_cache_compute_what_one_forward_does(targets):
    """Past the QSA indexer's budget (64 here), draft steps on the drafter's cache (decoding) compute what one forward
    over the sequence does (training), after a rejected draft was cut away with its indexer keys."""
    folder, model = targets("qwen4_exp")
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    length, cached = 90, 80
    ids = torch.randint(3, 4000, (1, length), generator=torch.Generator().manual_seed(2))
    streams, positions = (
        run_target(model, ids, request=FeatureRequest(streams=True)).streams,
        torch.arange(length)[None],
    )

    def causal(new: int, past: int = 0) -> torch.Tensor:
        return torch.ones(new, past + new, dtype=torch.bool).tril(past)[None, None]

    with torch.no_grad():
        whole = drafter.draft(ids, streams, positions, causal(length))
        cache = drafter.new_cache()
        drafter.draft(ids[:, :cached], streams[:, :cached], positions[:, :cached], causal(cached), cache)
        rejected = slice(cached, cached + 3)
        drafter.draft(ids[:, rejected].flip(-1), streams[:, rejected], positions[:, rejected], causal(3, cached), cache)
        cache.crop(-3)
        steps = [
            drafter.draft(ids[:, p : p + 1], streams[:, p : p + 1], positions[:, p : p + 1], causal(1, p), cache)
            for p in range(cached, length)
        ]
    assert cache.layers[0].indexer_keys.shape[1] == length
    assert torch.allclose(torch.cat(steps, 1), whole[:, cached:], atol=1e-4)


def test_a_qwen4_exp_layer_exports_under_its_release_names_with_the_config_vllm_maps(targets, tmp_path):
    """The folder: the target's config.json as shipped with one MTP layer (vLLM maps its model_type qwen4_exp_text to
    qwen4_exp_mtp and reads mtp_num_hidden_layers), the layer under exactly the shipped names and shapes (`mtp.*`, its
    mixer beside the block), read back as the same layer."""
    config, shipped, repo = exported_and_read_back("qwen4_exp", targets, tmp_path)
    assert set(repo.tensors) == {f"mtp.{name}" for name in shipped}
    assert "mtp.hyper_connection_mixer.input_mix_weight_up.weight" in repo.tensors
    assert repo.config == {**config, "mtp_num_hidden_layers": 1} and repo.config["model_type"] == "qwen4_exp_text"


def test_a_qwen4_exp_releases_layer_is_read_from_its_wrappers_top_and_exports_as_its_language_models(tmp_path):
    """The release is a vision-language wrapper (`Qwen4ExpForConditionalGeneration`, its count in text_config, the MTP
    layer at the top of the checkpoint, `mtp.*`, which transformers' classes ignore): its folder passes the check,
    loads as Qwen4ExpForCausalLM, and its layer reads back and exports under the same names with the language model's
    config (model_type qwen4_exp_text, which vLLM maps to qwen4_exp_mtp)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from draftsmith.tiny_wrapper import TINY_VISION

    text = json.loads((write_random_target("qwen4_exp", tmp_path / "text", **SHAPE) / "config.json").read_text())
    del text["architectures"]
    vision = {**TINY_VISION, "out_hidden_size": text["hidden_size"]}
    folder = tmp_path / "release"
    AutoModelForImageTextToText.from_config(
        AutoConfig.for_model("qwen4_exp", text_config=text, vision_config=vision)
    ).save_pretrained(folder)
    write_random_layer(folder)
    assert json.loads((folder / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    MTP.Config().check(local_target_shape(str(folder)))
    model = load_target(str(folder))
    assert type(model).__name__ == "Qwen4ExpForCausalLM"
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    shipped = read_layer(str(folder), model.config.to_dict(), LAYOUTS["Qwen4ExpForConditionalGeneration"])
    written = drafter.checkpoint_tensors()
    assert written.keys() == shipped.keys() and all(torch.equal(written[n], shipped[n]) for n in shipped)
    source = Source(drafter, tmp_path, model, TargetInfo(TargetShape.of(model, str(folder)), model.config.to_dict(),
                                                          str(folder), config_json(model)))  # fmt: skip
    repo = exporter_for("mtp").vllm(source, 3, tmp_path / "export")
    check_tensors(repo, "export")
    assert set(repo.tensors) == {f"mtp.{name}" for name in shipped}
    assert repo.config["architectures"] == ["Qwen4ExpForCausalLM"] and repo.config["model_type"] == "qwen4_exp_text"
    assert repo.config["mtp_num_hidden_layers"] == 1 and "vision_config" not in repo.config


@pytest.mark.slow
def test_a_qwen4_exp_targets_layer_trains_resumes_exports_and_decodes_losslessly_through_the_entry_points(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a Qwen4-Exp target (its layer on the target's streams laid side by side): it trains, resumes,
    exports under the release's names and shapes, and draftsmith's eval, reading the folder back, decodes losslessly
    (chains: the target's linear attention verifies no tree)."""
    folder, vllm = trained_resumed_and_exported("qwen4_exp", tmp_path, small_data, token_cache, capsys)
    config = json.loads((vllm / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1
    assert written_shapes(vllm) == shipped_shapes(str(folder), config, LAYOUTS["Qwen4ExpForCausalLM"])
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, tree=0)


def test_a_dots3_note_layer_reads_back_with_its_own_embedding_as_the_sliding_dense_block_vllm_builds(targets):
    """vLLM 0.32's Dots3NoteMTP builds layer N with `mtp_layer_types` (sliding-window attention by default: the
    target's sliding layers' shapes) and a dense MLP (`is_moe` needs an index below num_hidden_layers), and reads its
    own embedding, `model.mtp.embed_tokens` (`has_own_embed_tokens`), not the target's."""
    folder, model = targets("dots3_note_text")
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    config, chosen = layout(folder)
    shipped = read_layer(str(folder), config, chosen)
    written = drafter.checkpoint_tensors()
    assert written.keys() == shipped.keys() and all(torch.equal(written[n], shipped[n]) for n in shipped)
    sliding = config["layer_types"].index("sliding_attention")
    theirs = {n: p.shape for n, p in model.model.layers[sliding].self_attn.named_parameters()}
    assert {n: p.shape for n, p in drafter.block.self_attn.named_parameters()} == theirs
    assert not any("experts" in n for n, _ in drafter.block.named_parameters())
    assert drafter.attention_window() == config["sliding_window"]
    assert "model.mtp.embed_tokens.weight" in tensor_names(folder)
    assert not torch.equal(shipped["embed_tokens.weight"], model.get_input_embeddings().weight)


def test_one_dots3_note_draft_step_computes_vllms_formula_from_the_checkpoint(targets):
    """Written from vLLM 0.32's Dots3NoteMTP (models/dots3_note/nvidia/mtp.py, V3.2's fused_eh_norm): the layer's own
    embedding, zeroed at position 0, and the target's final hidden state, RMS-normed by enorm and hnorm, eh_proj, the
    block, shared_head.norm, fed back normed; the block the drafter's own (read back above) with its sliding rotary."""
    folder, model = targets("dots3_note_text")
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    config, chosen = layout(folder)
    shipped = read_layer(str(folder), config, chosen)
    eps = config["rms_norm_eps"]
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    features, positions = run_target(model, ids).final, torch.arange(6)[None]
    embedded = shipped["embed_tokens.weight"][ids].clone()
    embedded[:, 0] = 0
    normed = [rms(embedded, shipped["enorm.weight"], eps, False), rms(features, shipped["hnorm.weight"], eps, False)]
    hidden = torch.cat(normed, -1) @ shipped["eh_proj.weight"].T
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        rope = drafter.rotary_emb(hidden, positions, layer_type="sliding_attention")
        pre = drafter.block(hidden, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        out = rms(pre, shipped["shared_head.norm.weight"], eps, False)
        fed = drafter.draft(ids, features, positions, causal)
    assert torch.allclose(fed, out, atol=1e-5)
    assert drafter.top_tokens(fed[0, -1], 1)[1].item() == model.lm_head(out)[0, -1].argmax().item()


def test_a_dots3_note_layer_exports_under_its_release_names_its_own_embedding_beside(targets, tmp_path):
    """The folder: the target's config.json as shipped with one MTP layer, the layer under exactly the shipped names
    and shapes (`model.layers.{N}.*` and `model.mtp.embed_tokens.weight`), recognised and read back alike."""
    folder, model = targets("dots3_note_text")
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    config, chosen = layout(folder)
    shape = TargetShape.of(model, str(folder))
    source = Source(
        drafter, tmp_path, model, TargetInfo(shape, model.config.to_dict(), str(folder), config_json(model))
    )
    exporter = exporter_for("mtp")
    repo = exporter.vllm(source, 3, tmp_path / "export")
    check_tensors(repo, "export")
    assert "model.mtp.embed_tokens.weight" in repo.tensors and "model.layers.4.eh_proj.weight" in repo.tensors
    assert repo.config == {**json.loads((folder / "config.json").read_text()), "num_nextn_predict_layers": 1}
    assert exporter.recognises(repo.config, repo.tensors)
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    read_back = back.checkpoint_tensors()
    assert all(torch.equal(t, read_back[n]) for n, t in drafter.checkpoint_tensors().items())


def dots3_note_release(directory):
    """A tiny Dots3-Note release: the tiny language model's weights and tokenizer under the flat config.json releases
    ship (model_type dots3_note, the sliding layers' geometry in `swa_*` keys, the window as `sliding_window_size`,
    both rope bases, layer kinds named full and sliding; the vision and audio towers' configs transformers checks),
    which transformers reads as its wrapper's text config and SGLang's Dots3Config as its own; a random MTP layer."""
    text_only = write_random_target("dots3_note_text", directory / "text", **SHAPE)
    text = json.loads((text_only / "config.json").read_text())
    sliding = {**text, **text["per_layer_config"][str(text["layer_types"].index("sliding_attention"))]}
    kept = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts", "num_experts_per_tok",
            "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "head_dim",
            "index_topk", "index_head_dim", "index_n_heads", "rms_norm_eps", "max_position_embeddings",
            "shared_experts_intermediate_size", "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
    swa = ("num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "head_dim", "qk_nope_head_dim",
           "qk_rope_head_dim", "v_head_dim")  # fmt: skip
    release = {
        "architectures": ["Dots3NoteForCausalLM"], "model_type": "dots3_note", **{key: text[key] for key in kept},
        **{f"swa_{key}": sliding[key] for key in swa}, "sliding_window_size": text["sliding_window"],
        "rope_theta": text["rope_parameters"]["indexed_attention"]["rope_theta"],
        "swa_rope_theta": text["rope_parameters"]["sliding_attention"]["rope_theta"],
        "layer_types": [kind.replace("indexed_attention", "full_attention") for kind in text["layer_types"]],
        **{tower: {"adapter_out_dim": text["hidden_size"]} for tower in ("vision_config", "audio_config")},
    }  # fmt: skip
    folder = directory / "release"
    shutil.copytree(text_only, folder)
    (folder / "config.json").write_text(json.dumps(release))
    write_random_layer(folder)
    return folder


@pytest.mark.slow
def test_a_dots3_note_targets_layer_trains_resumes_exports_and_decodes_losslessly_through_the_entry_points(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a Dots3-Note release (its sliding-window dense block, its own embedding): it trains, resumes,
    exports under the release's names and shapes, its config.json as shipped, and draftsmith's eval, reading the
    folder back, decodes losslessly. (The language model's config saved alone, `dots3_note_text`, is one no vLLM
    reads: its export for vLLM is refused, tests/test_unnamed_families.py.)"""
    folder = dots3_note_release(tmp_path)
    vllm = resumed_and_exported(folder, tmp_path, small_data, token_cache, capsys)
    assert json.loads((vllm / "config.json").read_text()) == {
        **json.loads((folder / "config.json").read_text()),
        "num_nextn_predict_layers": 1,
    }
    config = json.loads((vllm / "config.json").read_text())
    assert written_shapes(vllm) == shipped_shapes(str(folder), config, LAYOUTS["Dots3NoteForCausalLM"])
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, tree=6)


def gemma_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms(x, weight, eps, True)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def neox_rope(x: torch.Tensor, positions: torch.Tensor, dims: int, theta: float) -> torch.Tensor:
    """x [T, heads, D] rotated on its first `dims` channels (halves paired), at `positions` [T]."""
    angles = positions[:, None].float() * theta ** (-torch.arange(0, dims, 2).float() / dims)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    low, high, rest = x[..., : dims // 2], x[..., dims // 2 : dims], x[..., dims:]
    return torch.cat([low * cos - high * sin, high * cos + low * sin, rest], -1)


def minimax_m3_block(layer: dict, config: dict, x: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's MiniMaxM3DecoderLayer as its MTP block builds it (force_sparse_attn, force_moe), written from
    models/minimax_m3/nvidia/model.py and common/ops/index_topk.py on one causal sequence x [T, H], reading the
    release's tensors by name: Gemma norms, per-head QK norms and NeoX rope, the lightning indexer's per-KV-head block
    scores (the max over a block's causal keys), the query's own block forced, the best `index_topk_blocks` blocks
    attended; sigmoid-routed experts (w1, w3, w2) with the score-correction bias, scaled, beside the shared expert."""
    eps, heads, kv_heads = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    dim, index_dim = config["head_dim"], config["index_head_dim"]
    size, topk, theta = config["index_block_size"], config["index_topk_blocks"], config["rope_parameters"]["rope_theta"]
    rotated = int(dim * config["rope_parameters"].get("partial_rotary_factor", 1.0))
    length, positions = x.shape[0], torch.arange(x.shape[0])
    x_in = gemma_rms(x, layer["input_layernorm.weight"], eps)

    def heads_of(name: str, normed: str, width: int, rope_dims: int) -> torch.Tensor:
        out = gemma_rms((x_in @ layer[name].T).view(length, -1, width), layer[normed], eps)
        return neox_rope(out, positions, rope_dims, theta)

    index_q = heads_of(
        "self_attn.index_q_proj.weight", "self_attn.index_q_norm.weight", index_dim, min(rotated, index_dim)
    )
    index_k = heads_of(
        "self_attn.index_k_proj.weight", "self_attn.index_k_norm.weight", index_dim, min(rotated, index_dim)
    )
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    scores = torch.einsum("qhd,kd->hqk", index_q, index_k[:, 0]).masked_fill(~causal, float("-inf"))
    blocks = -(-length // size)
    padded = torch.nn.functional.pad(scores, (0, blocks * size - length), value=float("-inf"))
    block_scores = padded.view(kv_heads, length, blocks, size).amax(-1)
    own = positions // size
    block_scores[:, positions, own] = float("inf")  # the local block (index_local_blocks = 1)
    chosen = torch.zeros(kv_heads, length, blocks, dtype=torch.bool)
    best = block_scores.topk(min(topk, blocks), -1)
    chosen.scatter_(-1, best.indices, best.values > float("-inf"))
    allowed = chosen.repeat_interleave(size, -1)[..., :length] & causal  # [kv_heads, T, T]
    q = heads_of("self_attn.q_proj.weight", "self_attn.q_norm.weight", dim, rotated)
    k = heads_of("self_attn.k_proj.weight", "self_attn.k_norm.weight", dim, rotated)
    v = (x_in @ layer["self_attn.v_proj.weight"].T).view(length, -1, dim)
    group = heads // kv_heads
    logits = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * dim**-0.5
    logits = logits.masked_fill(~allowed.repeat_interleave(group, 0), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v.repeat_interleave(group, 1)).reshape(length, -1)
    h = x + attended @ layer["self_attn.o_proj.weight"].T
    y = gemma_rms(h, layer["post_attention_layernorm.weight"], eps)
    alpha, limit = config["swiglu_alpha"], config["swiglu_limit"]
    moe = "block_sparse_moe."
    weights = torch.sigmoid(y @ layer[f"{moe}gate.weight"].T)
    picked = (weights + layer[f"{moe}e_score_correction_bias"]).topk(config["num_experts_per_tok"], -1).indices
    share = weights.gather(-1, picked)
    share = share / share.sum(-1, keepdim=True)
    routed = torch.zeros_like(y)
    for token in range(length):
        for slot, expert in enumerate(picked[token].tolist()):
            w1, w2, w3 = (layer[f"{moe}experts.{expert}.w{i}.weight"] for i in (1, 2, 3))
            routed[token] += share[token, slot] * (swiglu_oai(y[token] @ w1.T, y[token] @ w3.T, alpha, limit) @ w2.T)
    shared = swiglu_oai(
        y @ layer[f"{moe}shared_experts.gate_proj.weight"].T, y @ layer[f"{moe}shared_experts.up_proj.weight"].T,
        alpha, limit,
    ) @ layer[f"{moe}shared_experts.down_proj.weight"].T  # fmt: skip
    return h + routed * config["routed_scaling_factor"] + shared


def test_one_minimax_m3_draft_step_computes_vllms_formula_from_the_checkpoint(targets):
    """Written from vLLM 0.32's MiniMaxM3MTP (models/minimax_m3/nvidia/mtp.py): the target's embedding zeroed at
    position 0, enorm and hnorm (Gemma's x * (1 + w)), eh_proj over [embedding, hidden], the block
    (`transformer_layer.*`: minimax_m3_block, past its indexer's 16 blocks of 4 keys here), fed back unnormed, the
    logits lm_head(final_layernorm(pre)); read from the release's names under `language_model.model.mtp.layers.0.`."""
    folder, model = targets("minimax_m3_vl")
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    config, chosen = layout(folder)
    shipped = read_layer(str(folder), config, chosen)
    eps, length = config["rms_norm_eps"], 100
    ids = torch.randint(3, 4000, (1, length), generator=torch.Generator().manual_seed(0))
    features, positions = run_target(model, ids).final, torch.arange(length)[None]
    embedded = model.get_input_embeddings().weight[ids].clone()
    embedded[:, 0] = 0
    normed = [gemma_rms(embedded, shipped["enorm.weight"], eps), gemma_rms(features, shipped["hnorm.weight"], eps)]
    hidden = torch.cat(normed, -1) @ shipped["eh_proj.weight"].T
    block = {name.removeprefix("transformer_layer."): t for name, t in shipped.items()}
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        pre = minimax_m3_block(block, config, hidden[0])[None]
        fed = drafter.draft(ids, features, positions, causal)
    assert config["index_topk_blocks"] * config["index_block_size"] < length
    assert torch.allclose(fed, pre, atol=1e-4)
    logits = model.lm_head(gemma_rms(pre, shipped["final_layernorm.weight"], eps))
    assert drafter.top_tokens(fed[0, -1], 1)[1].item() == logits[0, -1].argmax().item()


def test_a_minimax_m3_blocks_sparse_attention_is_transformers_on_a_causal_sequence(targets):
    """MiniMax-M3's block attention runs on the drafter's explicit masks (heads/mtp_blocks.py); on one causal sequence
    past its indexer's selection (16 blocks of 4 keys) it is transformers' MiniMaxM3VLAttention, which counts the
    blocks from the cache's first slot, and it attends to fewer keys than the query sees."""
    from draftsmith.heads import mtp_blocks

    folder, model = targets("minimax_m3_vl")
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    attn, length = drafter.block.self_attn, 120
    hidden = torch.randn(2, length, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(length)[None].expand(2, -1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None].expand(2, 1, -1, -1)
    with torch.no_grad():
        rope = drafter.rotary_emb(hidden, positions)
        ours = mtp_blocks.attention(attn, hidden, causal, rope)
        theirs = attn(hidden_states=hidden, position_embeddings=rope, attention_mask=None, position_ids=positions)[0]
        picked = mtp_blocks.selection(attn.indexer, hidden, rope, causal[:, 0], None)
    assert torch.allclose(ours, theirs, atol=1e-5)
    kept = attn.indexer.topk_blocks * attn.indexer.block_size
    assert torch.equal(picked[:, :, :kept], causal[:, :, :kept].expand_as(picked[:, :, :kept]))
    assert (picked[:, :, -1].sum(-1) == kept).all()


def test_a_minimax_m3_layer_exports_under_the_releases_names_with_its_config(targets, tmp_path):
    """The folder: the release's config.json as shipped (vLLM maps its model_type minimax_m3_vl to minimax_m3_mtp) with
    `num_mtp_modules` 1 in its text_config, the layer under exactly the shipped names and shapes
    (`language_model.model.mtp.layers.0.*`, the block's experts per expert under `transformer_layer.`), read back
    as the same layer."""
    config, shipped, repo = exported_and_read_back("minimax_m3_vl", targets, tmp_path)
    assert set(repo.tensors) == {f"language_model.model.mtp.layers.0.{name}" for name in shipped}
    assert "language_model.model.mtp.layers.0.transformer_layer.block_sparse_moe.experts.0.w1.weight" in repo.tensors
    assert "language_model.model.mtp.layers.0.transformer_layer.self_attn.index_q_proj.weight" in repo.tensors
    release = json.loads((targets("minimax_m3_vl")[0] / "config.json").read_text())
    assert repo.config == {**release, "text_config": {**release["text_config"], "num_mtp_modules": 1}}
    assert exporter_for("mtp").recognises(repo.config, repo.tensors)


@pytest.mark.slow
def test_a_minimax_m3_releases_layer_trains_resumes_exports_and_decodes_losslessly_through_the_entry_points(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a MiniMax-M3 release folder (the wrapper, draftsmith runs its language model): it trains,
    resumes, exports under the release's names and shapes, and draftsmith's eval, reading the folder back, decodes
    losslessly (chains: the target's block-sparse attention verifies no tree)."""
    folder, vllm = trained_resumed_and_exported("minimax_m3_vl", tmp_path, small_data, token_cache, capsys)
    config = json.loads((vllm / "config.json").read_text())
    assert config["text_config"]["num_mtp_modules"] == 1
    text = {**config["text_config"], "architectures": config["architectures"]}
    assert written_shapes(vllm) == shipped_shapes(str(folder), text, LAYOUTS["MiniMaxM3SparseForConditionalGeneration"])
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, tree=0)


def inkling_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vLLM's fused_sconv with its residual (nvidia/ops/sconv.py): x [T, C] convolved over the W taps ending at each
    position, tap i at position t - (W - 1) + i weighed by weight[:, 0, i], none before position 0."""
    width, out = weight.shape[-1], x.clone()
    for t in range(x.shape[0]):
        for i in range(width):
            if t - (width - 1) + i >= 0:
                out[t] += weight[:, 0, i] * x[t - (width - 1) + i]
    return out


def inkling_block(layer: dict, config: dict, x: torch.Tensor, local: bool) -> torch.Tensor:
    """vLLM 0.32's InklingDecoderLayer as its MTP depth builds it (force_dense_mlp, no log scaling), written from
    models/inkling/nvidia/model.py, attention.py, mlp.py and ops on one causal sequence x [T, H], reading the release's
    tensors by name: attn_norm; wq_du, wk_dv, wv_dv, wr_du; the K and V convolutions before the per-head q and k
    norms; scores q.k / head_dim plus the relative logits (r @ rel_logits_proj) at the distance back, none from the
    extent on (the sliding window's for a local depth, which sees that many positions); wo_ud, its convolution and
    the residual; mlp_norm, the interleaved w13_dn's SiLU(gate) * up, w2_md, global_scale, its convolution."""
    eps, length = config["rms_norm_eps"], x.shape[0]
    prefix = "swa_" if local else ""
    heads, kv_heads = config[f"{prefix}num_attention_heads"], config[f"{prefix}num_key_value_heads"]
    dim = config[f"{prefix}head_dim"]
    a = rms(x, layer["attn_norm.weight"], eps, False)
    q = (a @ layer["attn.wq_du.weight"].T).view(length, heads, dim)
    k = inkling_conv(a @ layer["attn.wk_dv.weight"].T, layer["attn.k_sconv.weight"]).view(length, kv_heads, dim)
    v = inkling_conv(a @ layer["attn.wv_dv.weight"].T, layer["attn.v_sconv.weight"]).view(length, kv_heads, dim)
    r = (a @ layer["attn.wr_du.weight"].T).view(length, heads, -1)
    q, k = rms(q, layer["attn.q_norm.weight"], eps, False), rms(k, layer["attn.k_norm.weight"], eps, False)
    relative = torch.einsum("thd,de->hte", r, layer["attn.rel_logits_proj.proj"])
    extent = relative.shape[-1]
    distance = torch.arange(length)[:, None] - torch.arange(length)[None]
    bias = relative.gather(-1, distance.clamp(0, extent - 1).expand(heads, -1, -1)).masked_fill(distance >= extent, 0)
    group = heads // kv_heads
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) / dim + bias
    visible = (distance >= 0) & ((distance < config["sliding_window_size"]) if local else True)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    attended = torch.einsum("hqk,khd->qhd", weights, v.repeat_interleave(group, 1)).reshape(length, -1)
    h = x + inkling_conv(attended @ layer["attn.wo_ud.weight"].T, layer["attn_sconv.weight"])
    m = rms(h, layer["mlp_norm.weight"], eps, False) @ layer["mlp.w13_dn.weight"].T
    mixed = (torch.nn.functional.silu(m[:, 0::2]) * m[:, 1::2]) @ layer["mlp.w2_md.weight"].T
    return h + inkling_conv(mixed * layer["mlp.global_scale"], layer["mlp_sconv.weight"])


@pytest.mark.parametrize("family", [CONVOLVED, CONVOLVED + LOCAL])
def test_one_inkling_draft_step_computes_vllms_formula_from_the_checkpoint(family, targets):
    """Written from vLLM 0.32's InklingMTP (models/inkling/nvidia/mtp.py, ops/norm.py's embed_dual_rmsnorm_cat): the
    target's embedding normed by its embed_norm (`use_embed_norm`), then by the depth's; the input [hidden_norm(f) |
    embed_norm(e)] (hidden first), input_proj, the block (`transformer_block.*`: inkling_block, full attention or, for
    a depth in mtp_config's local_layer_ids, its sliding window past the window here), chain_norm fed back, the logits
    lm_head(chain_norm(pre)) / logits_mup_width_multiplier; read from the release's names under
    `model.mtp.layers.0.` and `model.mtp.chain_norm`, nothing masked at position 0."""
    folder, model = targets(family)
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    config, chosen = layout(folder)
    shipped = read_layer(str(folder), config, chosen)
    release = load_file(str(folder / "model.safetensors"))
    eps, length, local = config["rms_norm_eps"], 60, family.endswith(LOCAL)
    ids = torch.randint(3, 4000, (1, length), generator=torch.Generator().manual_seed(0))
    features, positions = run_target(model, ids).final, torch.arange(length)[None]
    assert config["use_embed_norm"] and torch.equal(
        shipped["target_embed_norm.weight"], release["model.llm.embed_norm.weight"]
    )
    # the target's embed_norm as a trained one (a random target's is ones, and an RMS norm of ones twice is one)
    target_norm = model.get_input_embeddings().embed_norm.weight
    trained = 1 + torch.rand(target_norm.shape, generator=torch.Generator().manual_seed(1))
    embedded = rms(release["model.llm.embed.weight"][ids], trained, eps, False)
    normed = [
        rms(features, shipped["hidden_norm.weight"], eps, False),
        rms(embedded, shipped["embed_norm.weight"], eps, False),
    ]
    hidden = torch.cat(normed, -1) @ shipped["input_proj.weight"].T
    block = {name.removeprefix("transformer_block."): t for name, t in shipped.items()}
    with torch.no_grad():
        pre = inkling_block(block, config, hidden[0], local)[None]
        shipped_norm = target_norm.clone()
        target_norm.copy_(trained)
        fed = drafter.draft(ids, features, positions)
        target_norm.copy_(shipped_norm)
        out = rms(pre, release["model.mtp.chain_norm.weight"], eps, False)
        logits = (out / config["logits_mup_width_multiplier"]) @ release["model.llm.unembed.weight"].T
        theirs = drafter.top_tokens(fed[0, -1], 5)
    assert (config["sliding_window_size"] < length) and (local == (drafter.block.self_attn.sliding_window is not None))
    assert torch.allclose(fed, out, atol=1e-4)
    assert torch.allclose(theirs[0], logits[0, -1].log_softmax(-1).topk(5).values, atol=1e-4)
    assert theirs[1].tolist() == logits[0, -1].topk(5).indices.tolist()


@pytest.mark.parametrize("family", [CONVOLVED, CONVOLVED + LOCAL])
def test_an_inkling_block_on_the_drafters_masks_is_transformers_decoder_layer_on_a_causal_sequence(family, targets):
    """Inkling's block runs its convolutions, relative bias and window on the drafter's explicit masks
    (heads/mtp_convolved.py); on one causal sequence past the sliding window it is transformers' InklingDecoderLayer
    (its eager attention, the one adding the relative bias), which reads them from the sequence's slots."""
    from transformers.models.inkling.modeling_inkling import InklingDecoderLayer

    folder, model = targets(family)
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    config = drafter.layer_config
    config._attn_implementation = "eager"
    layer = InklingDecoderLayer(config, 0).eval()
    layer.load_state_dict(drafter.block.state_dict())
    length = 70
    hidden = torch.randn(2, length, config.hidden_size, generator=torch.Generator().manual_seed(4))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if family.endswith(LOCAL):
        causal &= ~torch.ones(length, length, dtype=torch.bool).tril(-config.sliding_window_size)
    additive = torch.zeros(length, length).masked_fill(~causal, float("-inf"))[None, None]
    with torch.no_grad():
        ours = drafter.block(
            hidden, torch.ones(length, length, dtype=torch.bool).tril()[None, None].expand(2, 1, -1, -1)
        )
        theirs = layer(hidden, attention_mask=additive)
    assert config.sliding_window_size < length and config.log_scaling_n_floor is None
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_an_inkling_drafters_cache_cuts_its_convolutions_inputs_with_its_keys(targets):
    """A rejected draft's entries are cut off the drafter's cache (EagleProposer.catch_up crops it): the
    convolutions' inputs kept beside the keys go with them, so the committed tokens fed again compute what one forward
    over the committed sequence does."""
    folder, model = targets(CONVOLVED)
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    ids = torch.randint(3, 4000, (1, 31), generator=torch.Generator().manual_seed(7))
    features = run_target(model, ids).final[:, :30]
    with torch.no_grad():
        whole = drafter.draft(ids[:, 1:], features, torch.arange(30)[None])
        cache = drafter.new_cache()
        drafter.draft(ids[:, 1:26], features[:, :25], torch.arange(25)[None], None, cache)
        drafted = torch.ones(1, 1, 3, 28, dtype=torch.bool).tril(25)  # three draft entries, a chain
        drafter.draft(ids[:, 26:29] + 1, features[:, 25:28], torch.arange(25, 28)[None], drafted, cache)
        cache.crop(22 - 28)  # to the accepted prefix: the last three committed entries are fed again, as catch_up does
        again = torch.ones(1, 1, 8, 30, dtype=torch.bool).tril(22)
        fed = drafter.draft(ids[:, 23:31], features[:, 22:30], torch.arange(22, 30)[None], again, cache)
    assert cache.get_seq_length() == 30
    assert torch.allclose(fed, whole[:, 22:], atol=1e-5)


def test_an_inkling_layer_exports_under_the_releases_names_with_its_config(targets, tmp_path):
    """The folder: the release's config.json as shipped (vLLM maps its model_type inkling_mm_model to inkling_mtp,
    reading `mtp_config`) with one depth in its mtp_config and in the text_config's copy transformers reads, the layer
    under exactly the shipped names and shapes (`model.mtp.layers.0.*`, the block's under `transformer_block.` in the
    release's fused names, `model.mtp.chain_norm`), and the target's `model.llm.embed_norm`, which vLLM's InklingMTP
    loads from the drafter's folder (its backbone_embed_norm) and would otherwise leave unset; read back alike."""
    config, shipped, repo = exported_and_read_back(CONVOLVED, targets, tmp_path)
    outside = {
        "chain_norm.weight": "model.mtp.chain_norm.weight",
        "target_embed_norm.weight": "model.llm.embed_norm.weight",
    }
    assert set(repo.tensors) == {outside.get(name, f"model.mtp.layers.0.{name}") for name in shipped}
    assert "model.mtp.layers.0.transformer_block.attn.wq_du.weight" in repo.tensors
    assert "model.mtp.layers.0.transformer_block.mlp.w13_dn.weight" in repo.tensors
    release = json.loads((targets(CONVOLVED)[0] / "config.json").read_text())
    assert release["mtp_config"]["num_nextn_predict_layers"] == 1 and release["text_config"]["use_embed_norm"]
    assert repo.config == {**release, "mtp_config": {**release["mtp_config"], "num_nextn_predict_layers": 1}}
    assert exporter_for("mtp").recognises(repo.config, repo.tensors)


@pytest.mark.parametrize(
    "fields, refused",
    [
        ({"num_nextn_predict_layers": 2}, r"text_config.num_mtp_layers and mtp_config.num_nextn_predict_layers disag"),
        ({"chain_hidden_post_norm": False}, r"text_config.chain_hidden_post_norm and mtp_config.chain_hidden_post_"),
        ({"local_layer_ids": [0]}, r"text_config.mtp_local_layer_ids and mtp_config.local_layer_ids disagree"),
    ],
)
def test_an_inkling_release_asking_for_another_mtp_layer_is_refused_in_one_line(fields, refused, targets, tmp_path):
    """A text_config (transformers' reading, the drafter's) whose depths' count, chain norm or sliding depths differ
    from the mtp_config vLLM reads: refused before anything loads (several depths, or none of the chain norm, as both
    read them: tests/test_mtp_depths.py)."""
    folder, _ = targets(CONVOLVED)
    copy = Path(shutil.copytree(folder, tmp_path / "release"))
    config = json.loads((copy / "config.json").read_text())
    config["mtp_config"] |= fields
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=refused) as err:
        MTP.Config().check(local_target_shape(str(copy)))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_an_inkling_releases_layer_trains_resumes_exports_and_decodes_losslessly_through_the_entry_points(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on an Inkling release folder (the wrapper, draftsmith runs its language model): it trains,
    resumes, exports under the release's names and shapes, and draftsmith's eval, reading the folder back, decodes
    losslessly (chains: the target's convolutions verify no tree)."""
    folder, vllm = trained_resumed_and_exported(CONVOLVED, tmp_path, small_data, token_cache, capsys)
    config = json.loads((vllm / "config.json").read_text())
    assert config["mtp_config"]["num_nextn_predict_layers"] == 1 == config["text_config"]["num_mtp_layers"]
    text = {**config["text_config"], "architectures": config["architectures"]}
    assert written_shapes(vllm) == shipped_shapes(str(folder), text, LAYOUTS["InklingForConditionalGeneration"])
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, tree=0)
