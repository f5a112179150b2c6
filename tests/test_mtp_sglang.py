"""The `mtp` kind for SGLang (formats/mtp_sglang.py): the layer trained as SGLang's NextN models compute it (the
embedding at position 0 read, later steps fed the normed output, one layer at every step), exported to the folder
SGLang reads, and refused in one line where SGLang would serve another function. SGLang cannot run here (its kernels
need CUDA): the folder is checked against its loader source, the layer's function against the formula read there."""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from draftsmith.errors import UserError
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.mtp import served_target_config
from draftsmith.formats.mtp_sglang import COMPUTED_AS, DRAFT_KEYS, computed_as, sglang_model
from draftsmith.formats.repo import EngineRepo, TargetInfo, check_tensors
from draftsmith.heads import drafter_class
from draftsmith.heads.mtp import text_fields
from draftsmith.heads.mtp_layer import read_layer
from draftsmith.heads.mtp_layouts import LAYOUTS
from draftsmith.heads.mtp_random_layer import write_random_layer
from draftsmith.random_target import write_random_target
from draftsmith.recipe import load_recipe
from draftsmith.target import TargetShape, config_json, load_target, loaded_config, local_target_shape, run_target
from tests import test_mtp_2026b, test_mtp_bailing, test_mtp_other_family_block
from tests.helpers import fast_tier, first_records, run_entry_in_process
from tests.test_mtp import (
    assert_exported_layer_decodes_losslessly,
    dots3_note_release,
    layout,
    mtp_args,
    rms,
    trains_ahead_and_decodes_losslessly,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
# SGLang's DeepSeek NextN norms its inputs with a CUDA kernel taking hidden sizes of 512 to 8192 in steps of 256
WIDE = {**SHAPE, "hidden_size": 512}
# SGLang's DeepSeek-V4 attends a fixed window of 128 keys
SHAPES = {"deepseek_v3": WIDE, "deepseek_v32": WIDE, "glm_moe_dsa": WIDE, "glm5_next": WIDE,
          "deepseek_v4": {**SHAPE, "sliding_window": 128}}  # fmt: skip
SHARING = ("deepseek_v32", "glm5_next")  # targets whose config has later draft steps share the first one's selection
# targets draftsmith's load_target builds: a wrapper as its language model, Ling-3.0's release architecture (which
# transformers has no class of)
LOADED_BY_DRAFTSMITH = ("glm5_next", "bailing_hybrid")
# what a Ling-3.0 release says of its routing, which SGLang's config reads (softmax without the expert bias,
# unrenormalised, where it lacks them)
LING_ROUTING = {"moe_router_enable_expert_bias": True, "norm_topk_prob": True}
NEMOTRON_H_LETTERS = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}  # its pattern's
NEMOTRON_H_PATTERNS = {
    "layers_block_type": "hybrid_override_pattern",
    "mtp_layers_block_type": "mtp_hybrid_override_pattern",
}


def nemotron_h_release(directory):
    """A tiny Nemotron-H whose config.json names its layer kinds as the releases do (hybrid_override_pattern, which
    SGLang's config reads; it refuses transformers' names), with a random MTP layer."""
    folder = write_random_target("nemotron_h", directory, **SHAPE)
    config = json.loads((folder / "config.json").read_text())
    for kinds, pattern in NEMOTRON_H_PATTERNS.items():
        config[pattern] = "".join(NEMOTRON_H_LETTERS[kind] for kind in config.pop(kinds))
    (folder / "config.json").write_text(json.dumps(config))
    write_random_layer(folder)
    return folder


def ling_release(directory):
    """A tiny Ling-3.0 release (tests/test_mtp_bailing.py's) whose config.json says its routing as releases do."""
    folder = test_mtp_bailing.release_target(directory)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | LING_ROUTING))
    return folder


# releases whose config.json carries fields transformers' lacks: HY-V3's routing, LongCat-Flash's MLA LoRA scaling;
# Nemotron-H's layer kinds as its releases name them; Ling-3.0's (vLLM's and SGLang's names)
RELEASES = {
    "hy_v3": functools.partial(test_mtp_2026b.release_target, "hy_v3"),
    "longcat_flash": functools.partial(test_mtp_other_family_block.release_target, "longcat_flash"),
    "nemotron_h": nemotron_h_release,
    "bailing_hybrid": ling_release,
}
TWO_DEPTHS = "+2"  # a family's target (`targets`) shipping two MTP depths
FOR_SGLANG = COMPUTED_AS  # SGLang's function but DeepSeek-V4's and ERNIE-4.5's (computed_as; GLM-4.5's feedback too)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """family -> (folder, model) of a tiny target with a random MTP layer, built once."""

    @functools.cache
    def build(family: str):
        model_type, depths = family.removesuffix(TWO_DEPTHS), 2 if family.endswith(TWO_DEPTHS) else 1
        if model_type in RELEASES:  # a release's config as shipped (other modules' fixtures), its layer
            return RELEASES[model_type](tmp_path_factory.mktemp(model_type)), None
        folder = write_random_target(model_type, tmp_path_factory.mktemp(model_type), **SHAPES.get(family, SHAPE))
        if model_type in SHARING:  # later steps share the first one's selection, as the target's config asks
            config = json.loads((folder / "config.json").read_text())
            text_fields(config)["index_share_for_mtp_iteration"] = True  # a wrapper's in its text_config
            (folder / "config.json").write_text(json.dumps(config))
        write_random_layer(folder, block={"num_nextn_predict_layers": depths} if depths > 1 else None)
        return folder, None

    @functools.cache
    def loaded(family: str):
        folder, _ = build(family)
        if family in LOADED_BY_DRAFTSMITH:
            return folder, load_target(str(folder))
        return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)

    return loaded


def source_of(family: str, targets, tmp_path, **config) -> Source:
    folder, model = targets(family)
    drafter = MTP.from_target(MTP.Config(**config), model, str(folder))
    shape = TargetShape.of(model, str(folder))
    return Source(drafter, tmp_path, model, TargetInfo(shape, model.config.to_dict(), str(folder), config_json(model)))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "glm4_moe_lite"])
def test_a_layer_trained_for_sglang_computes_its_nextn_formula_reading_position_0(family, targets):
    """SGLang's DeepseekModelNextN and Glm4MoeModelNextN: shared_head.norm(decoder(eh_proj(cat(enorm(e), hnorm(f)))))
    with the embedding at position 0 read (vLLM's models zero it), the normed output fed to the next step; the
    position-0 entry of the layer's cache reaches the last position's draft, which vLLM's function drafts otherwise."""
    folder, model = targets(family)
    drafter = MTP.from_target(MTP.Config(**FOR_SGLANG), model, str(folder)).eval()
    vllms = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    config, chosen = layout(folder)
    shipped = read_layer(str(folder), config, chosen)
    embed_norm, hidden_norm, proj, final_norm = (shipped[f"{name}.weight"] for name in chosen.names)
    eps = config["rms_norm_eps"]
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    features = run_target(model, ids).final
    positions = torch.arange(6)[None]
    embedded = model.get_input_embeddings().weight[ids]  # position 0 read
    hidden = torch.cat([rms(embedded, embed_norm, eps), rms(features, hidden_norm, eps)], -1) @ proj.T
    rope = drafter.rotary_emb(hidden, positions)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        pre = drafter.block(hidden, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        pre = pre[0] if isinstance(pre, tuple) else pre
        fed, vllms_fed = (each.draft(ids, features, positions, causal) for each in (drafter, vllms))
    assert torch.allclose(fed, rms(pre, final_norm, eps), atol=1e-5)
    if chosen.masks_first_position:  # GLM-4.7-Flash's layout is SGLang's: no vLLM release serves it
        assert not torch.allclose(fed[0, -1], vllms_fed[0, -1], atol=1e-3)


# the fast tier: one family for each function SGLang computes (COMPUTES) - DeepSeek-V3's default, V4's unnormed
# streams, ERNIE's zeroed position 0 without a final norm - and Qwen3-Next's linear attention; the rest slow
FAST_FAMILIES = ("deepseek_v3", "deepseek_v4", "ernie4_5_moe", "qwen3_next")


@pytest.mark.parametrize(
    "family",
    fast_tier([
        "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe", "glm4_moe_lite", "glm5_next", "hy_v3",
        "longcat_flash", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "deepseek_v4",
        "ernie4_5_moe", "nemotron_h", "bailing_hybrid", "hy_v4",
    ], FAST_FAMILIES.__contains__),
)  # fmt: skip
def test_a_layer_trained_for_sglang_exports_to_the_folder_its_nextn_model_reads(family, targets, tmp_path):
    """The target's config.json with one MTP layer (num_nextn_predict_layers, which DeepSeek's and GLM's loaders
    assert is 1; V3.2's selection sharing off, where SGLang reads it), the layer under exactly the shipped names and
    shapes (SGLang leaves a missing tensor uninitialised without a word), served as NEXTN; read back as SGLang computes
    it. vLLM's export of a DeepSeek or GLM layer trained so is refused; a Qwen layer is the same function in both."""
    folder, model = targets(family)
    computed = computed_as(loaded_config(model)["architectures"][0])
    source = source_of(family, targets, tmp_path, **computed)
    exporter = exporter_for("mtp")
    repo = exporter.build("sglang", source, 3, tmp_path / "sglang")
    check_tensors(repo, "export")
    served = served_target_config(str(folder), loaded_config(model), 1)
    if family in SHARING:
        assert text_fields(served)["index_share_for_mtp_iteration"] and "selection" in repo.conventions
        assert not text_fields(repo.config)["index_share_for_mtp_iteration"]
        text_fields(served)["index_share_for_mtp_iteration"] = False
    text_fields(served).update(DRAFT_KEYS.get(sglang_model(served["architectures"][0]), {}))  # ERNIE's rotation
    assert repo.config == served
    assert text_fields(repo.config).get("num_nextn_predict_layers", repo.config.get("mtp_num_hidden_layers")) == 1
    assert set(repo.tensors) == set(exporter.vllm(source_of(family, targets, tmp_path), 3, tmp_path / "v").tensors)
    assert "--speculative-algorithm NEXTN --speculative-draft-model-path {path}" in repo.serve
    # GLM-4.5's loader skips fused experts without a word and Qwen3-Next's raises on them: one tensor per expert (the
    # Qwen3.5-MoE and HY-V4 releases' fused form is read by Qwen3.5's loader and DeepSeek's, which split it)
    fused = any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in repo.tensors)
    assert fused == (family in ("qwen3_5_moe_text", "hy_v4"))
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {"engine": "sglang"})
    assert (back.layout.masks_first_position, back.layout.feeds_back_normed) == tuple(computed.values())
    written = source.drafter.checkpoint_tensors()
    assert all(torch.equal(tensor, back.checkpoint_tensors()[name]) for name, tensor in written.items())
    layout = LAYOUTS[source.drafter.config.decoder["architecture"]]
    if layout.vllm_refused:
        with pytest.raises(UserError, match=r"no vLLM release checked serves .* glm4_moe_lite_mtp .* sets "
                           r"num_hidden_layers to 0 .*; export it for sglang"):  # fmt: skip
            exporter.build("vllm", source, 3, tmp_path / "vllm")
    elif layout.masks_first_position == computed["masks_first_position"]:  # the same function in both engines
        check_tensors(exporter.build("vllm", source, 3, tmp_path / "vllm"), "export")
    else:
        with pytest.raises(UserError, match=r"drafter.masks_first_position=false, as SGLang computes it\), and every "
                           r"vLLM release checked zeroes it in"):  # fmt: skip
            exporter.build("vllm", source, 3, tmp_path / "vllm")


@pytest.mark.parametrize(
    "family, config, said",
    [
        ("deepseek_v3", {}, r"trained with the embedding at position 0 zeroed, as vLLM's deepseek_mtp computes it, "
         r"and SGLang's DeepseekV3ForCausalLMNextN reads it: export it for vllm, or train with "
         r"drafter.masks_first_position=false for sglang"),
        # both ways it trained otherwise than SGLang computes, and both settings, in one line (a newcomer's journey,
        # 2026-12-07: the line named one, and the retraining met the other); vLLM does not serve it either
        ("glm4_moe", {"masks_first_position": False}, r"trained later draft steps on the layer's output before its "
         r"final norm, and SGLang's Glm4MoeForCausalLMNextN feeds them the output after it: no engine serves this "
         r"drafter as it trained .*, or train with drafter.masks_first_position=false drafter.feeds_back_normed=true "
         r"for sglang$"),
        ("glm4_moe", {}, r"zeroed, as vLLM's glm4_moe_mtp computes it, and SGLang's Glm4MoeForCausalLMNextN reads it; "
         r"and later draft steps .*: export it for vllm, or train with drafter.masks_first_position=false "
         r"drafter.feeds_back_normed=true for sglang$"),
        ("qwen3_next+2", {"mtp_depths": 2}, r"trained 2 depths, one per draft step, and SGLang's "
         r"Qwen3NextForCausalLMMTP runs one layer at every step"),
        ("ernie4_5_moe", {"masks_first_position": False}, r"position 0 read, and SGLang's Ernie4_5_MoeForCausalLMMTP "
         r"zeroes it: no engine serves this drafter as it trained .*: train it with drafter.masks_first_position "
         r"unset and export it for vllm, or train with the recipe's defaults for sglang$"),
        ("exaone_moe", {}, r"draftsmith has not checked SGLang's MTP model for ExaoneMoeForCausalLM \(checked: "
         r"BailingMoeV3, DeepseekV3, "),
    ],
)  # fmt: skip
def test_a_layer_sglang_would_compute_otherwise_is_refused_in_one_line(family, config, said, targets, tmp_path):
    source = source_of(family, targets, tmp_path, **config)
    with pytest.raises(UserError, match=said):
        exporter_for("mtp").build("sglang", source, 3, tmp_path / "sglang")


def test_vllms_refusal_of_a_layer_trained_for_sglang_sends_it_there_only_where_sglang_serves_it(targets, tmp_path):
    """A GLM-4.5 layer trained with position 0 read but fed back before its final norm: vLLM's refusal said "export it
    for sglang", SGLang's "export it for vllm" (a newcomer's journey, 2026-12-07). Each now says no engine serves it,
    and names every setting each engine needs."""
    source = source_of("glm4_moe", targets, tmp_path, masks_first_position=False)
    with pytest.raises(UserError, match=r"zeroes it in glm4_moe_mtp: no engine serves it as it trained \(SGLang "
                       r"neither\); train it with drafter.masks_first_position unset for vllm, or with "
                       r"drafter.masks_first_position=false drafter.feeds_back_normed=true for sglang$"):  # fmt: skip
        exporter_for("mtp").build("vllm", source, 3, tmp_path / "vllm")
    served = source_of("glm4_moe", targets, tmp_path / "served", masks_first_position=False, feeds_back_normed=True)
    with pytest.raises(UserError, match=r"zeroes it in glm4_moe_mtp: export it for sglang; train it with "):
        exporter_for("mtp").build("vllm", served, 3, tmp_path / "served" / "vllm")


def test_sglangs_kernel_and_layer_reading_limits_are_refused_and_a_zeroed_position_no_engine_computes(tmp_path):
    """DeepSeek's NextN norms with a CUDA kernel that refuses a hidden size not a multiple of 256 (the tiny
    targets'), reads a one-layer target's own layer 0 as the MTP layer; and zeroing position 0 where vLLM does not is
    refused at the recipe's check, before anything loads. A drafter trained for SGLang alone (position 0 read) is not
    sent to the vllm export, which refuses it: the line says no engine serves it as trained."""
    narrow = write_random_target("deepseek_v3", tmp_path / "narrow", **SHAPE)
    write_random_layer(narrow)
    model = AutoModelForCausalLM.from_pretrained(narrow, dtype=torch.float32).eval().requires_grad_(False)
    drafter = MTP.from_target(MTP.Config(**FOR_SGLANG), model, str(narrow))
    info = TargetInfo(TargetShape.of(model, str(narrow)), model.config.to_dict(), str(narrow), config_json(model))
    with pytest.raises(UserError, match=r"fused_eh_norm\) that refuses hidden_size=64 .*: no engine serves this "
                       r"drafter as it trained \(drafter.masks_first_position=false, which no vLLM release "
                       r"computes\): train it with drafter.masks_first_position unset and export it for "
                       r"vllm$"):  # fmt: skip
        exporter_for("mtp").refuse("sglang", drafter, info, "speculators")
    one_layer = TargetInfo(
        info.shape, {**info.config, "hidden_size": 512, "num_hidden_layers": 1}, str(narrow), info.config_json
    )
    with pytest.raises(UserError, match=r"does not load a one-layer target's MTP layer \(layer 1\): its loader then"):
        exporter_for("mtp").refuse("sglang", drafter, replace_hidden(one_layer, 512), "speculators")
    qwen = write_random_target("qwen3_next", tmp_path / "qwen", **SHAPE)
    write_random_layer(qwen)
    with pytest.raises(UserError, match=r"masks_first_position=true: vLLM's qwen3_next_mtp does not zero"):
        MTP.Config(masks_first_position=True).check(local_target_shape(str(qwen)))


@pytest.mark.parametrize(
    "model_type, cases",
    [
        ("deepseek_v4", [  # a 48-key window as written
            ({}, r"DeepseekV4ForCausalLMNextN attends the last 128 keys .*sliding_window is 48: no engine serves"),
            ({"sliding_window": 128, "swiglu_limit": None}, r"V3's, .* it lacks swiglu_limit: no engine serves"),
            ({"sliding_window": 128, "q_head_norm": False}, r"reads q_head_norm=false or hc_pre_from_prev_sublayer"),
            ({"sliding_window": 128, "hc_pre_from_prev_sublayer": True}, r"hc_pre_from_prev_sublayer=true \(V4.1's"),
            ({"sliding_window": 128}, None),
        ]),
        ("ernie4_5_moe", [
            ({"use_bias": True}, r"SGLang's Ernie4_5_MoeForCausalLMMTP adds biases to the attention's projections"),
            ({"rope_is_neox_style": True}, r"rotates the target's layers neox-style \(rope_is_neox_style=true\)"),
            ({"partial_rotary_factor": 0.5}, r"rotates a part of each head \(partial_rotary_factor=0.5\)"),
            ({"hidden_act": "gelu"}, r"runs SiLU MLPs only \(hidden_act=gelu\): export it for vllm"),
            ({"rope_is_neox_style": False}, None),
        ]),
        ("nemotron_h", [  # the release's pattern
            ({"layers_block_type": list(NEMOTRON_H_LETTERS)}, r"NemotronHForCausalLMMTP accepts the layer kinds "
             r"mamba, attention, mlp, moe and refuses the config.json's full_attention, linear_attention \(transf"),
            ({"sliding_window": 64}, r"attends a window of sliding_window=64 keys, which transformers ignores"),
            ({"n_shared_experts": 2}, r"n_shared_experts=2 times wide"),
            ({"mlp_bias": True}, r"with ReLU² and no biases \(mlp_hidden_act, mlp_bias\)"),
            ({}, None),
        ]),
        ("bailing_hybrid", [  # Ling-3.0's release, its routing said
            ({"moe_router_enable_expert_bias": None}, r"BailingMoeForCausalLMNextN reads moe_router_enable_expert_bias "
             r"as false \(its default: the config.json lacks it\), where draftsmith \(transformers\) computes "
             r"the layer with true: export it for vllm"),
            ({"norm_topk_prob": None}, r"reads norm_topk_prob as false"),
            ({"expert_swiglu_limit_list": [7.0, 0, 0, 0]}, r"swiglu_limit_list\[0\] as 7.0, where .* with 0:"),
            ({"rms_norm_eps": 1e-5}, r"reads rms_norm_eps as 1e-05, where draftsmith \(transformers\) computes the "
             r"layer with 1e-06"),
            ({"short_conv_kernel_size": None}, r"reads short_conv_kernel_size as null \(its default: .* with 4"),
            ({}, None),
        ]),
        ("hy_v4", [
            ({"mlp_layer_types": ["dense"] * 4}, r"HYV4ForCausalLMNextN builds the layer with experts, and draftsmith "
             r"\(vLLM\) the target's last layer's dense MLP: no engine serves this drafter as it trained"),
            ({"n_group": 2, "topk_group": 1}, r"routes ungrouped \(it sets n_group and topk_group to 1; the "
             r"target's: 2, 1\)"),
            ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, r"DeepSeek's YaRN"),
            ({}, None),
        ]),
    ],
)  # fmt: skip
def test_a_config_sglang_reads_otherwise_than_transformers_is_refused_in_one_line(model_type, cases, tmp_path):
    """SGLang's DeepSeek-V4 attends a fixed 128-key window, reads the config.json as DeepSeek-V3's (another model's
    defaults for what it lacks) and reads V4.1's attention and stream switches; its ERNIE-4.5 MTP block reads biases,
    the rotation's style and part, and the activation; its Nemotron-H config refuses transformers' names of the layer
    kinds and reads a window and the shared expert's width and activation; its Ling-3.0 config reads the routing,
    the experts, the MLA layer's eps and the clamp under its own names and defaults: for the target too (the folder
    cannot mend it), each refused in one line, read from the config.json as shipped; with none of them it exports."""
    if model_type in RELEASES:
        folder = RELEASES[model_type](tmp_path / model_type)
    else:
        folder = write_random_target(model_type, tmp_path / model_type, **SHAPE)
        write_random_layer(folder)
    if model_type in LOADED_BY_DRAFTSMITH:
        model = load_target(str(folder))
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    computed = computed_as(model.config.architectures[0])
    drafter = MTP.from_target(MTP.Config(**computed), model, str(folder))
    info = TargetInfo(TargetShape.of(model, str(folder)), model.config.to_dict(), str(folder), config_json(model))
    shipped = json.loads((folder / "config.json").read_text())
    for edit, said in cases:  # edited as shipped and as transformers reads it (a key removed: read as it was)
        config = {key: value for key, value in (shipped | edit).items() if value is not None}
        (folder / "config.json").write_text(json.dumps(config))
        read = replace(info, config=info.config | {key: value for key, value in edit.items() if value is not None})
        if said is None:
            exporter_for("mtp").refuse("sglang", drafter, read, "speculators")
        else:
            with pytest.raises(UserError, match=said):
                exporter_for("mtp").refuse("sglang", drafter, read, "speculators")


def replace_hidden(info: TargetInfo, hidden: int) -> TargetInfo:
    return replace(info, shape=replace(info.shape, hidden_size=hidden))


@pytest.mark.slow
def test_the_demo_targets_layer_trains_for_sglang_and_its_folder_evaluates_like_the_checkpoint(
    small_data, token_cache, tmp_path, capsys
):
    """Through the entry points on the demo MTP target (GLM-4.5's layout): trained for SGLang (`drafter.*` keys), the
    checkpoint exports for sglang (exit 0, its card's command NEXTN), for vllm it is refused in one line before
    anything is written (exit 2); read back by draftsmith's eval, the SGLang folder decodes as the checkpoint does,
    losslessly."""
    from draftsmith.eval.report import run_eval

    name = load_recipe(["recipe=mtp"]).target.name_or_path
    target = load_target(name)
    settings = [f"drafter.{key}={str(value).lower()}" for key, value in FOR_SGLANG.items()]
    train = [f"data.train=[{small_data['train']}]", "data.eval=[]", f"data.cache_dir={token_cache}"]
    train += ["data.max_length=64", "train.max_steps=2", "train.micro_batch_size=2", "train.warmup_steps=0"]
    run = tmp_path / "run"
    train += ["eval.enabled=false", f"output_dir={run}"]
    trained = run_entry_in_process(["train.py", "recipe=mtp", *settings, *train], capsys)
    assert trained.returncode == 0 and "no engine serves" not in trained.stderr  # SGLang's does
    checkpoint = run / "final"
    assert json.loads((checkpoint / "config.json").read_text())["drafter"]["masks_first_position"] is False
    export = ["-m", "export", "recipe=mtp", *settings, f"checkpoint={checkpoint}", f"output_dir={run}"]
    refused = run_entry_in_process([*export, f"export.output={tmp_path / 'both'}"], capsys)
    assert refused.returncode == 2 and "every vLLM release checked zeroes it" in refused.stderr
    assert not (tmp_path / "both").exists()
    done = run_entry_in_process([*export, f"export.output={tmp_path / 'export'}", "export.engines=[sglang]"], capsys)
    assert done.returncode == 0
    folder = tmp_path / "export" / "sglang"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Glm4MoeForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert all(name.startswith("model.layers.4.") for name in load_file(str(folder / "model.safetensors")))
    info = json.loads((folder / "draftsmith_export.json").read_text())
    assert info["engine"] == "sglang" and "--speculative-algorithm NEXTN" in (folder / "README.md").read_text()
    prompt = first_records(small_data["eval"], tmp_path / "eval.jsonl", 1)
    quick = [f"eval.data=[{prompt}]", "eval.max_new_tokens=16", "eval.tree=0", "eval.ngram_baseline=false"]
    rows = {}
    for label, path in (("checkpoint", checkpoint), ("sglang", folder)):
        recipe = load_recipe(["recipe=mtp", f"output_dir={tmp_path / label}", *quick])
        report = run_eval(recipe, str(path), target=target)
        rows[label] = [
            (row["new_tokens"], row["target_forwards"], row["accepted"], row["lossless"])
            for domain in report["domains"].values()
            for row in domain.values()
        ]
    assert rows["sglang"] == rows["checkpoint"] and all(row[3] for row in rows["sglang"])


@pytest.mark.slow
def test_a_layer_no_engine_would_serve_is_said_as_training_starts(small_data, token_cache, tmp_path, capsys):
    """Trained for SGLang (position 0 read) on a DeepSeek target whose hidden size SGLang's kernel refuses, a layer
    neither export takes trained to its end in silence, each export then naming the other engine: the start says so,
    with both engines' reasons (it still trains, for draftsmith's eval)."""
    narrow = write_random_target("deepseek_v3", tmp_path / "narrow", **SHAPE)
    write_random_layer(narrow)
    settings = [f"drafter.{key}={str(value).lower()}" for key, value in FOR_SGLANG.items()]
    train = [f"target.name_or_path={narrow}", f"data.train=[{small_data['train']}]", "data.eval=[]", "eval.tree=0"]
    train += [f"data.cache_dir={token_cache}", "data.max_length=64", "train.max_steps=1", "train.micro_batch_size=2"]
    train += ["train.warmup_steps=0", "eval.enabled=false", f"output_dir={tmp_path / 'run'}"]
    trained = run_entry_in_process(["train.py", "recipe=mtp", *settings, *train], capsys)
    assert trained.returncode == 0, trained.stderr
    said = [line for line in trained.stderr.splitlines() if "no engine serves this drafter as it will train" in line]
    assert len(said) == 1 and "vLLM: this MTP drafter trained with the embedding at position 0 read" in said[0], said
    assert "SGLang: SGLang's DeepseekV3ForCausalLMNextN norms its inputs with a CUDA kernel" in said[0], said


@pytest.mark.slow
def test_a_glm_4_7_flash_layer_trains_as_sglang_computes_it_and_decodes_losslessly(targets):
    """GLM-4.7-Flash (glm4_moe_lite), whose layer no vLLM release serves as shipped: its MLA block with experts, read
    from layer N, trains several steps ahead as SGLang's Glm4MoeLiteForCausalLMNextN computes it and decodes
    losslessly in draftsmith's loop."""
    trains_ahead_and_decodes_losslessly(*targets("glm4_moe_lite"), rounds=8, prompt_length=20)


def test_a_longcat_flash_release_without_its_lora_scaling_flags_writes_them_as_draftsmith_trained(targets, tmp_path):
    """SGLang's LongCat-Flash config reads an absent `mla_scale_*_lora` as true (scaling the MLA LoRA norms), draftsmith
    and transformers as false: the SGLang folder's config says false, as the layer trained."""
    folder, _ = targets("longcat_flash")
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    config = json.loads((bare / "config.json").read_text())
    flags = ("mla_scale_q_lora", "mla_scale_kv_lora")
    (bare / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in flags}))
    model = AutoModelForCausalLM.from_pretrained(bare, dtype=torch.float32).eval().requires_grad_(False)
    drafter = MTP.from_target(MTP.Config(), model, str(bare))
    assert drafter.config.decoder["norm_scales"] == {}  # unscaled, as transformers' layers compute an absent flag
    info = TargetInfo(TargetShape.of(model, str(bare)), model.config.to_dict(), str(bare), config_json(model))
    source = Source(drafter, tmp_path, model, info)
    repo = exporter_for("mtp").build("sglang", source, 3, tmp_path / "sglang")
    assert {flag: repo.config[flag] for flag in flags} == dict.fromkeys(flags, False)


# A Qwen4-Exp language model SGLang builds: its QSA indexer selecting 2048 / 4 = 512 blocks (its top-k kernel's width),
# its rotation's part written (SGLang's text config reads an absent one as 0.25, transformers as 1.0)
QWEN4_EXP_SERVED = {"indexer_budget": 2048, "indexer_compress_ratio": 4}
QWEN4_EXP_ROTARY = {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 1.0}


def qwen4_exp_release(directory, **text):
    """A tiny Qwen4-Exp release: the vision-language wrapper (the only Qwen4-Exp architecture SGLang serves) whose
    text_config is a tiny language model's with `text`, and a random MTP layer at the top of its checkpoint."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from draftsmith.tiny_wrapper import TINY_VISION

    text_only = write_random_target("qwen4_exp", directory / "text", **SHAPE)
    language_model = json.loads((text_only / "config.json").read_text())
    del language_model["architectures"]
    vision = {**TINY_VISION, "out_hidden_size": language_model["hidden_size"]}
    folder = directory / "release"
    AutoModelForImageTextToText.from_config(
        AutoConfig.for_model("qwen4_exp", text_config=language_model | text, vision_config=vision)
    ).save_pretrained(folder)
    for tokenizer in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(text_only / tokenizer, folder)
    write_random_layer(folder)
    return folder


def exported_for_sglang_in_bfloat16(folder, tmp_path) -> tuple[Source, EngineRepo]:
    """The release at `folder` loaded in bfloat16 (the dtype SGLang serves Qwen4-Exp and Dots3-Note in), its layer
    as SGLang computes it, exported for sglang at γ 3 with the tensors checked: (the export's source, the folder)."""
    model = load_target(SimpleNamespace(name_or_path=str(folder), revision=None, dtype="bfloat16",
                                        trust_remote_code=False))  # fmt: skip
    computed = computed_as(loaded_config(model)["architectures"][0])
    drafter = MTP.from_target(MTP.Config(**computed), model, str(folder))
    info = TargetInfo(TargetShape.of(model, str(folder)), loaded_config(model), str(folder), config_json(model))
    source = Source(drafter, tmp_path, model, info)
    repo = exporter_for("mtp").build("sglang", source, 3, tmp_path / "sglang")
    check_tensors(repo, "export")
    return source, repo


@pytest.mark.slow
def test_a_qwen4_exp_releases_layer_exports_for_sglang_in_its_wrappers_config_each_step_selecting(tmp_path):
    """SGLang rewrites only the wrapper (Qwen4ExpForConditionalGeneration) to its Qwen4ExpForCausalLMMTP, which
    computes vLLM's function (the target's streams, then the layer's own, unmixed; position 0 read): the folder holds
    the wrapper's config.json whole, its text_config the vLLM folder's with later draft steps selecting their own keys
    (SGLang's default shares the first one's), the vLLM folder's tensors, and reads back as trained. Refused in one
    line: a target served in another dtype than the bfloat16 its hyper-connections are built in, a config SGLang reads
    otherwise or whose indexer it cannot build, and the language model's own architecture, for which it has no model."""
    folder = qwen4_exp_release(tmp_path, **QWEN4_EXP_SERVED, rope_parameters=QWEN4_EXP_ROTARY)
    source, repo = exported_for_sglang_in_bfloat16(folder, tmp_path)
    model, drafter, info, exporter = source.target_model, source.drafter, source.target, exporter_for("mtp")
    shipped = json.loads((folder / "config.json").read_text())
    assert repo.config == {
        **shipped,
        "text_config": {**shipped["text_config"], "mtp_num_hidden_layers": 1, "index_share_for_mtp_iteration": False},
    }
    assert set(repo.tensors) == set(exporter.build("vllm", source, 3, tmp_path / "vllm").tensors)
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {"engine": "sglang"})
    assert not back.layout.masks_first_position and not back.layout.feeds_back_normed
    written = drafter.checkpoint_tensors()
    assert all(torch.equal(tensor, back.checkpoint_tensors()[name]) for name, tensor in written.items())
    text = text_fields(info.config)
    cases = [
        ({"indexer_budget": 64}, r"SGLang's Qwen4ExpForCausalLMMTP selects 512 or 2048 blocks of 2, 4, 8 keys "
         r"\(indexer_budget / indexer_compress_ratio\), and the target 16 of 4: export it for vllm"),
        ({"rope_parameters": {**QWEN4_EXP_ROTARY, "partial_rotary_factor": None}}, r"reads partial_rotary_factor "
         r"as 0.25 \(its default: the config.json lacks it\), where draftsmith \(transformers\) computes the layer "
         r"with 1.0"),
        ({"tie_word_embeddings": True}, r"leaves its own lm_head unset where the target ties it"),
        ({"attention_bias": True}, r"builds its attention without biases \(attention_bias=true\)"),
        ({"dtype": "float32"}, r"builds its hyper-connections' weights in bfloat16 whatever --dtype says \(its "
         r"target's too\), and this export serves the target in float32: export with target.dtype=bfloat16, or for "
         r"vllm"),
    ]  # fmt: skip
    for edit, said in cases:  # the text_config as shipped and as transformers reads it (None: removed)
        written_text = {**shipped["text_config"], **edit}
        written_text["rope_parameters"] = {k: v for k, v in written_text["rope_parameters"].items() if v is not None}
        (folder / "config.json").write_text(json.dumps({**shipped, "text_config": written_text}))
        read = replace(info, config={**text, **{k: written_text[k] for k in edit}})
        with pytest.raises(UserError, match=said):
            exporter.refuse("sglang", drafter, read, "speculators")
    language_model = tmp_path / "text"
    with pytest.raises(UserError, match=r"SGLang builds its Qwen4ExpForCausalLMMTP from a "
                       r"Qwen4ExpForConditionalGeneration target only \(the release's wrapper: it has no model for "
                       r"Qwen4ExpForCausalLM\): export it for vllm"):  # fmt: skip
        alone = json.loads((language_model / "config.json").read_text())
        exporter.refuse("sglang", drafter, replace(info, shape=replace(info.shape, name_or_path=str(language_model)),
                                                   config_json=alone), "speculators")  # fmt: skip


@pytest.mark.slow
def test_a_qwen4_exp_releases_layer_trains_in_bfloat16_exports_for_both_engines_and_its_sglang_folder_is_lossless(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a Qwen4-Exp release loaded in bfloat16 (SGLang's dtype for its hyper-connections) through the
    entry points: it trains, exports for vllm and sglang, and draftsmith's eval, reading the SGLang folder (the
    wrapper's config) back, decodes losslessly."""
    folder = qwen4_exp_release(tmp_path, **QWEN4_EXP_SERVED, rope_parameters=QWEN4_EXP_ROTARY)
    run, export = tmp_path / "run", tmp_path / "export"
    args = [*mtp_args(folder, run, small_data, token_cache), "target.dtype=bfloat16"]
    assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
    engines = "export.engines=[vllm,sglang]"
    exported = ["-m", "export", *args, f"checkpoint={run / 'final'}", f"export.output={export}", engines]
    assert run_entry_in_process(exported, capsys).returncode == 0
    assert json.loads((export / "sglang" / "config.json").read_text())["architectures"] == [
        "Qwen4ExpForConditionalGeneration"
    ]
    assert "--dtype bfloat16" in (export / "sglang" / "README.md").read_text()
    assert_exported_layer_decodes_losslessly(folder, export / "sglang", tmp_path, small_data, 0, args[-1])


@pytest.mark.slow
def test_a_dots3_note_releases_layer_trained_for_sglang_exports_its_flat_config_at_the_one_chain_it_verifies(tmp_path):
    """SGLang's Dots3NoteForCausalLMNextN reads the release's flat config.json (SGLang's own Dots3Config: its pinned
    transformers knows no Dots3) and computes the layer with position 0 read, the normed output fed back, its block a
    sliding-window layer of the `swa_*` geometry: a layer trained so exports the config as shipped and the vLLM
    folder's tensors, and reads back as trained. Refused in one line: a chain other than 3 (its sliding-window MLA
    verifies 1 or 4 tokens a request), a target not served in bfloat16 (kv_b_proj), a config SGLang reads otherwise
    (its own defaults where a `swa_*` key, the window or the sliding rope base is absent), an MTP block of another
    kind, another gate, and transformers' form of the config (the tiny language model's), which SGLang cannot read."""
    folder = dots3_note_release(tmp_path)
    source, repo = exported_for_sglang_in_bfloat16(folder, tmp_path)
    model, drafter, info, exporter = source.target_model, source.drafter, source.target, exporter_for("mtp")
    shipped = json.loads((folder / "config.json").read_text())
    assert repo.config == shipped and shipped["num_nextn_predict_layers"] == 1
    vllms = MTP.from_target(MTP.Config(), model, str(folder))
    assert set(repo.tensors) == set(exporter.vllm(replace(source, drafter=vllms), 3, tmp_path / "vllm").tensors)
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {"engine": "sglang"})
    assert not back.layout.masks_first_position and back.layout.feeds_back_normed
    written = drafter.checkpoint_tensors()
    assert all(torch.equal(tensor, back.checkpoint_tensors()[name]) for name, tensor in written.items())
    with pytest.raises(UserError, match=r"SGLang's Dots3NoteForCausalLMNextN verifies 3 draft tokens a step only \(its "
                       r"sliding-window attention's fallback takes 1 or 4 query tokens a request\), and this export "
                       r"drafts 4: export with export.num_speculative_tokens=3, or for vllm"):  # fmt: skip
        exporter.build("sglang", source, 4, tmp_path / "sglang4")
    cases = [
        ({"swa_num_attention_heads": None}, r"Dots3NoteForCausalLMNextN reads swa_num_attention_heads as 32 \(its "
         r"default: the config.json lacks it\), where draftsmith \(transformers\) computes the layer with 2: no "
         r"engine serves this drafter as it trained"),
        ({"sliding_window_size": None}, r"reads sliding_window_size as 512 \(its default"),
        ({"swa_rope_theta": None}, r"reads swa_rope_theta as 80000000.0 \(its default: .* with 50000.0"),
        ({"mtp_layer_types": ["full_attention"]}, r"builds the layer with sliding-window attention, and "
         r"mtp_layer_types"),
        ({"swa_attention_gate_type": "elementwise"}, r"gates the attention elementwise, transformers per head"),
        ({"dtype": "float32"}, r"asserts its MLA kv_b_proj is bfloat16 \(or block FP8\) \(its target's too\), and this "
         r"export serves the target in float32"),
    ]  # fmt: skip
    for edit, said in cases:  # as shipped (None: removed); the dtype the target is loaded in
        (folder / "config.json").write_text(json.dumps({k: v for k, v in (shipped | edit).items() if v is not None}))
        read = replace(info, config={**info.config, "dtype": edit.get("dtype", "bfloat16")})
        with pytest.raises(UserError, match=said):
            exporter.refuse("sglang", drafter, read, "speculators")
    text_only = replace(info, shape=replace(info.shape, name_or_path=str(tmp_path / "text")))
    with pytest.raises(UserError, match=r"reads a release's flat config.json only \(model_type dots3_note, its swa_\* "
                       r"keys\), and the target's is transformers' form \(dots3_note_text"):  # fmt: skip
        exporter.refuse("sglang", drafter, text_only, "speculators")


@pytest.mark.slow
def test_a_dots3_note_releases_layer_trains_for_sglang_in_bfloat16_and_its_folder_decodes_losslessly(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp drafter.masks_first_position=false` on a Dots3-Note release loaded in bfloat16 through the entry
    points: it trains, exports for sglang at γ 3, and draftsmith's eval, reading the folder back, decodes losslessly."""
    folder = dots3_note_release(tmp_path)
    run, export = tmp_path / "run", tmp_path / "export"
    settings = ["target.dtype=bfloat16", "drafter.masks_first_position=false"]
    args = [*mtp_args(folder, run, small_data, token_cache), *settings]
    assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
    engine = ["export.engines=[sglang]", "export.num_speculative_tokens=3"]
    exported = ["-m", "export", *args, f"checkpoint={run / 'final'}", f"export.output={export}", *engine]
    assert run_entry_in_process(exported, capsys).returncode == 0
    assert "--speculative-num-steps 3" in (export / "sglang" / "README.md").read_text()
    assert_exported_layer_decodes_losslessly(folder, export / "sglang", tmp_path, small_data, 0, settings[0])
