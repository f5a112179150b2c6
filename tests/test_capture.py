"""Feature capture (data_prep.capture) and its reader (data_prep.features) on the reference target:
stored features equal a fresh forward within storage precision, a killed capture resumes without
redoing finished shards, two ranks write one capture, and bad input is a one-line error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file

from draftsmith.data_prep.capture import CaptureResult, capture, main
from draftsmith.data_prep.collate import Collator
from draftsmith.data_prep.conversations import load_conversations
from draftsmith.data_prep.dataset import tokenize_conversations
from draftsmith.data_prep.features import (
    SCHEMA_VERSION,
    expected_features,
    open_features,
    require_captured_settings,
)
from draftsmith.errors import UserError, run_cli
from draftsmith.recipe import load_recipe
from draftsmith.target import FeatureRequest, TargetShape, load_target, load_tokenizer, run_target
from tests.forked import run_forked_ranks
from tests.helpers import REFERENCE_TARGET, assert_one_line_error, corpus_slice

LAYERS = (-1, 0, 2)  # embeddings and two decoder layers of the 4-layer reference target
TOPK = 8
EVERYTHING = FeatureRequest(final=True, layers=LAYERS, logits=True)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("capture_data")
    return {"train": corpus_slice(root / "train.jsonl", "eval", 2), "cache": root / "cache"}  # 8 conversations


def capture_args(output: Path, data: dict[str, Path], *extra: str) -> list[str]:
    return [
        "recipe=medusa",
        f"target.name_or_path={REFERENCE_TARGET}",
        f"data.train=[{data['train']}]",
        f"data.cache_dir={data['cache']}",
        "data.max_length=96",
        "train.micro_batch_size=3",
        f"output_dir={output}",
        *extra,
    ]


def run_capture(output: Path, data: dict[str, Path], *extra: str) -> CaptureResult:
    return capture(load_recipe(capture_args(output, data, *extra)))


FULL = (
    f"data.capture.layers=[{','.join(map(str, LAYERS))}]",
    "data.capture.final=true",
    "data.capture.logits=topk",
    f"data.capture.topk={TOPK}",
)


@pytest.fixture(scope="module")
def captures(tmp_path_factory, conversations) -> dict[str, CaptureResult]:
    """The same conversations captured in each storage dtype, with layers, final and top-k."""
    root = tmp_path_factory.mktemp("captures")
    umask = os.umask(0o022)  # test_shards_have_the_umasks_mode's
    try:
        return {
            dtype: run_capture(
                root / dtype, conversations, *FULL, f"data.capture.dtype={dtype}", "data.capture.shard_tokens=250"
            )
            for dtype in ("bfloat16", "float16", "float8")
        }
    finally:
        os.umask(umask)


@pytest.fixture(scope="module")
def reference(conversations):
    """The tokenized conversations (as training sees them) and the target, for fresh forwards."""
    tokenizer = load_tokenizer(str(REFERENCE_TARGET))
    rows = load_conversations([str(conversations["train"])])
    data = tokenize_conversations(rows, tokenizer, 96, "truncate", str(conversations["cache"]))
    return data, load_target(str(REFERENCE_TARGET))


def assert_stored(stored: torch.Tensor, fresh: torch.Tensor, dtype: str) -> None:
    if dtype == "float8":
        # e4m3 keeps 3 mantissa bits: 2^-4 relative error, plus half a subnormal step of the row's scale.
        scale = fresh.abs().amax(-1, keepdim=True) / 448
        assert ((stored - fresh).abs() <= fresh.abs() * 2**-4 + scale * 2**-9 + 1e-5).all()
        assert (stored - fresh).norm() / fresh.norm() < 0.05
    else:
        rtol = {"bfloat16": 2**-8, "float16": 2**-10}[dtype]  # one rounding: half an ulp, plus batching noise
        torch.testing.assert_close(stored, fresh, rtol=rtol, atol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8"])
def test_features_equal_a_fresh_forward_within_storage_precision(captures, reference, dtype):
    data, target = reference
    store = open_features(
        captures[dtype].directory, expect=expected_features(TargetShape.of(target, str(REFERENCE_TARGET)), EVERYTHING)
    )
    assert len(store) == len(data) == 8
    for i, row in enumerate(data):
        item = store[i]
        assert item["input_ids"].tolist() == row["input_ids"] and item["loss_mask"].tolist() == row["loss_mask"]
        assert item["domain"] == row["domain"]
        with torch.no_grad():
            fresh = run_target(target, torch.tensor([row["input_ids"]]), None, EVERYTHING)
        assert_stored(item["final"], fresh.final[0], dtype)
        for layer in LAYERS:
            assert_stored(item[f"layer_{layer}"], fresh.layers[layer][0], dtype)
        logprobs = torch.log_softmax(fresh.logits[0].float(), dim=-1)
        top_ids = logprobs.topk(TOPK, dim=-1).indices
        assert (item["topk_ids"] == top_ids).float().mean() > 0.99  # near-ties may swap places
        torch.testing.assert_close(item["topk_logprobs"], logprobs.gather(-1, item["topk_ids"]), rtol=2**-10, atol=1e-3)


def test_manifest_records_the_capture_and_fp8_is_smallest(captures):
    manifests = {dtype: result.manifest for dtype, result in captures.items()}
    bf16 = manifests["bfloat16"]
    assert bf16["schema_version"] == SCHEMA_VERSION and bf16["layers"] == list(LAYERS) and bf16["topk"] == TOPK
    assert bf16["target"]["hidden_size"] == 256 and bf16["target"]["num_hidden_layers"] == 4
    assert "hidden_states[i + 1]" in bf16["layer_convention"]
    stored = {
        "input_ids",
        "loss_mask",
        "offsets",
        "final",
        "layer_-1",
        "layer_0",
        "layer_2",
        "topk_ids",
        "topk_logprobs",
    }
    assert set(bf16["fields"]) == stored
    assert "layer_0.scale" in manifests["float8"]["fields"]
    assert bf16["tokens"] == sum(s["tokens"] for s in bf16["shards"]) and len(bf16["shards"]) >= 3
    assert bf16["domains"] == {"code": 2, "docs": 2, "math": 2, "packages": 2}
    assert bf16["anchor_bytes_per_token"] == 8 * 256
    for manifest in manifests.values():
        assert manifest["bytes_per_token"] == pytest.approx(manifest["bytes"] / manifest["tokens"])
    assert manifests["float8"]["bytes_per_token"] < 0.6 * bf16["bytes_per_token"]
    assert manifests["float16"]["bytes_per_token"] == pytest.approx(bf16["bytes_per_token"], rel=0.01)


def test_shards_have_the_umasks_mode(captures):
    """safetensors writes through a private temporary file (mode 0600): shards and manifests get the umask's
    mode (0644 under umask 022), so that a training job run by another user can read them."""
    files = [path for result in captures.values() for path in result.directory.iterdir() if path.is_file()]
    modes = {path.as_posix(): oct(path.stat().st_mode & 0o777) for path in files}
    assert {path: mode for path, mode in modes.items() if mode != oct(0o644)} == {}
    assert len([path for path in files if path.suffix == ".safetensors"]) >= 9  # three shards or more a dtype


def test_collate_pads_features_and_rebuilds_the_target_output(captures):
    store = open_features(captures["bfloat16"].directory)
    rows = [store[i] for i in range(3)]
    batch = Collator(pad_token_id=0)(rows)
    width = max(len(row["input_ids"]) for row in rows)
    assert batch["final"].shape == (3, width, 256) and batch["topk_ids"].shape == (3, width, TOPK)
    out = store.to_target_output(batch)
    assert sorted(out.layers) == sorted(LAYERS) and out.logits.shape == (3, width, 4096)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch["attention_mask"][b].sum() == n and not batch["layer_2"][b, n:].any()
        torch.testing.assert_close(out.layers[0][b, :n], row["layer_0"])
        probs = torch.softmax(out.logits[b, :n], dim=-1)  # the target's distribution renormalized over its top k
        kept = torch.softmax(row["topk_logprobs"], dim=-1)
        torch.testing.assert_close(probs.gather(-1, row["topk_ids"]), kept)


class Killed(Exception):
    """Stands in for SIGKILL in the middle of writing a shard."""


def assert_same_shards(one: CaptureResult, other: CaptureResult) -> None:
    """Tensor for tensor (not byte for byte: safetensors orders the header's metadata at random)."""
    assert [s["file"] for s in one.manifest["shards"]] == [s["file"] for s in other.manifest["shards"]]
    for shard in one.manifest["shards"]:
        mine, theirs = load_file(one.directory / shard["file"]), load_file(other.directory / shard["file"])
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def shard_stats(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.glob("shard_*.safetensors")}


@pytest.mark.slow
def test_killed_capture_resumes_without_redoing_finished_shards(tmp_path, conversations, monkeypatch):
    settings = ("data.capture.shard_tokens=150",)
    uninterrupted = run_capture(tmp_path / "straight", conversations, *settings)
    planned = len(uninterrupted.manifest["shards"])
    assert planned >= 4 and uninterrupted.computed == planned

    real_save, written = safetensors.torch.save_file, []

    def dies_on_third_shard(tensors, filename, metadata=None):
        if len(written) == 2:
            Path(filename).write_bytes(b"half a shard")
            raise Killed
        real_save(tensors, filename, metadata=metadata)
        written.append(filename)

    monkeypatch.setattr(safetensors.torch, "save_file", dies_on_third_shard)
    with pytest.raises(Killed):
        run_capture(tmp_path / "run", conversations, *settings)
    monkeypatch.undo()
    features = tmp_path / "run" / "features"
    assert sorted(shard_stats(features)) == ["shard_00_00000.safetensors", "shard_00_00001.safetensors"]
    partial = features / "shard_00_00002.safetensors.tmp"
    assert not partial.exists() and not (features / "manifest.json").exists()  # an exception's removes it (Ctrl-C)
    partial.write_bytes(b"half a shard")  # what SIGKILL, which runs no cleanup, leaves
    (features / "engine-0.tmp").mkdir()  # a killed vLLM capture's folder of states
    users = [features / "results.tmp" / "kept.txt", features / ".tmp_notes", features / "data.tmp"]
    users[0].parent.mkdir()
    for path in users:  # the user's own files beside the capture: never removed
        path.write_text("kept")
    with pytest.raises(UserError, match="has not finished"):
        open_features(features)

    before = shard_stats(features)
    resumed = run_capture(tmp_path / "run", conversations, *settings)
    assert (resumed.computed, resumed.reused) == (planned - 2, 2)
    after = shard_stats(features)
    assert {name: after[name] for name in before} == before  # finished shards untouched
    assert not list(features.glob("shard_*.tmp")) and not (features / "engine-0.tmp").exists()
    assert all(path.read_text() == "kept" for path in users)
    assert_same_shards(resumed, uninterrupted)

    # A finished shard damaged on disk (same size) fails its checksum when read, and is redone on resume.
    victim = features / "shard_00_00001.safetensors"
    damaged = bytearray(victim.read_bytes())
    damaged[-10] ^= 0xFF
    victim.write_bytes(damaged)
    store = open_features(features)
    first_of_victim = resumed.manifest["shards"][1]["first_conversation"]
    with pytest.raises(UserError, match="shard_00_00001.safetensors is corrupt"):
        store[first_of_victim]
    again = run_capture(tmp_path / "run", conversations, *settings)
    assert (again.computed, again.reused) == (1, planned - 1)
    assert_same_shards(again, uninterrupted)


@pytest.mark.slow  # two ranks: processes forked from this one (torchrun's launch: tests/test_sharding.py's capture)
def test_two_ranks_write_their_own_shards_and_one_manifest(tmp_path, conversations):
    single = run_capture(tmp_path / "single", conversations, "data.capture.shard_tokens=150")
    output = tmp_path / "ddp"
    args = ["-m", "data_prep.capture", *capture_args(output, conversations, "data.capture.shard_tokens=150")]
    result = run_forked_ranks(args, tmp_path / "logs")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bytes/token" in result.stdout
    features = output / "features"
    manifest = json.loads((features / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and {s["rank"] for s in manifest["shards"]} == {0, 1}
    assert (features / "manifest_part_00.json").is_file() and (features / "manifest_part_01.json").is_file()
    starts = [s["first_conversation"] for s in manifest["shards"]]
    ends = [s["first_conversation"] + s["conversations"] for s in manifest["shards"]]
    assert starts[0] == 0 and starts[1:] == ends[:-1] and ends[-1] == 8  # every conversation once, in order
    two, one = open_features(features), open_features(single.directory)
    for i in range(len(one)):
        assert two[i]["input_ids"].tolist() == one[i]["input_ids"].tolist()
        torch.testing.assert_close(two[i]["final"], one[i]["final"], rtol=2**-7, atol=1e-4)


def test_features_from_another_target_or_layer_set_are_refused(tmp_path, captures, conversations):
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = captures["bfloat16"].directory
    other = LlamaForCausalLM(
        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=4096)
    )
    mismatch = r"captured from target .*/target \(hidden_size=256.* recipe's target is tiny \(hidden_size=64"
    with pytest.raises(UserError, match=mismatch):
        open_features(directory, expect=expected_features(TargetShape.of(other, "tiny"), FeatureRequest(final=True)))
    with pytest.raises(UserError, match=r"hold layers \[-1, 0, 2\] but the drafter needs \[1, 2\]"):
        open_features(directory, expect={"layers": [1, 2]})
    # the run's target by name and shape, with other weights: trained on another target's states without a word
    ours = TargetShape.of(load_target(str(REFERENCE_TARGET)), str(REFERENCE_TARGET))
    reweighted = replace(ours, embedding_norms=tuple(1.5 * norm for norm in ours.embedding_norms))
    with pytest.raises(UserError, match="has the same shape but other weights"):
        open_features(directory, expect=expected_features(reweighted, FeatureRequest(final=True)))
    open_features(directory, expect=expected_features(ours, FeatureRequest(final=True)))  # its own target's
    # its weights in a folder of another name (copied, moved) are the target captured; by name alone (a capture by an
    # earlier draftsmith, which records no weights) another name is refused, saying so
    moved = replace(ours, name_or_path=str(tmp_path / "copied-target"))
    open_features(directory, expect=expected_features(moved, FeatureRequest(final=True)))
    with pytest.raises(UserError, match=r"has its shape under another name; the capture records no weights"):
        open_features(directory, expect=expected_features(replace(moved, embedding_norms=None), FeatureRequest()))
    # A drafter that distils from the target's distribution cannot train on a capture without one.
    final_only = run_capture(tmp_path, conversations)  # the medusa recipe's default: final only
    with pytest.raises(UserError, match="hold no target distribution"):
        open_features(final_only.directory, expect={"logits": True})


def test_training_from_a_capture_refuses_data_settings_it_was_not_made_with(captures, conversations):
    """The capture's manifest records its data settings and the dtype its target ran in; a training recipe
    that sets another value is refused in one line naming both (the run would train on the capture's rows
    and record values it did not use); target.dtype=auto is whatever this machine loads."""
    directory = captures["bfloat16"].directory
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["data"]["thinking"] == "train" and manifest["target"]["dtype"] == "float32"

    def recipe(*extra: str):
        return load_recipe(capture_args(directory.parent, conversations, f"data.features={directory}", *extra))

    require_captured_settings(recipe())
    require_captured_settings(recipe("target.dtype=float32"))
    with pytest.raises(UserError) as refused:
        require_captured_settings(recipe("data.max_length=64", "data.thinking=mask", "target.dtype=bfloat16"))
    assert str(refused.value) == (
        "the recipe resolves to data.max_length=64, data.thinking=mask, target.dtype=bfloat16, but the features in "
        f"{directory} were captured with data.max_length=96, data.thinking=train, target.dtype=float32: set the "
        "capture's values, or capture again with the recipe's"
    )
    # data.train is not read either: another file was trained on the capture's rows without a word
    other = directory.parent / "other.jsonl"
    with pytest.raises(UserError, match=r"^the recipe resolves to data.train=\[.*other.jsonl'\], but the features in "):
        require_captured_settings(recipe(f"data.train=[{other}]"))
    require_captured_settings(recipe("data.train=[]"))  # nothing named: nothing overruled


def test_a_capture_records_its_files_as_absolute_paths_and_trains_from_any_directory(
    tmp_path, conversations, monkeypatch
):
    """data.train given relative to the capture's directory is recorded resolved: training from another
    directory, naming the same files its own way, reads the capture; a manifest written before (paths as typed)
    resolves them against the current directory."""
    train = conversations["train"]
    monkeypatch.chdir(train.parent)
    relative = {**conversations, "train": Path(train.name)}
    directory = run_capture(tmp_path, relative).directory  # medusa's default: the final state only
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["data"]["sources"] == [str(train.resolve())]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    def recipe(given):
        return load_recipe(capture_args(tmp_path, {**conversations, "train": given}, f"data.features={directory}"))

    require_captured_settings(recipe(Path(os.path.relpath(train, elsewhere))))
    require_captured_settings(recipe(train))
    with pytest.raises(UserError, match=r"^the recipe resolves to data.train=\[.*other.jsonl'\], but"):
        require_captured_settings(recipe(train.parent / "other.jsonl"))

    manifest["data"]["sources"] = [train.name]  # as a capture before absolute paths recorded it
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"were captured with data.train=\['train.jsonl'\]"):
        require_captured_settings(recipe(train))  # train.jsonl names no file here
    monkeypatch.chdir(train.parent)
    require_captured_settings(recipe(train))  # where it resolves to the same file, it is the same


def test_truncated_shard_or_missing_manifest_is_a_user_error(tmp_path, captures):
    copy = tmp_path / "copy"
    shutil.copytree(captures["float16"].directory, copy)
    shard = copy / "shard_00_00001.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(UserError, match=r"shard_00_00001.safetensors is truncated"):
        open_features(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(UserError, match="holds no manifest.json"):
        open_features(copy)


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.capture.layers=[4]", "layer id 4 is out of range for a target with 4 layers"),
        ("data.capture.layers=[0,2,0]", "data.capture.layers=[0, 2, 0] names [0] more than once"),  # not merged
        ("data.capture.dtype=int4", "data.capture.dtype='int4' is not one of"),
        ("data.capture.dtype=float16", "already holds a capture with other settings (dtype: 'bfloat16' -> 'float16'"),
        # a data setting the manifest records is named, not the conversations' two fingerprints
        ("data.max_length=64", "already holds a capture with other settings (data.max_length: 96 -> 64):"),
        # topk with a capture that keeps no top-k distribution: it changed nothing (the manifest said topk None)
        ("data.capture.logits=none", "data.capture.topk=8 is read when the capture keeps the top-k distribution"),
    ],
)
def test_bad_capture_settings_exit_2_with_one_line(captures, conversations, capsys, monkeypatch, override, message):
    """Bad or other settings are refused before the data is read and tokenized (minutes for a large data set), the
    data's own settings too (data.max_length: they were compared with the conversations' fingerprint after it)."""
    import draftsmith.data_prep.capture as capture_module

    tokenized = []

    def counted(*args):
        tokenized.append(1)
        return tokenize_conversations(*args)

    monkeypatch.setattr(capture_module, "tokenize_conversations", counted)
    output = captures["bfloat16"].directory.parent  # holds a bfloat16 capture
    args = capture_args(output, conversations, *FULL, "data.capture.shard_tokens=250", override)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, args)
    done = subprocess.CompletedProcess(args, exit_info.value.code, "", capsys.readouterr().err)
    assert_one_line_error(done, 2, message)
    assert not tokenized


@pytest.mark.parametrize(
    ("setting", "line"),
    [
        (["data.capture.layers=[1,4]"], "layer id 4 is out of range for a target with 4 layers (valid: -1..3)"),
        (
            ["data.capture.logits=topk", "data.capture.topk=5000"],
            "data.capture.topk=5000 is more than the target's vocabulary of 4096",
        ),
    ],
)
def test_a_layer_or_a_top_k_the_target_has_not_is_refused_before_the_target_loads(
    setting, line, tmp_path, conversations, capsys, monkeypatch
):
    """Read from the target's config.json: they were refused once the target's weights had loaded (minutes at
    scale)."""
    import draftsmith.data_prep.capture as capture_module

    def no_load(*args, **kwargs):
        raise AssertionError("the tokenizer or the target was loaded")

    monkeypatch.setattr(capture_module, "load_tokenizer", no_load)
    args = capture_args(tmp_path / "features", conversations, *FULL, *setting)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, args)
    done = subprocess.CompletedProcess(args, exit_info.value.code, "", capsys.readouterr().err)
    assert_one_line_error(done, 2, line)


def test_a_directory_of_files_no_capture_wrote_is_not_written_into(tmp_path, conversations, capsys):
    """data.capture.output naming a training run's output_dir was written into, its shards and manifest beside the
    run's files: refused in one line before the target loads, nothing added."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("drafter: {type: medusa}\n")
    args = capture_args(tmp_path, conversations, f"data.capture.output={run}")
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, args)
    done = subprocess.CompletedProcess(args, exit_info.value.code, "", capsys.readouterr().err)
    assert_one_line_error(done, 2, f"{run} holds files no capture wrote (config.yaml): set data.capture.output to a")
    assert sorted(path.name for path in run.iterdir()) == ["config.yaml"]


def test_a_vision_language_release_whose_config_keeps_its_layer_count_in_its_text_config_is_captured(
    tmp_path, conversations
):
    """A wrapper transformers loads whole (Gemma-3's) keeps its layer count in its text config, not at its config's
    top: its layers are checked and captured as its language model's (it stopped with an internal error)."""
    from draftsmith.random_target import write_random_target

    folder = write_random_target("gemma3", tmp_path / "release", released=True)
    done = run_capture(tmp_path / "run", conversations, f"target.name_or_path={folder}", "recipe=eagle3")
    assert done.computed >= 1 and done.manifest["target"]["num_hidden_layers"] == 4


@pytest.mark.parametrize("recipe, taps", [("eagle3", "aux_layers"), ("dflash", "target_layers")])
def test_a_capture_keeps_the_layers_the_drafter_train_builds_reads_on_a_hybrid_target(tmp_path, recipe, taps):
    """On a hybrid target a kind's default taps move onto attention layers when the drafter is built
    (`from_target`): the capture's default selection asks the same (`for_target`), not the unmoved default."""
    from omegaconf import OmegaConf

    from draftsmith.data_prep.capture import resolve_selection
    from draftsmith.heads import drafter_class
    from draftsmith.random_target import write_random_target

    folder = write_random_target("qwen3_next", tmp_path / "hybrid", num_hidden_layers=8)
    cfg = load_recipe([f"recipe={recipe}", f"target.name_or_path={folder}", f"drafter.{taps}=null"])  # the default
    target = load_target(str(folder))
    built = drafter_class(cfg.drafter.type).from_target(OmegaConf.to_object(cfg.drafter), target, "t")
    shape = TargetShape.of(target, str(folder))
    read = built.features(built.config, shape).layers
    unmoved = built.features(OmegaConf.to_object(cfg.drafter), shape).layers
    assert resolve_selection(cfg, target).layers == tuple(sorted(set(read))) != tuple(sorted(set(unmoved)))


@pytest.mark.slow  # runs an entry point (the fast tier stays within its 2 minutes)
def test_a_capture_resumed_over_other_data_says_which_input_changed_not_two_hashes(tmp_path, conversations, capsys):
    """An unfinished capture (its parts alone: no manifest) resumed after data.train's content, a data setting or
    the tokenizer changed, or one begun before draftsmith recorded them, is refused in one line saying in words
    what changed and what to do; it named the conversations' two fingerprints (`data_fingerprint: 'ab36…' ->
    '51c1…'`), whatever had changed."""
    train = tmp_path / "train.jsonl"
    shutil.copy(conversations["train"], train)
    data = {**conversations, "train": train}
    first = run_capture(tmp_path, data, "data.capture.shard_tokens=250")
    features = first.directory
    (features / "manifest.json").unlink()  # as a run killed before it merged its parts
    part_path = features / "manifest_part_00.json"
    part = json.loads(part_path.read_text())
    assert part["data_content"] == first.manifest["data_content"] and part["data"] == first.manifest["data"]

    def refusal(*extra: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(main, capture_args(tmp_path, data, "data.capture.shard_tokens=250", *extra))
        done = subprocess.CompletedProcess([], exit_info.value.code, "", capsys.readouterr().err)
        line = assert_one_line_error(done, 2, f"{features} already holds a capture with other settings (")
        assert "data_fingerprint" not in line and part["settings"]["data_fingerprint"] not in line
        assert line.endswith(
            "put back what it was made with, or remove it or set data.capture.output to another directory"
        )
        return line

    assert "(data.max_length: 96 -> 64)" in refusal("data.max_length=64")  # a setting, named, in a part too
    rows = train.read_text().splitlines()
    train.write_text("\n".join([rows[1], rows[0], *rows[2:]]) + "\n")  # the same path, other content
    assert "(data.train's content: a file's conversations changed since the capture was made)" in refusal()
    shutil.copy(conversations["train"], train)
    other = {**part["settings"], "data_fingerprint": "0" * 64}  # as made with another chat template
    part_path.write_text(
        json.dumps({**part, "settings": other, "tokenizer": {**part["tokenizer"], "chat_template": "another"}})
    )
    assert "(the target's tokenizer: its chat_template changed since the capture was made)" in refusal()
    old = {key: value for key, value in part.items() if key not in ("data", "tokenizer", "data_content")}
    part_path.write_text(json.dumps({**old, "settings": other}))  # begun before the records
    assert "the capture predates draftsmith recording which" in refusal()
    part_path.write_text(json.dumps(part))
    resumed = run_capture(tmp_path, data, "data.capture.shard_tokens=250")  # the data it was made from: resumed
    assert resumed.computed == 0 and resumed.manifest["shards"] == first.manifest["shards"]


def test_a_target_field_an_earlier_capture_did_not_record_is_no_change():
    """A Hub target's commit (TargetShape.revision, 2026-12-07) is in a capture's target record since: a capture
    recorded before resumes, and one recorded at another commit is a change."""
    from draftsmith.data_prep.capture_files import target_changes

    now = {"name_or_path": "acme/tiny", "hidden_size": 8, "revision": "a" * 40}
    assert target_changes({key: value for key, value in now.items() if key != "revision"}, now) == []
    assert target_changes({**now, "revision": "b" * 40}, now) == [f"target revision: {'b' * 40!r} -> {'a' * 40!r}"]


def test_a_capture_recording_fewer_of_its_targets_weights_resumes_and_other_weights_are_refused(
    tmp_path, conversations, capsys
):
    """A capture's target record says which weights by what its engine read (a vLLM capture reads no layer: no
    `layer_values`; an earlier draftsmith recorded neither): what both records know is compared, as training compares
    it, so such a capture resumes; a target of its shape with other weights is refused, saying so, not as a field's
    two long lists."""
    from draftsmith.target import load_target

    done = run_capture(tmp_path, conversations)
    features = done.directory
    for path in [features / "manifest.json", *features.glob("manifest_part_*.json")]:
        record = json.loads(path.read_text())
        (record.get("settings") or record)["target"].pop("layer_values")
        path.write_text(json.dumps(record))
    again = run_capture(tmp_path, conversations)
    assert (again.computed, again.reused) == (0, done.computed)
    other = load_target(str(REFERENCE_TARGET))
    with torch.no_grad():
        other.get_input_embeddings().weight.mul_(1.5)
    shutil.copytree(REFERENCE_TARGET, tmp_path / "other")  # its tokenizer and template
    other.save_pretrained(tmp_path / "other")
    args = capture_args(tmp_path, conversations, f"target.name_or_path={tmp_path / 'other'}")
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, args)
    refused = assert_one_line_error(
        subprocess.CompletedProcess(args, exit_info.value.code, "", capsys.readouterr().err), 2
    )
    assert "the target's weights (its input embedding or last layer differs)" in refused
    assert "embedding_norms" not in refused


def test_a_capture_leaving_out_what_the_recipes_drafter_reads_says_so(conversations, tmp_path, caplog):
    """A capture of part of what the drafter reads is the user's to make (another drafter's, a comparison of engines'
    layers), and training this recipe's drafter from it is refused: said at its start, not only after it is whole."""
    args = capture_args(tmp_path / "run", conversations, "data.capture.final=false", "data.capture.layers=[0]")
    with caplog.at_level("WARNING", logger="draftsmith.capture"):
        capture(load_recipe(args))
    (line,) = [record.getMessage() for record in caplog.records if record.name == "draftsmith.capture"]
    assert line.startswith("the recipe's medusa drafter reads the final hidden state, which these data.capture")


def test_vllm_settings_of_a_capture_transformers_runs_are_said_not_read(conversations, tmp_path, caplog):
    """A vLLM setting given without data.capture.engine=vllm (or kept by a recipe made for vLLM, switched to
    transformers) ran the capture without it, unsaid: one warning names them; nothing is said of the engine's own."""
    from draftsmith.data_prep.vllm_stage import warn_unread_vllm

    given = ["data.capture.vllm.max_num_seqs=8", "data.capture.vllm.dtype=float16"]
    with caplog.at_level("WARNING", logger="draftsmith.data"):
        capture(load_recipe(capture_args(tmp_path / "run", conversations, *given)))
        warn_unread_vllm(load_recipe(["recipe=medusa", "data.capture.engine=vllm", *given]).data.capture, "x")
    assert [record.getMessage() for record in caplog.records if record.name == "draftsmith.data"] == [
        "data.capture.vllm.dtype=float16, data.capture.vllm.max_num_seqs=8: not read: data.capture.engine=transformers "
        "runs the target in this process (data.capture.engine=vllm reads them)"
    ]
