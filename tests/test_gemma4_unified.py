"""Gemma-4 Unified (transformers' `gemma4_unified`, its language model `gemma4_unified_text`: Gemma-4's layers without
per-layer inputs or experts) as a target, and its assistant (`gemma4_unified_assistant`, Gemma-4's assistant module
over the unified language model's layers). A release folder (the wrapper whole, a tiny vision embedder beside its
language model) loads as the wrapper with its own logits and taps; `drafter.type=gemma4_assistant` on it builds the
unified assistant, reads the target's keys and values exactly, drafts what transformers' unified assistant module
drafts, trains, decodes losslessly alone and in a batch, and exports the unified assistant's own folder, which vLLM
0.32's own config code reads as the assistant it serves (its gemma4_mtp model; slow tier). Its export for the language
model alone tells vLLM to run that target as its own Gemma-4 class (else its assistant's embedding is scaled twice).
The family's per-family tests (taps, masks, caches, trees, EAGLE-3) are tests/test_families.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate, generate_batch
from draftsmith.formats.repo import EXPORT_INFO
from draftsmith.heads import drafter_class
from draftsmith.heads.gemma4_assistant import FULL, SLIDING
from draftsmith.heads.proposer import DraftState
from draftsmith.random_target import build_model, demo_tokenizer_dir
from draftsmith.target import FeatureRequest, TargetShape, config_json, load_target, loaded_config, run_target
from draftsmith.tiny_config import build_config
from tests.helpers import (
    assert_tree_forward_equals_path_forwards,
    run_entry_in_process,
    saved_release,
    transformers_greedy,
    vllm_script,
)
from tests.test_gemma4_assistant import reference_chain, sharpened  # the same fresh assistant, its reference

pytestmark = pytest.mark.usefixtures("one_thread")

KIND = drafter_class("gemma4_assistant")
WINDOW = 16  # the tiny target's sliding window: the prompts below cross it
KINDS = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]  # the last two layers KV-shared: the stores are 3 and 2
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "num_hidden_layers": len(KINDS)}
# the wrapper's encoder-free vision embedder at a tiny size (its released 3840-wide projection would dwarf the model)
VISION = {"patch_size": 4, "pooling_kernel_size": 2, "mm_embed_dim": 32, "mm_posemb_size": 16}


def language_model_config():
    """The tiny language model's config (`gemma4_unified_text`), the demo tokenizer's vocabulary."""
    demo = json.loads((demo_tokenizer_dir() / "config.json").read_text())
    special = {key: demo[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return build_config("gemma4_unified_text", demo["vocab_size"], special, sliding_window=WINDOW, **SHAPE,
                        layer_types=KINDS, num_kv_shared_layers=2)  # fmt: skip


def write_release(directory: Path, std: float = 0.1) -> Path:
    """A tiny release folder as Gemma-4 Unified ships (config.json naming Gemma4UnifiedForConditionalGeneration, the
    language model under `model.language_model.*`, the vision embedder beside it), random weights, the demo's
    tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    text = language_model_config()
    vision = {**VISION, "output_proj_dims": text.hidden_size}
    config = AutoConfig.for_model("gemma4_unified", text_config=text.to_dict(), vision_config=vision)
    torch.manual_seed(0)
    release = AutoModelForCausalLM.from_config(config)
    return saved_release(release, directory, std)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = write_release(tmp_path_factory.mktemp("gemma4_unified") / "release")
    return load_target(str(folder)), str(folder)


def random_prompt(length: int, seed: int) -> list[int]:
    return [1, *torch.randint(3, 4000, (length - 1,), generator=torch.Generator().manual_seed(seed)).tolist()]


@pytest.mark.slow
def test_a_release_folder_loads_as_the_wrapper_with_its_logits_taps_and_greedy_tokens(target):
    """transformers loads the wrapper itself as a causal LM: the target is it (its config naming its architecture,
    what vLLM 0.32 registers), its shape the language model's; taps are transformers' hidden states, the loop's
    plain decoding far past the window is transformers' own greedy generate, a batch decodes as each prompt alone,
    and a tree's one-forward verification past the window equals the forwards of each of its paths."""
    model, name = target
    assert loaded_config(model)["architectures"] == ["Gemma4UnifiedForConditionalGeneration"]
    assert TargetShape.of(model, name).model_type == "gemma4_unified_text"
    ids = torch.tensor([random_prompt(40, 0)])
    out = run_target(model, ids, request=FeatureRequest(layers=(-1, 0, 3)))
    reference = model(ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, reference.logits)
    for layer in (-1, 0, 3):
        torch.testing.assert_close(out.layers[layer], reference.hidden_states[layer + 1])
    prompt = random_prompt(2 * WINDOW, 1)
    theirs = transformers_greedy(model, prompt, 2 * WINDOW)
    assert generate(model, prompt, 2 * WINDOW).tokens == theirs
    assert len(set(theirs)) > 4  # not one repeated token: drafts below are checked against varied text
    prompts = [random_prompt(length, seed) for seed, length in enumerate((5, 2 * WINDOW, WINDOW + 3))]
    together = [result.tokens for result in generate_batch(model, prompts, WINDOW)]
    assert together == [generate(model, prompt, WINDOW).tokens for prompt in prompts]
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 2, 4, -1])
    assert_tree_forward_equals_path_forwards(model, prompt, torch.tensor(random_prompt(len(parents), 3)), parents)


def test_the_assistant_is_the_unified_one_reads_the_stored_keys_exactly_and_drafts_as_its_module(target):
    """The assistant built for a unified target is transformers' Gemma4UnifiedAssistantForCausalLM; it recomputes the
    keys and values of the layers the target stores (the last of each kind before the KV-shared ones) exactly, and its
    chains, as the sequence grows past the window, are the module's over the whole committed sequence."""
    from transformers import Gemma4UnifiedAssistantForCausalLM

    model, _ = target
    drafter = sharpened(target)
    assert type(drafter.assistant) is Gemma4UnifiedAssistantForCausalLM
    assert drafter.assistant.config.text_config.model_type == "gemma4_unified_text"
    assert drafter.stores == {SLIDING: 3, FULL: 2}
    ids = torch.tensor([random_prompt(50, 2)])
    stored = model.get_decoder()(input_ids=ids, return_shared_kv_states=True).shared_kv_states
    recomputed = drafter.shared_keys_values(run_target(model, ids, request=drafter.request).layers,
                                            torch.arange(ids.shape[1])[None])  # fmt: skip
    for kind, (keys, values) in stored.items():
        assert torch.equal(recomputed[kind][0], keys) and torch.equal(recomputed[kind][1], values), kind
    reference = Gemma4UnifiedAssistantForCausalLM(drafter.assistant.config).eval()
    table = drafter.assistant.lm_head.weight
    reference.load_state_dict({**drafter.assistant.state_dict(), "model.embed_tokens.weight": table})
    sequence = random_prompt(50, 3)
    proposer, previous, chains = drafter.proposer(), None, set()
    with torch.no_grad():
        states = run_target(model, torch.tensor([sequence]), request=drafter.request)
        for length in (9, 10, 13, 30, 31, 34):  # tokens committed: the last is the target's own
            start = 0 if previous is None else previous - 1
            state = DraftState(
                tokens=torch.tensor(sequence[:length]), final=states.final[0, length - 2], layers={},
                new_final=states.final[0, start : length - 1],
                new_layers={layer: h[0, start : length - 1] for layer, h in states.layers.items()},
                fresh=previous is None,
            )  # fmt: skip
            proposed = proposer.propose(state, 3).tokens.tolist()
            assert proposed == reference_chain(model, reference, sequence[:length], 3, WINDOW), length
            chains.add(tuple(proposed))
            previous = length
    assert len(chains) > 2


def test_the_unified_assistant_computes_what_gemma4s_computes_with_the_same_weights(target):
    """The two assistant modules differ in their text model's class only (the unified one's decoder layers are
    Gemma-2's sandwich with Gemma-4's attention and layer scalar; Gemma-4's, with no per-layer inputs or experts, are
    the same): on the same weights, tensor names and inputs they give the same logits and projected states, so the
    kind's one computation (and vLLM's one gemma4_mtp model) serves both."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    model, _ = target
    drafter = sharpened(target)
    unified = drafter.assistant
    values = unified.config.to_dict()
    text = {key: value for key, value in values["text_config"].items() if key != "model_type"}
    text |= {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False}
    width = values["backbone_hidden_size"]
    gemma4 = Gemma4AssistantForCausalLM(
        Gemma4AssistantConfig(text_config=Gemma4TextConfig(**text), backbone_hidden_size=width)
    ).eval()
    weights = {**unified.state_dict(), "model.embed_tokens.weight": unified.lm_head.weight}
    assert weights.keys() == gemma4.state_dict().keys()
    gemma4.load_state_dict(weights, strict=True)
    ids = torch.tensor([random_prompt(20, 8)])  # the target's keys and values, a query at its last position
    shared = drafter.shared_keys_values(run_target(model, ids, request=drafter.request).layers, torch.arange(20)[None])
    inputs = torch.randn(1, 1, 2 * width, generator=torch.Generator().manual_seed(8))
    places = torch.tensor([[19]])  # one query, as a draft step has (Gemma-4's module fails on more: transformers 5.24)
    with torch.no_grad():
        ours = unified(inputs_embeds=inputs, shared_kv_states=shared, position_ids=places)
        theirs = gemma4(inputs_embeds=inputs, shared_kv_states=shared, position_ids=places)
    torch.testing.assert_close(ours.logits, theirs.logits)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state)
    assert ours.logits.std() > 0.1  # decisive logits, not a degenerate output


@pytest.mark.slow
def test_one_step_trains_it_and_it_decodes_losslessly_alone_and_in_a_batch(target):
    model, _ = target
    drafter = sharpened(target).train()
    ids = torch.tensor([random_prompt(40, 4), random_prompt(40, 5)])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    before = [p.detach().clone() for p in drafter.parameters()]
    loss_sum, count, _ = drafter.loss(batch, run_target(model, ids, request=drafter.request))
    (loss_sum / count).backward()
    torch.optim.SGD(drafter.parameters(), lr=1e-2).step()
    assert all(not torch.equal(p, b) for p, b in zip(drafter.parameters(), before))
    drafter.eval()
    prompts = [random_prompt(WINDOW + 5, 6), [1, 15, 200, 33, 7]]
    plain = [generate(model, prompt, 2 * WINDOW).tokens for prompt in prompts]
    assert [generate(model, p, 2 * WINDOW, drafter=drafter.proposer(), gamma=3).tokens for p in prompts] == plain
    batched = generate_batch(model, prompts, 2 * WINDOW, drafters=[drafter.proposer(), drafter.proposer()], gamma=3)
    assert [row.tokens for row in batched] == plain


def test_the_language_model_alone_is_served_as_vllms_own_gemma4_class(tmp_path, capsys):
    """vLLM 0.32 registers no class for the language model alone (`Gemma4UnifiedForCausalLM`) and would run it on its
    Transformers backend, whose embedding scales itself, while its gemma4_mtp scales that embedding again: lossless,
    but drafting from other inputs than trained (benchmarks/vllm_gemma4_unified_assistant.py: the matrix row's 327
    proposals are draftsmith's with the embedding scaled twice, 18 of them as trained; run as vLLM's own Gemma-4 class,
    every one is draftsmith's). So the export's folder tells vLLM to run the target as its Gemma-4 class: the serving
    command's `--hf-overrides`, recorded in draftsmith_export.json, which the export's check passes to vLLM too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    alone = saved_release(AutoModelForCausalLM.from_config(language_model_config()), tmp_path / "alone", 0.1)
    sharpened((load_target(str(alone)), str(alone))).save_pretrained(tmp_path / "ckpt")
    export = ["-m", "export", "recipe=gemma4_assistant", f"target.name_or_path={alone}", "export.engines=[vllm]",
              f"checkpoint={tmp_path / 'ckpt'}", f"export.output={tmp_path / 'export'}",
              f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert run_entry_in_process(export, capsys).returncode == 0
    info = json.loads((tmp_path / "export" / "vllm" / EXPORT_INFO).read_text())
    assert info["target_overrides"] == {"architectures": ["Gemma4ForCausalLM"]}
    card = (tmp_path / "export" / "vllm" / "README.md").read_text()
    assert """--hf-overrides '{"architectures": ["Gemma4ForCausalLM"]}' --speculative-config""" in card


def exported(target, tmp_path: Path, capsys) -> Path:
    """A sharpened assistant's checkpoint exported by `python -m export` for vLLM: the folder."""
    _, name = target
    sharpened(target).save_pretrained(tmp_path / "ckpt")
    export = [
        "-m", "export", "recipe=gemma4_assistant", f"target.name_or_path={name}", f"checkpoint={tmp_path / 'ckpt'}",
        f"export.output={tmp_path / 'export'}", f"output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    done = run_entry_in_process(export, capsys)
    assert done.returncode == 0, done.stderr
    return tmp_path / "export" / "vllm"


@pytest.mark.slow
def test_the_export_is_the_unified_assistants_own_folder_and_starts_a_run_as_a_released_one(target, tmp_path, capsys):
    """`python -m export` writes the unified assistant's folder (model_type gemma4_unified_assistant, its
    architecture, transformers' tensor names), which transformers loads as that class with the drafter's weights; as
    `drafter.released_assistant` it starts a drafter that drafts as the exported one. Given for a Gemma-4 target, whose
    assistant is the other class, it is refused in one line."""
    from transformers import AutoModelForCausalLM, Gemma4UnifiedAssistantForCausalLM

    model, name = target
    folder = exported(target, tmp_path, capsys)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma4_unified_assistant"
    assert config["architectures"] == ["Gemma4UnifiedAssistantForCausalLM"]
    assert config["text_config"]["model_type"] == "gemma4_unified_text"
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(loaded) is Gemma4UnifiedAssistantForCausalLM
    drafter = sharpened(target)
    ours = {**drafter.assistant.state_dict(), "model.embed_tokens.weight": drafter.assistant.lm_head.weight}
    assert all(torch.equal(tensor, ours[key]) for key, tensor in loaded.state_dict().items())
    started = KIND.from_target(KIND.Config(released_assistant=str(folder)), model, name).eval()
    prompt = random_prompt(WINDOW + 5, 7)
    assert (
        generate(model, prompt, WINDOW, drafter=started.proposer(), gamma=3).counts.accepted
        == generate(model, prompt, WINDOW, drafter=drafter.proposer(), gamma=3).counts.accepted
    )
    gemma4 = build_config("gemma4_text", model.config.text_config.vocab_size, hidden_size=64, intermediate_size=128,
                          head_dim=16, num_hidden_layers=2, layer_types=[SLIDING, FULL])  # fmt: skip
    with pytest.raises(UserError, match=r"is a gemma4_unified_assistant model, not the assistant of a gemma4_text "):
        KIND.from_target(KIND.Config(released_assistant=str(folder)), build_model(gemma4), "")


# Run in vLLM 0.32's environment (its own transformers): the assistant folder's config as vLLM reads it and as its
# speculative config rewrites a draft model's config (SpeculativeConfig.hf_config_override); then, on a CPU without an
# engine (one process group of one rank), the model vLLM resolves for `method: mtp` with the folder, built from it,
# and its own load_weights on the folder's tensors: which of them it holds unchanged (gate and up stacked).
VLLM_SCRIPT = """
import json, sys
import torch
from safetensors.torch import load_file
from vllm.config import set_current_vllm_config
from vllm.config.speculative import SpeculativeConfig
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.registry import ModelRegistry
from vllm.transformers_utils.config import get_config

folder, target, port = sys.argv[1:]
config = get_config(folder, trust_remote_code=False)
read = {"model_type": config.model_type, "text_type": config.text_config.model_type}
config = SpeculativeConfig.hf_config_override(config)
text = getattr(config, "text_config", config)
said = {**read, "served_as": config.model_type, "architectures": config.architectures, "n_predict": config.n_predict,
        "kv_shared": text.num_kv_shared_layers, "layers": text.num_hidden_layers,
        "backbone": config.backbone_hidden_size}
engine = EngineArgs(model=target, dtype="float32", max_model_len=256, enforce_eager=True,
                    speculative_config={"method": "mtp", "model": folder, "num_speculative_tokens": 2})
engine = engine.create_engine_config()
draft = engine.speculative_config.draft_model_config
with set_current_vllm_config(engine):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    initialize_model_parallel(1, 1)
    model_class, architecture = ModelRegistry.resolve_model_cls(draft.architectures, draft)
    model = model_class(vllm_config=engine)
    tensors = load_file(folder + "/model.safetensors")
    loaded = model.load_weights(tensors.items())
held = dict(model.named_parameters()) | dict(model.named_buffers())
taken = {}
for name, tensor in tensors.items():
    stacked = {".gate_proj.": 0, ".up_proj.": 1}
    part = next((key for key in stacked if key in name), None)
    mine = name.replace(part, ".gate_up_proj.") if part else name
    mine = mine if mine.startswith("model.") else "model." + mine
    value = held[mine].data if mine in held else None
    if part and value is not None:
        value = value.chunk(2, dim=0)[stacked[part]]
    taken[name] = value is not None and value.shape == tensor.shape and bool(torch.equal(value, tensor))
print(json.dumps({**said, "method": engine.speculative_config.method, "built": architecture,
                  "class": model_class.__name__, "taken": taken}))
"""


@pytest.mark.slow
@pytest.mark.engine
def test_vllms_own_code_reads_the_export_as_the_assistant_it_serves_and_loads_every_tensor(
    target, tmp_path, capsys, vllm_python
):
    """vLLM 0.32's config reader reads the folder as the unified assistant; its speculative config maps it to its
    Gemma-4 MTP model (Gemma4MTPModel, one draft token per forward, its layers' KV sharing left to the proposer) at the
    exported layer count and target width; vLLM builds that model from the folder and its load_weights takes every
    tensor unchanged. The engine config's target is a Gemma-4 one of the same width: vLLM 0.32's
    Gemma4UnifiedForConditionalGeneration imports torchvision, which its CPU environment lacks (and it registers no
    text-only unified class); the draft model is built from the folder's config alone."""
    from draftsmith.random_target import write_random_target

    model, _ = target
    folder = exported(target, tmp_path, capsys)
    width = model.config.text_config.hidden_size
    stand_in = write_random_target("gemma4_text", tmp_path / "gemma4", hidden_size=width, intermediate_size=128,
                                   head_dim=16, num_hidden_layers=2)  # fmt: skip
    script = tmp_path / "vllm_gemma4_unified.py"
    script.write_text(VLLM_SCRIPT)
    port = str(29000 + int(tmp_path.stat().st_ino) % 900)
    done = vllm_script(vllm_python, [str(script), str(folder), str(stand_in), port], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    taken = said.pop("taken")
    assert said == {
        "model_type": "gemma4_unified_assistant", "text_type": "gemma4_unified_text", "served_as": "gemma4_mtp",
        "architectures": ["Gemma4MTPModel"], "n_predict": 1, "kv_shared": 0, "layers": 2, "backbone": width,
        "method": "mtp", "built": "Gemma4MTPModel", "class": "Gemma4MTP",
    }, said  # fmt: skip
    assert taken and all(taken.values()), taken


@pytest.mark.slow
def test_train_eval_and_export_through_the_entry_points(target, tmp_path, small_data, token_cache, capsys):
    """`train.py recipe=gemma4_assistant` on the release folder trains the unified assistant, its eval decodes the
    target's own tokens (chains), and `python -m export` of its final checkpoint writes the unified assistant's
    folder."""
    from tests.helpers import train_in_process

    _, name = target
    final, _ = train_in_process([
        "recipe=gemma4_assistant", f"target.name_or_path={name}", f"data.train=[{small_data['train']}]",
        f"data.eval=[{small_data['eval']}]", f"data.cache_dir={token_cache}", "data.max_length=64",
        "data.max_conversations=8", "train.micro_batch_size=4", "train.max_steps=2", "train.save_every=0",
        "eval.enabled=true", "eval.max_prompts=2", "eval.max_new_tokens=24", "eval.tree=0", f"output_dir={tmp_path}",
    ])  # fmt: skip
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    chains = [rows["chain"] for rows in report["domains"].values()]
    assert chains and all(row["lossless"] is True and row["drafted"] > 0 for row in chains), chains
    export = ["-m", "export", "recipe=gemma4_assistant", f"target.name_or_path={name}", f"checkpoint={final}",
              f"export.output={tmp_path / 'export'}", f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert run_entry_in_process(export, capsys).returncode == 0
    config = json.loads((tmp_path / "export" / "vllm" / "config.json").read_text())
    assert config["model_type"] == "gemma4_unified_assistant", config


def test_the_assistants_folder_is_served_by_sglang_as_nextn_and_refused_where_sglang_would_draft_otherwise(
    target, tmp_path
):
    """SGLang 0.5.23 serves the released assistant's folder (its speculative_hook turns NEXTN into FROZEN_KV_MTP for
    an assistant draft; models/gemma4_mtp.py computes vLLM's function, read, not run): the SGLang folder is the vLLM
    one, served as NEXTN at topk 1. Refused in one line: suppressed tokens (SGLang never reads the generation config),
    a target whose last two layers are not each kind the assistant reads (SGLang wires its layers to those two only),
    a Unified language model alone (SGLang has no model for it) and a language model whose config.json declares
    per-layer head shapes (SGLang's transformers cannot read it). The tie is written where SGLang reads it too."""
    from dataclasses import replace

    from draftsmith.formats import Source, exporter_for
    from draftsmith.formats.repo import TargetInfo, check_tensors
    from draftsmith.heads.mtp import text_fields

    model, name = target
    drafter = sharpened(target)
    info = TargetInfo(TargetShape.of(model, name), loaded_config(model), name, config_json(model))
    source, exporter = Source(drafter, tmp_path, model, info), exporter_for("gemma4_assistant")
    sglang, vllm = (exporter.build(engine, source, 3, tmp_path / engine) for engine in ("sglang", "vllm"))
    check_tensors(sglang, "export")
    tied = {**vllm.config["text_config"], "tie_word_embeddings": True}  # where SGLang reads the tie
    assert vllm.config["tie_word_embeddings"] and sglang.config == {**vllm.config, "text_config": tied}
    assert sglang.tensors.keys() == vllm.tensors.keys()
    assert all(torch.equal(tensor, vllm.tensors[key]) for key, tensor in sglang.tensors.items())
    assert "--speculative-algorithm NEXTN" in sglang.serve and "--speculative-eagle-topk 1" in sglang.serve
    own = sglang.config["text_config"]["max_position_embeddings"]
    assert own >= text_fields(info.config)["max_position_embeddings"] and "--context-length" not in sglang.serve
    longer = json.loads(json.dumps(info.config))
    text_fields(longer)["max_position_embeddings"] = own + 1  # SGLang would refuse to start the assistant beside it
    capped = exporter.build("sglang", replace(source, target=replace(info, config=longer)), 3, tmp_path / "capped")
    assert capped.serve.endswith(f" --context-length {own}") and "SGLANG_ALLOW" in capped.conventions["context"]
    config = json.loads(json.dumps(info.config))
    text_fields(config)["layer_types"] = [*KINDS[:-2], SLIDING, SLIDING]
    both_sliding = replace(info, config=config)
    with pytest.raises(UserError, match=r"wires each assistant layer to the target's last two layers only, and they "
                       r"are sliding_attention, sliding_attention"):  # fmt: skip
        exporter.refuse("sglang", drafter, both_sliding, "speculators")
    alone = {"architectures": ["Gemma4UnifiedForCausalLM"], "model_type": "gemma4_unified_text"}
    with pytest.raises(UserError, match=r"SGLang 0.5.23 has no Gemma-4 model for a Gemma4UnifiedForCausalLM target"):
        exporter.refuse("sglang", drafter, replace(info, config_json=alone), "speculators")
    per_layer = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "global_head_dim": 32}
    with pytest.raises(UserError, match=r"reads Gemma-4's per-layer head shapes from a wrapper's config only; this "
                       r"Gemma4ForCausalLM target's language-model config.json declares them per layer"):  # fmt: skip
        exporter.refuse("sglang", drafter, replace(info, config_json=per_layer), "speculators")
    drafter.suppressed = [7]
    with pytest.raises(UserError, match=r"never drafts tokens \[7\] \(its generation_config.json's suppress_tokens, "
                       r"as vLLM reads it\), which SGLang does not read: export it for vllm"):  # fmt: skip
        exporter.refuse("sglang", drafter, info, "speculators")
