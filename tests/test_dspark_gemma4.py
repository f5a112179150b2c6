"""DSpark with Gemma-4 draft layers (drafter.layer_family=gemma4_text, heads/dflash_gemma4.py) for a Gemma-4 target,
exported in vLLM 0.32's `Gemma4DSparkModel` layout (formats/dspark_gemma4.py): one layer computes what vLLM's
Gemma4DSparkDecoderLayer computes (a reference written from vLLM's source, on weights read back from the folder);
a teacher-forced block is the decoding block and greedy speculative decoding is plain greedy; the folder is vLLM's
layout and reads back into the same drafter; through the entry points it trains, resumes, exports and decodes from
the folder losslessly; what vLLM's layout cannot build is refused in one line; and vLLM's own code (its speculative
config, its Gemma-4 DSpark model's load_weights and modules, run on a CPU without an engine) takes the folder and
computes the drafter's block outputs."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.eval.loop import prefill
from draftsmith.formats import dspark_gemma4
from draftsmith.formats.dspark_gemma4 import ARCHITECTURE
from draftsmith.formats.folder import read_folder
from draftsmith.target import load_target, run_target
from tests.helpers import (
    DEMO,
    assert_greedy_equals_plain,
    assert_one_line_error,
    block_computed_in_vllm,
    first_records,
    fitted_eagle,
    greedy_text,
    run_entry_in_process,
    save_drafter,
    trains_then_resumes_alike,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET = DEMO / "gemma4-target"  # 2 layers (sliding, full), per-kind RoPE; its layer 1 is the post-norm last state
LAYERS = {"layer_family": "gemma4_text", "target_layers": "[0]"}


@pytest.fixture(scope="module")
def target():
    return load_target(str(TARGET))


def exported(target, tmp_path, capsys, kind: str = "dspark", **config):
    config = {**LAYERS, **({"markov_rank": 16} if kind == "dspark" else {}), **config}
    checkpoint = save_drafter(kind, target, tmp_path / "ckpt", target_name=str(TARGET), **config)
    args = ["-m", "export", f"recipe={kind}", f"checkpoint={checkpoint}", f"target.name_or_path={TARGET}",
            f"export.output={tmp_path / 'export'}", "export.engines=[vllm]",
            f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    return checkpoint, run_entry_in_process(args, capsys), tmp_path / "export" / "vllm"


def rms(x: torch.Tensor, weight=None, eps: float = 1e-6) -> torch.Tensor:
    """vLLM's RMSNorm: x / sqrt(mean(x²) + eps), times the weight where it has one (v_norm has none)."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def neox_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """vLLM's get_rope(is_neox_style=True) over the whole head: [n, heads, d] at positions [n]."""
    dim = x.shape[-1]
    freqs = positions[:, None].double() / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = freqs.cos()[:, None].float(), freqs.sin()[:, None].float()
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def vllm_layer(w: dict, prefix: str, config: dict, hidden, context, positions, context_positions) -> torch.Tensor:
    """One Gemma4DSparkDecoderLayer as read from vLLM 0.32's gemma4_dspark.py / gemma4_mtp.py: the block `hidden`
    [S, H] at `positions`, attending (non-causally, scaling 1) to the context [C, H] (hidden_norm(fc(...))) whose keys
    are k_norm(k_proj) with RoPE and values v_norm(k_proj) (attention_k_eq_v), then its own keys/values."""
    heads, kv, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    theta, eps = config["rope_parameters"]["full_attention"]["rope_theta"], config["rms_norm_eps"]

    def get(name):
        return w[prefix + name]

    def keys_values(x, at):
        raw = (x @ get("self_attn.k_proj.weight").T).view(len(x), kv, dim)
        return neox_rope(rms(raw, get("self_attn.k_norm.weight"), eps), at, theta), rms(raw, None, eps)

    x = rms(hidden, get("input_layernorm.weight"), eps)
    q = neox_rope(
        rms((x @ get("self_attn.q_proj.weight").T).view(len(x), heads, dim), get("self_attn.q_norm.weight"), eps),
        positions,
        theta,
    )
    context_k, context_v = keys_values(context, context_positions)
    block_k, block_v = keys_values(x, positions)
    k, v = torch.cat([context_k, block_k]), torch.cat([context_v, block_v])
    k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k)  # scaling 1.0
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(x), heads * dim)
    h = hidden + rms(attended @ get("self_attn.o_proj.weight").T, get("post_attention_layernorm.weight"), eps)
    y = rms(h, get("pre_feedforward_layernorm.weight"), eps)
    y = F.gelu(y @ get("mlp.gate_proj.weight").T, approximate="tanh") * (y @ get("mlp.up_proj.weight").T)
    h = h + rms(y @ get("mlp.down_proj.weight").T, get("post_feedforward_layernorm.weight"), eps)
    return h * get("layer_scalar")  # fmt: skip


def test_the_folder_is_vllms_gemma4_layout_reads_back_and_its_layers_compute_vllms(target, tmp_path, capsys):
    """The folder names vLLM's Gemma4DSparkModel with the Gemma-4 config it reads (every layer full attention with
    values = keys, one head shape, no soft-capping) and DSpark's keys, holds no embedding or lm_head (vLLM shares the
    target's) and reads back into the same drafter; on its weights, vLLM's layers as read from its source (`vllm_layer`)
    compute the drafter's block outputs."""
    checkpoint, result, folder = exported(target, tmp_path, capsys)
    assert result.returncode == 0, result.stderr
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["model_type"] == "gemma4_text"
    assert config["layer_types"] == ["full_attention"] * 2 and config["attention_k_eq_v"] is True
    assert config["head_dim"] == config["global_head_dim"] and config["final_logit_softcapping"] is None
    assert config["dspark_target_layer_ids"] == [0] and config["dspark_noise_token_id"] == 5
    assert config["sample_from_anchor"] is True and config["markov_rank"] == 16 and "dflash_config" not in config
    tensors = load_file(str(folder / "model.safetensors"))
    assert not any(part in name for name in tensors for part in ("embed_tokens", "lm_head", "v_proj"))
    assert tensors["layers.1.layer_scalar"].shape == (1,)
    drafter = read_folder(folder, target)
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert drafter.config.layer_family == "gemma4_text" and drafter.config.target_layers == [0]
    assert all(torch.equal(drafter.state_dict()[name], tensor) for name, tensor in saved.items())

    ids = torch.randint(3, 4096, (1, 12), generator=torch.Generator().manual_seed(0))
    anchor = 9
    with torch.no_grad():
        out = run_target(target, ids, request=drafter.request)
        ours = drafter.blocks(ids, out.layers, torch.tensor([[anchor]]))[0, 0]
        eps, size = config["rms_norm_eps"], config["block_size"]
        context = rms(out.layers[0][0, :anchor] @ tensors["fc.weight"].T, tensors["hidden_norm.weight"], eps)
        table = target.get_input_embeddings().weight
        hidden = table[[int(ids[0, anchor])] + [5] * (size - 1)] * config["hidden_size"] ** 0.5
        positions = torch.arange(anchor, anchor + size)
        for i in range(config["num_hidden_layers"]):
            hidden = vllm_layer(tensors, f"layers.{i}.", config, hidden, context, positions, torch.arange(anchor))
        theirs = rms(hidden, tensors["norm.weight"], eps)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_layers_vllms_layouts_cannot_build_are_refused_in_one_line(target, tmp_path, capsys):
    """vLLM 0.32 builds Gemma-4 draft layers for DSpark only (Gemma4DSparkModel): a DFlash, EAGLE or EAGLE-3 recipe
    with them (whose EAGLE layers crashed on the layer kind their rotary table asks for) is refused by the recipe check
    before anything is written, as a DSpark one that turns their q/k norms off (they always norm); and Gemma-4 layers
    other than the full-attention, values-are-keys, unbiased, uncapped ones vLLM's Gemma-4 DSpark model builds are
    refused."""
    for kind, setting in (("dflash", ""), ("eagle", ""), ("eagle3", ""), ("dspark", "drafter.qk_norm=false")):
        args = ["train.py", f"recipe={kind}", "drafter.layer_family=gemma4_text", f"output_dir={tmp_path / kind}"]
        line = assert_one_line_error(run_entry_in_process([*args, *filter(None, [setting])], capsys), 2)
        assert ("layers always norm" if setting else f"builds a {kind} drafter's layers of that family") in line
        assert not (tmp_path / kind).exists()
    drafter = read_folder(exported(target, tmp_path / "dspark", capsys)[2], target)
    for key, value in (("attention_k_eq_v", False), ("layer_types", ["sliding_attention", "full_attention"])):
        edited = copy.deepcopy(drafter)
        edited.config.decoder["config"][key] = value
        with pytest.raises(UserError, match="vLLM's Gemma4DSparkModel builds full-attention Gemma-4 layers") as err:
            dspark_gemma4.layer_config(edited)
        assert "\n" not in str(err.value)


@pytest.mark.slow  # 2.5-3.4 s
def test_gemma4_layers_train_draft_their_training_block_and_decode_losslessly():
    """On a tiny Gemma-4 target (sliding and full layers, wider full-attention heads, soft-capped logits) a DSpark of
    Gemma-4 layers trains; a teacher-forced block is the decoding block after the same committed tokens (Markov bias
    from the data's tokens); greedy speculative decoding is plain greedy, with drafts accepted and rejected."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    kinds = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config = Gemma4TextConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, layer_types=kinds, sliding_window=8,
        hidden_size_per_layer_input=0, final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = Gemma4ForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.3)
    drafter = fitted_eagle(model, 40, drafter_type="dspark", layer_family="gemma4_text", target_layers=[0, 1, 2],
                           block_size=5, anchors=12, markov_rank=8, mask_token_id=5)  # fmt: skip
    assert drafter.embed_scale == 32**0.5 and drafter.layers[0].self_attn.v_proj is None

    ids = greedy_text(model, rows=1, length=24, seed=3)
    out = run_target(model, ids, request=drafter.request)
    anchors = torch.tensor([[2, 9, 15]])
    with torch.no_grad():
        outputs = drafter.blocks(ids, out.layers, anchors)
        for column, a in enumerate(anchors[0].tolist()):
            previous = ids[0, a : a + 5]
            trained = drafter.block_logits(outputs[0, column], previous)
            state = prefill(model, [ids[0, : a + 1].tolist()], drafter.request).rows[0].draft_state()
            decoded = drafter.block_logits(drafter.proposer().block_outputs(state, 5), previous)
            torch.testing.assert_close(trained, decoded, rtol=1e-4, atol=1e-4)
    rows = torch.randint(3, 32, (3, 17), generator=torch.Generator().manual_seed(1))
    assert_greedy_equals_plain(model, drafter, [row[:n].tolist() for row, n in zip(rows, (5, 11, 17))], None)


@pytest.mark.slow
def test_train_resume_export_and_eval_of_the_folder_through_the_entry_points(
    target, tmp_path, small_data, token_cache, capsys
):
    """`train.py recipe=dspark drafter.layer_family=gemma4_text` on the bundled Gemma-4 target trains and saves; a run
    stopped after its first checkpoint resumes from it and continues (the resumed steps' losses are the first run's,
    not a fresh start's); `python -m export` writes vLLM's Gemma4DSparkModel folder; and `python -m eval` with that
    folder as its checkpoint reads it back through formats/dspark.py and decodes as plain greedy does (drafts accepted
    and rejected)."""
    run = tmp_path / "run"
    args = [
        "recipe=dspark", f"target.name_or_path={TARGET}", *(f"drafter.{key}={value}" for key, value in LAYERS.items()),
        "drafter.anchors=8", "drafter.markov_rank=16", f"data.train=[{small_data['train']}]", "data.eval=[]",
        f"data.cache_dir={token_cache}", "data.max_length=64", "train.max_steps=16", "train.save_every=8",
        "train.lr=3e-3", "train.micro_batch_size=2", "train.warmup_steps=0", "train.log_every=1", "eval.enabled=false",
        f"output_dir={run}",
    ]  # fmt: skip
    trains_then_resumes_alike(args, run, 8, 16, capsys)
    state = json.loads((run / "checkpoints" / "step_0000016" / "trainer_state.json").read_text())
    assert state["step"] == 16 and state["batch_in_epoch"] == 16, state  # the data's position carried on too

    export = ["-m", "export", *args, f"checkpoint={run / 'final'}", f"export.output={tmp_path / 'export'}",
              "export.engines=[vllm]"]  # fmt: skip
    assert run_entry_in_process(export, capsys).returncode == 0
    folder = tmp_path / "export" / "vllm"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["dspark_target_layer_ids"] == [0]
    back = read_folder(folder, target).state_dict()
    assert all(torch.equal(back[name], t) for name, t in load_file(str(run / "final" / "model.safetensors")).items())

    prompt = first_records(small_data["eval"], tmp_path / "eval.jsonl", 2)
    quick = [f"eval.data=[{prompt}]", "eval.max_new_tokens=24", "eval.ngram_baseline=false", "eval.tree=0"]
    # no drafter.* keys: an engine folder is read with the settings its format records (others are refused)
    plain = [arg for arg in args if not arg.startswith("drafter.")]
    evaluated = run_entry_in_process(["-m", "eval", *plain, f"checkpoint={folder}", *quick], capsys)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]  # 3: a row's tokens differ from plain greedy's
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["drafter"]["path"] == str(folder) and report["drafter"]["config"]["layer_family"] == "gemma4_text"
    chain = report["domains"]["all"]["chain"]
    assert chain["lossless"] and chain["prompts"] == 2 and 0 < chain["accepted"] < chain["drafted"], chain


# Run in vLLM's environment: its speculative config for the folder, and its Gemma-4 DSpark model built on the CPU (one
# process group of one rank, eager) with the folder's weights loaded by its own load_weights. Its attention kernels
# need an engine's forward context, so each layer's `attn` is replaced by plain non-causal attention over the context
# keys/values that vLLM's own precompute_and_store_context_kv hands its cache writer, then the block; every other step
# (embedding, q/k/v projections and norms, RoPE, o_proj, norms, MLP, layer_scalar, final norm) is vLLM's module, but
# for the context keys' per-layer k_norm, run layer by layer (tests/vllm_side.py).
VLLM_SCRIPT = """
import json, sys
import torch
from safetensors.torch import load_file, save_file
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.gemma4_dspark import Gemma4DSparkForCausalLM
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
from vllm.v1.worker.gpu.spec_decode.eagle.utils import _should_share
from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id
from vllm_side import block_outputs, engine_config, single_process

folder, target, inputs, port = sys.argv[1:]
config, spec = engine_config(target, {"method": "dspark", "model": folder})  # set directly: CPU engines refuse DSpark
given = load_file(inputs)
with set_current_vllm_config(config):
    single_process(port)
    model = Gemma4DSparkForCausalLM(vllm_config=config)
    tensors = load_file(folder + "/model.safetensors")
    loaded = model.load_weights(tensors.items())
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    taken = {}
    for name, tensor in tensors.items():
        stacked = {".gate_proj.": 0, ".up_proj.": 1}
        part = next((key for key in stacked if key in name), None)
        mine = "model." + (name.replace(part, ".gate_up_proj.") if part else name)
        value = params[mine].data if mine in loaded else None
        if part and value is not None:
            value = value.chunk(2, dim=0)[stacked[part]]
        taken[name] = value is not None and value.shape == tensor.shape and bool(torch.equal(value, tensor))
    shares = [_should_share(model, flag, None, None) for flag in ("has_own_embed_tokens", "has_own_lm_head")]
    process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))  # the CPU GEMMs' layout
    outputs, captured = block_outputs(model, given)
save_file({"outputs": outputs.contiguous()}, inputs + ".vllm")
print(json.dumps({"method": spec.method, "architectures": spec.draft_model_config.architectures,
                  "num_speculative_tokens": spec.num_speculative_tokens, "shares": shares,
                  "soft_cap": model.logits_processor.soft_cap,
                  "aux_layers": list(get_eagle3_aux_layers_from_config(spec)), "captured": captured,
                  "mask": get_parallel_drafting_token_id(spec.draft_model_config.hf_config), "taken": taken}))
"""


@pytest.mark.slow
@pytest.mark.engine
def test_vllms_own_code_takes_the_folder_and_computes_the_drafters_block(target, tmp_path, capsys, vllm_python):
    """vLLM's speculative config resolves the folder to its Gemma-4 DSpark model (the trained block as the default
    num_speculative_tokens, the context layer + 1, the mask token); its load_weights takes every tensor unchanged (gate
    and up stacked); it shares the target's embedding and lm_head; and its modules compute the drafter's block outputs
    for the same context and block."""
    _, result, folder = exported(target, tmp_path, capsys)
    assert result.returncode == 0, result.stderr
    drafter = read_folder(folder, target)
    size, anchor = drafter.config.block_size, 9
    ids = torch.randint(3, 4096, (1, 12), generator=torch.Generator().manual_seed(0))
    said = block_computed_in_vllm(vllm_python, VLLM_SCRIPT, drafter, target, ids, anchor, folder, TARGET, tmp_path)
    assert said["method"] == "dspark" and said["architectures"] == [ARCHITECTURE], said
    assert said["num_speculative_tokens"] == size and said["mask"] == 5 and said["aux_layers"] == [1], said
    assert said["shares"] == [True, True] and said["captured"] == drafter.config.num_layers, said
    assert said["soft_cap"] is None, said  # the lm_head's logits uncapped, as trained
    assert said["taken"] and all(said["taken"].values()), said["taken"]
