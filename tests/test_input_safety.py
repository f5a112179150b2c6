"""Files a user hands draftsmith that are not what they claim: a target's weights as a pickle (never unpickled), cut
short or with a bad header, its config.json a list, its tokenizer files missing or cut short, custom code asked for
without trust; links that lead nowhere (a loop, a missing path) as an output directory, a target or a data file; a
checkpoint's pickle that holds more than tensors, or random states that do not load. Each is one line naming the
file or the key, exit 2, and none says to unpickle a file unsafely."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith.data_prep.local_files import files_matching, files_under
from draftsmith.errors import UserError, outcome
from draftsmith.outputs import check_output_dir
from draftsmith.target import load_target, load_tokenizer, target_section
from draftsmith.target_loading import load_config
from draftsmith.trainer.checkpoint import load_checkpoint
from tests.helpers import REFERENCE_TARGET, assert_one_line_error, run_entry_in_process, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


class Marker:
    """An object no safe unpickler allows (a payload's stand-in: unpickling it would run its class's code)."""


def refused(load, *args) -> str:
    """The line `load(*args)` is refused with (exit 2), checked for torch's advice to unpickle unsafely."""
    with pytest.raises(UserError) as err:
        load(*args)
    code, line = outcome(err.value)
    assert code == 2 and "weights_only" not in line and "\n" not in line, line
    return line


@pytest.fixture
def target(tmp_path) -> Path:
    """The reference target's tokenizer and config beside a tiny model's weights (fast to load)."""
    folder = tmp_path / "target"
    shutil.copytree(REFERENCE_TARGET, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    model = tiny_llama(vocab=config["vocab_size"])
    model.save_pretrained(folder)
    return folder


def test_pickled_target_weights_are_refused_without_being_unpickled(target):
    """A pytorch_model.bin target was unpickled (transformers' weights_only unpickler); one holding a payload was
    exit 70 with torch's advice to rerun with weights_only=False, which would run it."""
    (target / "model.safetensors").unlink()
    torch.save({"payload": Marker()}, target / "pytorch_model.bin")
    line = refused(load_target, str(target))
    assert f"its weights are a pickle ({target / 'pytorch_model.bin'})" in line
    assert "convert them to safetensors" in line
    # a stray safetensors file beside it (an extra head's) is not the model's weights: it slipped past the check
    (target / "extra_head.safetensors").write_bytes((target / "tokenizer.json").read_bytes()[:64])
    assert f"its weights are a pickle ({target / 'pytorch_model.bin'})" in refused(load_target, str(target))


def test_a_hub_repo_of_pickled_weights_is_refused_as_a_local_folder_of_them_is(target, tmp_path, monkeypatch):
    """A Hub id whose cached repo holds only pytorch_model.bin passed on transformers' line, "... Please do not set
    `use_safetensors=True`": a setting draftsmith sets itself, and no recipe key."""
    import huggingface_hub.constants as constants

    repo = tmp_path / "hub-cache" / "models--acme--pickled"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(target, snapshot, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save({"payload": Marker()}, snapshot / "pytorch_model.bin")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    line = refused(load_target, "acme/pickled")
    assert "its weights are not safetensors (acme/pickled has no model.safetensors" in line
    assert "convert them to safetensors" in line and "use_safetensors" not in line


@pytest.mark.parametrize("damage", ["cut short", "bad header"])
def test_a_damaged_safetensors_target_is_named(target, damage):
    """safetensors' SafetensorError was exit 70, "internal error (a draftsmith bug ...)"."""
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "cut short" else (1 << 40).to_bytes(8, "little") + data[8:])
    line = refused(load_target, str(target))
    assert f"{weights}: corrupt weights file (Error while deserializing header" in line


def test_a_config_that_is_no_object_and_tokenizer_files_missing_or_cut_short_are_named(target):
    """config.json holding [1, 2] was a TypeError (exit 70) for the tokenizer; no tokenizer files said to install
    sentencepiece or tiktoken; a tokenizer.json cut short was a JSON error naming no file."""
    config = target / "config.json"
    settings = config.read_text()
    config.write_text("[1, 2]")
    for load in (load_tokenizer, load_target):
        assert f"{config} holds a JSON list, not an object of settings" in refused(load, str(target))
    config.write_text(settings)
    for name in ("generation_config.json", "tokenizer_config.json"):  # exit 70: a TypeError, an AttributeError
        other = target / name
        kept = other.read_text() if other.is_file() else None
        other.write_text("[1]")
        for load in (load_tokenizer, load_target):
            assert f"{other} holds a JSON list, not an object of settings" in refused(load, str(target))
        other.write_text('{"bos')  # a generation_config.json transformers cannot parse was skipped: its stop ids too
        for load in (load_tokenizer, load_target):
            assert f"{other} is not valid JSON (" in refused(load, str(target))
        other.unlink() if kept is None else other.write_text(kept)

    tokenizer = target / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text()[:3000])
    assert f"{tokenizer} is not valid JSON (" in refused(load_tokenizer, str(target))

    tokenizer.unlink()
    (target / "tokenizer_config.json").unlink()
    line = refused(load_tokenizer, str(target))
    assert line.endswith("the folder holds no tokenizer.json or tokenizer_config.json"), line


def test_weights_of_other_shapes_than_the_config_gives_and_non_finite_ones_are_named(target, tmp_path):
    """A target whose config.json gives a vocabulary its weights do not have was transformers' RuntimeError (exit 70);
    one whose logits are not finite (a damaged weight) failed the eval's check on its own arithmetic (exit 70), or was
    decoded as lossless; a drafter checkpoint holding NaN was measured without a word, and its export's read-back
    check called the NaN a draftsmith bug (exit 70). Each is one line, exit 2."""
    from safetensors.torch import load_file, save_file

    from draftsmith.eval.target_checks import check_target
    from draftsmith.heads.base import load_drafter
    from tests.helpers import save_drafter

    config = target / "config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps({**settings, "vocab_size": settings["vocab_size"] - 1}))
    line = refused(load_target, str(target))
    assert line.endswith("its weights' shapes are not those its config.json gives them (transformers' load report, "
                         "logged above, lists them): a config.json edited, or of another model"), line  # fmt: skip
    config.write_text(json.dumps(settings))
    weights = target / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    line = refused(check_target, load_target(str(target)))
    assert "computes non-finite logits (NaN or inf) on a 4-token probe" in line, line
    checkpoint = save_drafter("medusa", load_target(str(REFERENCE_TARGET)), tmp_path / "final")
    drafted = load_file(str(checkpoint / "model.safetensors"))
    name = sorted(drafted)[0]
    drafted[name].view(-1)[0] = float("inf")
    save_file(drafted, str(checkpoint / "model.safetensors"))
    line = refused(load_drafter, checkpoint)
    assert line == f"error: {checkpoint / 'model.safetensors'}: corrupt weights file (non-finite values in {name})"


def test_a_target_whose_own_forward_fails_in_transformers_is_refused_before_training(
    tmp_path, small_data, token_cache, capsys
):
    """A hand-made config transformers cannot run (4 attention heads over 3 key-value heads: its own forward fails)
    was `internal error (a draftsmith bug ...)`, exit 70, from the eval's probe, or from the first training step with
    no eval stage; it is one line naming transformers' error, exit 2, before the data loads or anything is written.
    A probe that fails where transformers' own forward runs stays a draftsmith bug (exit 70)."""
    import draftsmith.eval.target_checks as target_checks
    from draftsmith.random_target import write_random_target
    from tests.helpers import train_args

    folder = write_random_target("llama", tmp_path / "target", num_key_value_heads=3)
    run = tmp_path / "run"
    result = run_entry_in_process(
        ["train.py", *train_args(run, small_data, token_cache, f"target.name_or_path={folder}")], capsys
    )
    line = assert_one_line_error(result, 2, "fails transformers' own forward on a 4-token probe (RuntimeError: ")
    assert line.endswith("its config.json describes a model transformers cannot run"), line
    assert not run.exists()
    # a target transformers runs: the probe's failure is not put on it (its caller raises it as it was, exit 70)
    target_checks.require_own_forward(load_target(str(REFERENCE_TARGET)), torch.tensor([[1, 2, 3, 4]]), ValueError())


def test_a_drafter_config_whose_json_is_null_or_whose_drafter_section_is_a_list_is_named(tmp_path):
    """Both were exit 70 (a TypeError in the kind's read, an AttributeError in the config's); a kind this draftsmith
    has not is named with the file."""
    from draftsmith.formats.folder import recorded_kind
    from draftsmith.heads.base import saved_drafter
    from tests.helpers import save_drafter

    checkpoint = save_drafter("medusa", load_target(str(REFERENCE_TARGET)), tmp_path / "final")
    config = checkpoint / "config.json"
    saved = json.loads(config.read_text())
    config.write_text(json.dumps({**saved, "drafter": [1, 2]}))
    line = refused(saved_drafter, checkpoint)
    said = "corrupt drafter config (TypeError: the drafter section is a list, not a mapping of settings)"
    assert line == f"error: {config}: {said}", line
    config.write_text(json.dumps({**saved, "target": {**saved["target"], "hidden_size": "256"}}))
    line = refused(saved_drafter, checkpoint)  # it said "made for hidden_size=256, but the target has hidden_size=256"
    assert line == f"error: {config}: corrupt drafter config (TypeError: the target's sizes must be integers: " \
        "{'hidden_size': '256'})", line  # fmt: skip
    config.write_text(json.dumps({**saved, "drafter_type": "bogus"}))  # it named no file: read as a recipe key's
    assert refused(recorded_kind, checkpoint).startswith(f"error: {config}: drafter_type: unknown drafter.type 'bogus'")
    config.write_text("null")
    said = "corrupt engine config (JSON NoneType, not an object)"  # read as no checkpoint's: as a list is
    assert refused(recorded_kind, checkpoint) == f"error: {config}: {said}"


def test_files_that_are_not_utf_8_text_are_named(tmp_path, capsys):
    """A recipe file, a load sweep's rows and a monitor's baseline report of other bytes were exit 70
    (`UnicodeDecodeError`)."""
    from draftsmith.export.sweep_results import read_sweep
    from draftsmith.monitor.deployed import load_baseline

    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe garbage")
    result = run_entry_in_process(["train.py", f"recipe={binary}", f"output_dir={tmp_path / 'run'}"], capsys)
    assert_one_line_error(result, 2, f"recipe {binary}: not UTF-8 text, so no YAML (")
    assert refused(read_sweep, binary).startswith(f"error: {binary}: not UTF-8 text, so no load-sweep rows (")
    deployed = {"export": str(tmp_path / "vllm"), "baseline": str(binary), "sha256": "0" * 64}
    assert refused(load_baseline, deployed).startswith(f"error: cannot read the baseline report {binary}: ")
    # JSON of another kind than a report's, or values of another kind: exit 70 (TypeError) in the monitor's check
    for text in ("5", json.dumps({"domains": {"all": {"chain": {"drafted": "abc", "accepted": 1}}}}),
                 json.dumps({"domains": {}, "drafter": {"sha256": 5}})):  # fmt: skip
        binary.write_text(text)
        assert refused(load_baseline, deployed).startswith(f"error: {binary} is not a draftsmith eval report"), text
    # more accepted than drafted: taken, a baseline no window could fall below (the engine's counters are refused so)
    chain = {"drafted": 3, "accepted": 15, "per_position_counts": {"reached": [3], "accepted": [15]}}
    binary.write_text(json.dumps({"domains": {"all": {"chain": chain}}, "drafter": {"sha256": "0" * 64}}))
    said = f"error: the baseline report {binary} counts 15 accepted of 3 drafted tokens in a chain row, which no eval"
    assert refused(load_baseline, deployed).startswith(said)


def test_custom_code_without_trust_names_the_recipe_key(target):
    """transformers' line was cut at 300 characters, named no recipe key and held `https://hf.co//tmp/...`."""
    config = json.loads((target / "config.json").read_text())
    config.update(
        model_type="evilllama",
        auto_map={"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilLM"},
    )
    (target / "config.json").write_text(json.dumps(config))
    line = refused(load_config, target_section(str(target)))
    assert "asks to run code of its own (auto_map)" in line and "target.trust_remote_code=true" in line
    assert "hf.co" not in line


def test_links_that_lead_nowhere_are_named(tmp_path, capsys):
    """An output_dir that is a loop of links was exit 70 (FileExistsError from mkdir), a target that is one "no
    such folder (a Hub id reads owner/name)", and a data file that is a link to nothing was left out without a word."""
    (tmp_path / "loopA").symlink_to(tmp_path / "loopB")
    (tmp_path / "loopB").symlink_to(tmp_path / "loopA")
    (tmp_path / "gone").symlink_to(tmp_path / "missing")
    loop = tmp_path / "loopA"
    with pytest.raises(UserError, match=f"cannot be created: {loop} is a loop of symbolic links$"):
        check_output_dir(loop / "run")
    with pytest.raises(UserError, match=f"cannot be created: {tmp_path / 'gone'} links to .*missing, missing$"):
        check_output_dir(tmp_path / "gone")

    args = ["train.py", "recipe=medusa", f"output_dir={tmp_path / 'run'}", f"target.name_or_path={loop}"]
    line = assert_one_line_error(run_entry_in_process(args, capsys), 2)
    assert line == f"error: target.name_or_path={loop}: a loop of symbolic links, no folder"

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("{}\n")
    (data / "b.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    for read in (lambda: files_under(str(data), "data"), lambda: files_matching(str(data / "*.jsonl"), "data/*")):
        with pytest.raises(UserError, match=f"{data / 'b.jsonl'} is a symbolic link that leads to no file"):
            read()


@pytest.fixture
def saved_state(tmp_path):
    """(accelerator, folder): accelerate's state of a tiny model, its optimizer and scheduler, saved to folder."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    accelerator.prepare(model, optimizer, scheduler)
    folder = tmp_path / "step_0000001"
    accelerator.save_state(str(folder))
    return accelerator, folder


def test_a_checkpoint_pickle_of_more_than_tensors_is_named_without_the_advice(saved_state):
    """An optimizer.bin put in place (its checksums recomputed) was exit 70 with torch's advice to rerun with
    weights_only=False."""
    accelerator, folder = saved_state
    torch.save({"payload": Marker()}, folder / "optimizer.bin")
    line = refused(load_checkpoint, accelerator, folder)
    assert f"{folder / 'optimizer.bin'} holds more than tensors and plain values" in line


def test_random_states_that_do_not_load_are_named(saved_state, caplog):
    """accelerate skipped random states it could not load with an INFO line, so a resume was quietly not an
    uninterrupted run's: a missing file is a warning naming it, one that does not hold them is refused."""
    accelerator, folder = saved_state
    states = folder / "random_states_0.pkl"
    for wrong in ({"random_state": 1}, {"step": 1}):
        torch.save(wrong, states)
        assert f"{states} does not hold random states" in refused(load_checkpoint, accelerator, folder)

    torch.save({"payload": Marker()}, states)
    assert f"{states} holds more than tensors and plain values" in refused(load_checkpoint, accelerator, folder)

    states.unlink()
    with caplog.at_level(logging.WARNING, "draftsmith.train"):
        load_checkpoint(accelerator, folder)
    assert f"checkpoint {folder} holds no random_states_0.pkl: rank 0's random numbers are not restored" in caplog.text


@pytest.mark.parametrize("command", [["-m", "eval"], ["-m", "export"], ["-m", "draftsmith", "sweep"], ["train.py"]])
def test_a_checkpoint_whose_config_builds_other_weights_than_it_holds_is_refused_before_the_target_loads(
    command, tmp_path, capsys, monkeypatch
):
    """A drafter checkpoint whose config.json was edited to more heads than its weights hold, read by eval, export or
    sweep or warm-started from (`train.init_from`), was refused only once the target's weights had loaded (minutes at
    scale): it is one line, exit 2, from the config and the weights file's header, the target untouched."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import save_drafter

    checkpoint = save_drafter("medusa", load_target(str(REFERENCE_TARGET)), tmp_path / "final")
    config = checkpoint / "config.json"
    saved = json.loads(config.read_text())
    heads = saved["drafter"]["num_heads"]
    config.write_text(json.dumps({**saved, "drafter": {**saved["drafter"], "num_heads": heads + 1}}))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: pytest.fail("target loaded"))
    read = "train.init_from" if command == ["train.py"] else "checkpoint"
    args = [*command, "recipe=medusa", f"{read}={checkpoint}", f"output_dir={tmp_path / 'run'}"]
    args += ["export.vllm_python=/bin/true"] if "sweep" in command else []
    line = assert_one_line_error(run_entry_in_process(args, capsys), 2)
    said = f"weights do not match a medusa drafter as its config.json builds it (missing ['lm_heads.{heads}.weight', "
    assert line.startswith(f"error: {checkpoint / 'model.safetensors'}: {said}"), line


def test_a_checkpoint_holding_integer_weights_is_refused(tmp_path):
    """Weights stored as int32 (or bool) were cast to floats and evaluated and exported, exit 0."""
    from safetensors.torch import load_file, save_file

    from draftsmith.formats.folder import require_weights_as_configured
    from tests.helpers import save_drafter

    checkpoint = save_drafter("medusa", load_target(str(REFERENCE_TARGET)), tmp_path / "final")
    weights = checkpoint / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    save_file({**tensors, name: (tensors[name] * 1000).to(torch.int32)}, weights, metadata={"format": "pt"})
    said = rf"other shapes or types: \['{name} stored as I32 \(its config builds floating-point"
    with pytest.raises(UserError, match=said):
        require_weights_as_configured(checkpoint)
