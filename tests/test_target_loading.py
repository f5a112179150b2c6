"""Loading the target (draftsmith/target.py): a Hub id out of reach fails at once, in its one line, and a model in
the Hub cache still loads; a local folder that cannot be read is named as such, not as what transformers makes of
it ("No such file or directory", "Should have a `model_type` key")."""

from __future__ import annotations

import builtins
import os
from pathlib import Path

import pytest

from draftsmith.errors import UserError, outcome
from draftsmith.model_files import not_loadable
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target, load_tokenizer, target_section
from draftsmith.target_loading import load_config
from tests.helpers import REPO, assert_one_line_error, counted_hub_probes, run_entry_in_process, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def hub_out_of_reach(tmp_path, monkeypatch):
    """The Hub at an address nothing listens on, with an empty cache and network access allowed (the tests run
    with HF_HUB_OFFLINE=1); counts the probes, and fails any retry's sleep (huggingface_hub's 25 s of them)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    return counted_hub_probes(monkeypatch)


def test_a_hub_out_of_reach_is_asked_once_and_every_load_fails_at_once_in_its_line(hub_out_of_reach, caplog):
    """A Hub id with no network printed 11 lines of huggingface_hub's retries over about 25 s before the line,
    and export and sweep, which load the target twice, twice that. One probe now finds the Hub out of reach, every
    load of the command reads the Hub cache alone, and each ends in the line it ended in (exit 69)."""
    section = target_section("acme/not-cached")
    with caplog.at_level("WARNING"):
        for load in (load_config, load_tokenizer, load_target):
            with pytest.raises(UserError) as err:
                load(section)
            code, line = outcome(err.value)
            assert code == 69 and line.startswith("Hub unavailable: cannot load ")
            assert "We couldn't connect to 'http://127.0.0.1:9'" in line
            assert line.endswith("or set HF_HUB_OFFLINE=1 to read the Hub cache only)")
    assert len(hub_out_of_reach) == 1  # the answer is remembered for the loads that follow
    assert "Retrying" not in caplog.text and "thrown while requesting" not in caplog.text


def test_a_target_in_the_hub_cache_loads_while_the_hub_is_out_of_reach(hub_out_of_reach, tmp_path):
    """huggingface_hub falls back to its cache after its retries; the cache alone is read at once instead."""
    import huggingface_hub.constants as constants

    commit = "0" * 40
    repo = Path(constants.HF_HUB_CACHE) / "models--acme--tiny"
    tiny_llama(vocab=40).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model = load_target("acme/tiny")
    assert model.config.vocab_size == 40 and not model.training
    assert len(hub_out_of_reach) == 1


@pytest.fixture
def saved_target(tmp_path) -> Path:
    folder = tmp_path / "target"
    tiny_llama(vocab=40).save_pretrained(folder)
    return folder


def denied_to_open(monkeypatch, path: Path) -> None:
    """open(path) raises PermissionError, as for a file of another user's with mode 600."""
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if os.fspath(file) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)


def test_targets_load_with_transformers_own_layers_whatever_kernels_package_is_installed(monkeypatch):
    """transformers 5.25 kernelizes a model at load by default, with kernels the `kernels` package fetches from the
    Hub, and refuses to load at all where that package is missing or of another version (every CUDA test of the
    GPU tier on 2026-12-04, an image without it). draftsmith loads transformers' own layers."""
    import transformers.modeling_utils as modeling_utils

    assert not load_target(target_section(str(REPO / "demo" / "target"))).use_kernels
    monkeypatch.setattr(modeling_utils, "is_kernels_available", lambda *args, **kwargs: False)
    assert not load_target(target_section(str(REPO / "demo" / "target"))).use_kernels


def test_a_target_file_that_cannot_be_read_is_named(saved_target, monkeypatch):
    """Unreadable weights said "No such file or directory: .../model.safetensors" (safetensors' line for EACCES);
    an unreadable config.json transformers' own reason. Both say the file cannot be read, exit 2."""
    weights = saved_target / "model.safetensors"
    denied_to_open(monkeypatch, weights)
    import transformers.modeling_utils

    def safetensors_open(file, *args, **kwargs):  # what safetensors raises for a file it may not open
        raise FileNotFoundError(f"No such file or directory: {file}")

    monkeypatch.setattr(transformers.modeling_utils, "safe_open", safetensors_open)
    with pytest.raises(UserError) as err:
        load_target(str(saved_target))
    assert outcome(err.value) == (
        2,
        f"error: cannot load target '{saved_target}': cannot read {weights}: permission denied",
    )
    load_config(target_section(str(saved_target)))  # the config alone is read as before

    config = saved_target / "config.json"
    denied_to_open(monkeypatch, config)
    with pytest.raises(UserError, match=f"cannot read {config}: permission denied$"):
        load_config(target_section(str(saved_target)))


def test_a_target_folder_that_cannot_be_read_is_named_and_another_failure_is_not_blamed_on_it(
    saved_target, monkeypatch
):
    """An unreadable folder said "Unrecognized model in ... Should have a `model_type` key". A failure that does not
    name the unreadable file (a tokenizer missing beside weights that cannot be read) keeps transformers' reason."""
    unrecognized = ValueError(
        f"Unrecognized model in {saved_target}. Should have a `model_type` key in its config.json."
    )
    real_scandir = os.scandir

    def listing(path="."):
        if os.fspath(path) == str(saved_target):
            raise PermissionError(13, "Permission denied", str(saved_target))
        return real_scandir(path)

    with monkeypatch.context() as patched:
        patched.setattr(os, "scandir", listing)
        line = str(not_loadable(f"cannot load target '{saved_target}'", unrecognized, str(saved_target)))
    assert line == f"cannot load target '{saved_target}': cannot read {saved_target}: permission denied"

    denied_to_open(monkeypatch, saved_target / "model.safetensors")
    no_tokenizer = OSError("Couldn't instantiate the backend tokenizer")
    line = str(not_loadable("cannot load the tokenizer", no_tokenizer, str(saved_target)))
    assert line == "cannot load the tokenizer: Couldn't instantiate the backend tokenizer"


def test_a_released_assistant_not_in_the_cache_offline_says_so(monkeypatch, tmp_path):
    """`drafter.released_assistant=org/assistant` with HF_HUB_OFFLINE=1 said "We couldn't connect to
    'https://huggingface.co'", which it never tried."""
    import huggingface_hub.constants as constants
    from transformers import Gemma4TextConfig

    from draftsmith.heads.gemma4_assistant import load_released

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with pytest.raises(UserError) as err:
        load_released("acme/assistant", Gemma4TextConfig(hidden_size=64))
    code, line = outcome(err.value)
    assert code == 2 and line.startswith("error: cannot load drafter.released_assistant='acme/assistant': not in")
    assert "HF_HUB_OFFLINE=1 forbids downloading it: download it once with a network, or give a local folder" in line


def test_a_released_assistant_path_that_is_no_folder_is_one_line_before_anything_loads(tmp_path, capsys):
    """`drafter.released_assistant=/tmp/nonexist` was refused after the data had loaded, in huggingface_hub's words
    about a repo id's form."""
    missing = tmp_path / "nonexist"
    args = [
        "train.py",
        "recipe=gemma4_assistant",
        f"drafter.released_assistant={missing}",
        f"output_dir={tmp_path / 'r'}",
    ]
    result = run_entry_in_process(args, capsys)
    assert_one_line_error(
        result, 2, f"drafter.released_assistant={missing}: no such folder (a Hub id reads owner/name)"
    )
    assert not (tmp_path / "r").exists()


@pytest.fixture
def not_a_causal_lm(tmp_path) -> tuple[Path, str]:
    """A folder holding the config of a vision-language wrapper transformers maps to no causal LM class and whose
    language model it builds no model of alone (the first by name; one whose language model it builds, as GLM-5-Next's,
    loads as that model: tests/test_families.py), and its model type."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    def text_model_built(model_type: str) -> bool:
        text = AutoConfig.for_model(model_type).to_dict().get("text_config")
        return isinstance(text, dict) and text.get("model_type") in MODEL_MAPPING_NAMES

    wrappers = set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    model_type = next(model_type for model_type in sorted(wrappers) if not text_model_built(model_type))
    folder = tmp_path / "wrapper"
    AutoConfig.for_model(model_type).save_pretrained(folder)
    return folder, model_type


def test_a_target_transformers_cannot_load_as_a_causal_lm_is_refused_by_the_recipe_check(
    not_a_causal_lm, tmp_path, capsys
):
    """It was refused once the data was tokenized, in transformers' line listing its ~200 config classes. Now train,
    eval and export refuse it from its config.json, in one short line naming its model type, with nothing written."""
    folder, model_type = not_a_causal_lm
    for command in ("train.py", "-m eval", "-m export"):
        result = run_entry_in_process(
            [*command.split(), "recipe=medusa", f"target.name_or_path={folder}", f"output_dir={tmp_path / 'run'}",
             f"data.cache_dir={tmp_path / 'cache'}", f"export.output={tmp_path / 'export'}"],
            capsys,
        )  # fmt: skip
        line = assert_one_line_error(result, 2, "no causal LM class (AutoModelForCausalLM, what draftsmith loads")
        assert f"model_type {model_type!r}: give a causal LM" in line, line
        assert len(line.replace(str(folder), "")) < 200, line  # the classes are not listed (the folder's path aside)
        assert not any((tmp_path / name).exists() for name in ("run", "cache", "export")), command


def test_a_hub_target_transformers_cannot_load_as_a_causal_lm_is_refused_in_a_short_line(
    not_a_causal_lm, tmp_path, monkeypatch
):
    """A Hub id's config.json is read when the target loads: the line there is the recipe check's, not
    transformers' list of the config classes it has a causal LM for."""
    import huggingface_hub.constants as constants

    folder, model_type = not_a_causal_lm
    commit = "0" * 40
    repo = tmp_path / "hub-cache" / "models--acme--wrapper"
    (repo / "snapshots").mkdir(parents=True)
    folder.rename(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(repo.parent))
    with pytest.raises(UserError) as err:
        load_target("acme/wrapper")
    code, line = outcome(err.value)
    assert code == 2 and line.startswith("error: cannot load target 'acme/wrapper': transformers "), line
    assert line.endswith(f"model_type {model_type!r}: give a causal LM") and "Config," not in line, line


def test_a_mistyped_local_target_path_read_as_a_hub_id_names_the_folder_it_meant(monkeypatch, tmp_path):
    """`target.name_or_path=models/reference-targt` (a local folder mistyped) reads as the Hub id owner/name: offline
    it was "not in the Hub cache", online "Hub unavailable" (exit 69, retry later), neither naming the folder. The line
    now says the first part is a folder here and names its closest folder; a path of two slashes or more, which no Hub
    id has, is refused as no such folder before anything loads."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "reference-target").mkdir(parents=True)
    line = refused_line(lambda: load_config(target_section("models/reference-targt")))
    assert "cannot load target 'models/reference-targt' (read as a Hub id: the folder models here has no " in line
    assert "did you mean models/reference-target?): not in the Hub cache" in line
    line = refused_line(lambda: load_config(target_section("acme/model")))  # no folder acme here: a Hub id as given
    assert line.startswith("cannot load target 'acme/model': not in the Hub cache")
    with pytest.raises(UserError, match="models/x/reference-target: no such folder"):
        load_recipe(["recipe=medusa", "target.name_or_path=models/x/reference-target"])


def test_a_mistyped_local_target_path_is_bad_input_while_the_hub_is_out_of_reach(
    hub_out_of_reach, tmp_path, monkeypatch
):
    """Online with the Hub out of reach, `demo/gemma4-targt` (a local folder mistyped beside `demo/gemma4-target`)
    exited 69, "run the same command again when the Hub can be reached", which a scheduler does forever."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "reference-target").mkdir(parents=True)
    with pytest.raises(UserError) as err:
        load_config(target_section("models/reference-targt"))
    code, line = outcome(err.value)
    assert code == 2 and "did you mean models/reference-target?)" in line, line
    with pytest.raises(UserError) as err:  # no folder close to it: the Hub id it may be, out of reach
        load_config(target_section("models/qwen"))
    assert outcome(err.value)[0] == 69


def refused_line(load) -> str:
    with pytest.raises(UserError) as err:
        load()
    return str(err.value)


def test_offline_a_revision_or_weights_the_cache_lacks_are_said_as_such(monkeypatch, tmp_path):
    """Offline, a revision the cache does not hold of a cached repository said only "not in the Hub cache", as if the
    repository were not there; a repository cached without its weights was called a pickle (pytorch_model.bin) that
    was not there either, and one without its tokenizer files blamed missing packages (a newcomer's offline journey,
    2026-12-07)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    commit = "a" * 40
    for name, weights in (("tiny", True), ("no-weights", False)):
        repo = tmp_path / "hub-cache" / f"models--acme--{name}"
        tiny_llama(vocab=40).save_pretrained(repo / "snapshots" / commit)
        for path in (repo / "snapshots" / commit).glob("*.safetensors"):
            if not weights:
                path.unlink()
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    section = load_recipe(["recipe=medusa", "target.name_or_path=acme/tiny", "target.revision=v2.0"]).target
    line = refused_line(lambda: load_target(section))
    cache = tmp_path / "hub-cache"
    assert f"revision v2.0 is not in the Hub cache ({cache}), which holds main -> {commit} of it" in line
    assert line.endswith("give one of those as target.revision, or download it once with a network"), line
    line = refused_line(lambda: load_target("acme/no-weights"))
    assert "holds no weights of it (model.safetensors or model.safetensors.index.json): download them once" in line
    assert "pickle" not in line
    # no tokenizer files cached either: transformers' line was to install sentencepiece or tiktoken, cut mid-sentence
    line = refused_line(lambda: load_tokenizer("acme/no-weights"))
    assert line == (
        f"cannot load the tokenizer of 'acme/no-weights': the Hub cache's copy of it ({tmp_path / 'hub-cache'}/"
        f"models--acme--no-weights/snapshots/{commit}) holds no tokenizer.json or tokenizer_config.json: download them "
        "once with a network, or give a local folder"
    )


def test_the_export_checks_engine_reads_a_hub_targets_snapshot_at_its_revision(monkeypatch, tmp_path):
    """The export's vLLM check refused every Hub id ("needs the target as a local directory"), a cached one too: its
    engine now reads the snapshot folder of the commit draftsmith read (the files the target's load fetched), and the
    card names the id at that commit (tests/test_hub_revision.py)."""
    import huggingface_hub.constants as constants

    from draftsmith.export.verify import served_target

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    repo = tmp_path / "hub-cache" / "models--acme--tiny"
    for commit in ("a" * 40, "b" * 40):
        tiny_llama(vocab=40).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    pinned = load_recipe(["recipe=medusa", "target.name_or_path=acme/tiny", f"target.revision={'a' * 40}"])
    assert served_target(pinned) == str(repo / "snapshots" / ("a" * 40))
    assert served_target(load_recipe(["recipe=medusa", "target.name_or_path=acme/tiny"])) == str(
        repo / "snapshots" / ("b" * 40)
    )
    line = refused_line(lambda: served_target(load_recipe(["recipe=medusa", "target.name_or_path=acme/other"])))
    assert line == "the engine check reads the target's files, and the Hub cache holds none of 'acme/other'"


def cached_without_weights(cache: Path, name: str) -> None:
    """A tiny Llama as acme/`name` in the Hub cache `cache`, main at one commit, its safetensors weights left out."""
    repo = cache / f"models--acme--{name}"
    tiny_llama(vocab=40).save_pretrained(repo / "snapshots" / ("a" * 40))
    for path in (repo / "snapshots" / ("a" * 40)).glob("*.safetensors"):
        path.unlink()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)


def test_weights_the_cache_lacks_while_the_hub_is_out_of_reach_are_the_hub_out_of_reach(hub_out_of_reach):
    """The Hub out of reach and its cache holding a repository's config without its weights exited 2 (bad input: the
    cache "holds no weights"), though the same command run when the Hub answers downloads them: 69, retry later (a
    newcomer's offline journey, 2026-12-07)."""
    import huggingface_hub.constants as constants

    cached_without_weights(Path(constants.HF_HUB_CACHE), "no-weights")
    with pytest.raises(Exception) as err:
        load_target("acme/no-weights")
    code, line = outcome(err.value)
    assert code == 69, line
    assert line.startswith("Hub unavailable: cannot load target 'acme/no-weights': the Hub cache ("), line
    assert "holds no weights of it (model.safetensors or model.safetensors.index.json), and the Hub " in line, line
    assert "(http://127.0.0.1:9) cannot be reached to download them ([Errno 111] Connection refused): run" in line, line
    assert line.endswith("run the same command again when the Hub can be reached, or give a local folder"), line


def test_offline_a_hub_id_close_to_a_cached_one_is_named(monkeypatch, tmp_path):
    """Offline, a mistyped Hub id (`acme/tiny-lama`) said "not in the Hub cache" while the cache held acme/tiny-llama;
    the line now names the cached id closest to it."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    cached_without_weights(tmp_path / "hub-cache", "tiny-llama")
    line = refused_line(lambda: load_config(target_section("acme/tiny-lama")))
    assert line.startswith("cannot load target 'acme/tiny-lama': not in the Hub cache"), line
    assert "(did you mean acme/tiny-llama?, which the cache holds)" in line, line
    line = refused_line(lambda: load_config(target_section("other/model")))  # nothing close: no guess
    assert "did you mean" not in line, line
