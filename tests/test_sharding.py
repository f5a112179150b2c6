"""`target.shard=fsdp` (draftsmith/sharding.py): the frozen target's decoder layers sharded over the
ranks with FSDP2, on CPU over gloo. Two ranks each hold half of the decoder layers' bytes plus the
whole embedding, final norm and lm_head, and train, capture and regenerate exactly what the
unsharded run does; one process runs the same code; a drafter that cannot work with it is refused
at start, in one line.

Tolerance: on CPU the sharded and the unsharded runs measured identical, bit for bit (losses, final
drafter weights, capture shards, regenerated text: difference 0.0), since gathering a layer's
pieces copies its weights exactly and the same kernels run on them. The tests allow 1e-6 relative on
losses and weights, and ask the files to be byte-identical.
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.recipe import load_recipe
from tests.forked import run_forked_ranks
from tests.helpers import (
    REFERENCE_TARGET,
    REPO,
    assert_one_line_error,
    corpus_slice,
    first_records,
    read_log,
    run_entry,
    run_entry_in_process,
)

FSDP_LAUNCH = REPO / "recipes" / "accelerate" / "fsdp_target.yaml"


def replicated_bytes(config: dict, element_size: int = 4) -> int:
    """Embedding + lm_head + final norm of a Llama target (float32 on CPU): what every rank keeps whole."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads = 1 if config.get("tie_word_embeddings") else 2
    return (heads * vocab * hidden + hidden) * element_size


# -- fast: the recipe key and the one-process code path -----------------------------------------
@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["recipe=medusa2"],
            "target.shard=fsdp does not work with drafter.type=medusa2: "
            "it trains LoRA adapters inside the target's layers",
        ),
        (
            ["recipe=draft"],
            "target.shard=fsdp does not work with drafter.type=draft_model: "
            "it copies the target's first decoder layers",
        ),
    ],
    ids=["medusa2", "draft_model"],
)
def test_drafters_that_cannot_use_a_sharded_target_are_refused(overrides, fragment):
    with pytest.raises(UserError) as info:
        load_recipe([*overrides, "target.shard=fsdp"])
    assert fragment in str(info.value)


def test_shard_key_takes_known_values_and_works_with_the_other_drafters():
    with pytest.raises(UserError, match="target.shard='zero3' is not one of none, fsdp"):
        load_recipe(["recipe=eagle3", "target.shard=zero3"])
    for recipe in ("medusa", "eagle", "eagle3", "dflash"):
        assert load_recipe([f"recipe={recipe}", "target.shard=fsdp"]).target.shard == "fsdp"
    # a draft model of its own does not copy the target's layers
    assert (
        load_recipe(["recipe=draft", "target.shard=fsdp", f"drafter.name_or_path={REFERENCE_TARGET}"]).target.shard
        == "fsdp"
    )
    assert load_recipe(["recipe=eagle3_llama3_70b"]).target.shard == "fsdp"


def test_train_refuses_an_unshardable_drafter_in_one_line(tmp_path, capsys):
    args = ["train.py", "recipe=medusa2", "target.shard=fsdp", f"output_dir={tmp_path / 'run'}"]
    done = run_entry_in_process(args, capsys)
    assert_one_line_error(
        done, 2, prefix="error: target.shard=fsdp does not work with drafter.type=medusa2", alone=True
    )
    assert not (tmp_path / "run").exists()


@pytest.fixture
def one_process_group(one_thread):
    """A sharded load (`load_target(..., shard="fsdp")`) forms a one-process group when none exists; it is ended
    afterwards."""
    import torch.distributed as dist

    ours = not dist.is_initialized()
    yield
    if ours and dist.is_initialized():
        dist.destroy_process_group()


def test_one_process_runs_the_sharded_code_path(one_process_group):
    from torch.distributed.tensor import DTensor
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from draftsmith.heads import drafter_class
    from draftsmith.sharding import Lockstep, local_bytes, whole_bytes
    from draftsmith.target import FeatureRequest, TargetShape, load_target, run_target

    sharded, whole = load_target(str(REFERENCE_TARGET), "cpu", shard="fsdp"), load_target(str(REFERENCE_TARGET))
    assert not sharded.training and not any(p.requires_grad for p in sharded.parameters())
    kept_whole = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    for name, parameter in sharded.named_parameters():
        assert isinstance(parameter, DTensor) == (name not in kept_whole), name
    # The decoder layers keep their own class: EAGLE-family drafters rebuild layers by its name.
    assert all(type(layer) is LlamaDecoderLayer for layer in sharded.model.layers)
    drafter = drafter_class("eagle3").from_target(
        drafter_class("eagle3").Config(aux_layers=[0, 1, 2], draft_vocab_size=512), sharded, "target"
    )
    assert drafter.target_modules()[1] is sharded.lm_head
    # which weights: a sharded layer's values read from the checkpoint (no collective), as the whole target holds them
    sharded_shape, whole_shape = TargetShape.of(sharded, str(REFERENCE_TARGET)), TargetShape.of(whole, "whole")
    assert sharded_shape.layer_values is not None
    assert sharded_shape.layer_values == pytest.approx(whole_shape.layer_values)
    assert sharded_shape.embedding_norms == whole_shape.embedding_norms

    assert local_bytes(sharded) == whole_bytes(sharded) == whole_bytes(whole)  # one rank holds every piece
    ids = torch.randint(0, 4096, (2, 19), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    request = FeatureRequest(final=True, layers=(-1, 0, 2), logits=True)
    with torch.no_grad():
        lockstep = Lockstep(sharded)
        mine = lockstep.run(run_target, sharded, ids, mask, request)
        lockstep.finish()
        theirs = run_target(whole, ids, mask, request)
    assert torch.equal(mine.logits, theirs.logits) and torch.equal(mine.final, theirs.final)
    assert all(torch.equal(mine.layers[layer], theirs.layers[layer]) for layer in request.layers)


def gloo_threads() -> list[str]:
    names = (Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir())
    return [name for name in names if name.startswith(("pt_gloo", "gloo"))]


def test_a_sharded_target_leaves_no_gloo_thread_to_die_with_the_interpreter(one_process_group):
    """DTensor's caches keep the mesh and its process group past destroy_process_group; the handler
    that loading a sharded target registers at exit frees them while the interpreter is whole."""
    from draftsmith.sharding import end_process_group, release_device_mesh
    from draftsmith.target import load_target

    sharded = load_target(str(REFERENCE_TARGET), "cpu", shard="fsdp")
    with torch.no_grad():
        sharded(input_ids=torch.tensor([[1, 2, 3]]))  # fills DTensor's sharding caches
    del sharded
    end_process_group()
    assert gloo_threads()  # the group is destroyed, yet its threads run: the caches hold it
    release_device_mesh()
    assert gloo_threads() == []


# -- slow: two ranks, the real entry points ---------------------------------------------------
def train_args(output_dir: Path, data: dict[str, Path], cache: Path, shard: str) -> list[str]:
    return [
        "train.py", "recipe=eagle3", f"target.name_or_path={REFERENCE_TARGET}", f"data.train=[{data['train']}]",
        "data.eval=[]", f"data.cache_dir={cache}", "data.max_length=128", "drafter.ttt_steps=3",
        "train.micro_batch_size=4", "train.max_steps=3", "train.warmup_steps=2", "train.log_every=1",
        "eval.enabled=false", f"target.shard={shard}", f"output_dir={output_dir}",
    ]  # fmt: skip


@pytest.mark.slow
def test_two_ranks_hold_half_the_layers_and_train_the_same_drafter(tmp_path, small_data, token_cache, one_thread):
    whole_run, sharded_run = tmp_path / "whole", tmp_path / "sharded"
    # the unsharded reference: the same train.py on two ranks forked from this process (DDP over gloo, as launched)
    done = run_forked_ranks(train_args(whole_run, small_data, token_cache, "none"), tmp_path / "whole_logs")
    assert done.returncode == 0, done.stderr[-3000:]
    # what is tested: train.py under the shipped launch config with 2 processes (on CPU: DDP over gloo)
    launch = [
        "-m", "accelerate.commands.launch", "--config_file", str(FSDP_LAUNCH), "--num_processes", "2",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29542",
    ]  # fmt: skip
    sharded_args = [*launch, *train_args(sharded_run, small_data, token_cache, "fsdp")]
    done = run_entry(sharded_args, timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]

    whole, sharded = (json.loads((run / "run_summary.json").read_text()) for run in (whole_run, sharded_run))
    assert whole["world_size"] == sharded["world_size"] == 2 and sharded["steps"] == 3
    total = {rank["target_param_bytes"] for rank in whole["ranks"]}.pop()  # every rank: the whole target
    kept = replicated_bytes(json.loads((REFERENCE_TARGET / "config.json").read_text()))
    for rank in sharded["ranks"]:
        # Every decoder-layer tensor splits evenly in two here: exactly half, plus the replicated part.
        assert rank["target_param_bytes"] == kept + (total - kept) // 2, rank
    assert sum(rank["target_param_bytes"] for rank in sharded["ranks"]) == total + kept
    # For this 4-layer target with a 4096 x 256 embedding and lm_head that is 70% of the whole per rank;
    # for Llama-3.1-70B on 8 ranks it is 15% (README "Distributed").
    assert 0.69 < sharded["ranks"][0]["target_param_bytes"] / total < 0.71

    a, b = read_log(whole_run), read_log(sharded_run)
    assert sorted(a) == sorted(b) == list(range(1, 4))
    measured = {"train/tokens_per_s", "train/model_tflops_per_s", "train/mfu", "train/peak_memory_mb"}  # of the machine
    for step in a:
        for key in a[step]:
            if key not in measured and not key.startswith("params/"):  # a rank holds half the sharded target
                assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-6), (step, key)
    final_a, final_b = (load_file(str(run / "final" / "model.safetensors")) for run in (whole_run, sharded_run))
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        torch.testing.assert_close(final_b[name], final_a[name], rtol=1e-6, atol=1e-7)
    for run in (whole, sharded):  # one drafter on both ranks, trained on different data
        rank0, rank1 = sorted(run["ranks"], key=lambda rank: rank["rank"])
        assert rank0["param_checksum"] == pytest.approx(rank1["param_checksum"], rel=1e-9)
        assert rank0["data_checksum"] != rank1["data_checksum"]


@pytest.fixture(scope="module")
def seven(tmp_path_factory) -> Path:
    """Seven conversations: two ranks get 3 and 4, so they make different numbers of forwards."""
    root = tmp_path_factory.mktemp("seven")
    return first_records(corpus_slice(root / "eight.jsonl", "eval", 2), root / "seven.jsonl", 7)


def torchrun(*args: str):
    return run_entry(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
        timeout=300,
        env={"OMP_NUM_THREADS": "1"},
    )


@pytest.mark.slow
def test_two_rank_capture_with_a_sharded_target_writes_the_same_shards(tmp_path, seven, one_thread):
    manifests = {}
    for shard in ("none", "fsdp"):
        recipe = [
            "recipe=eagle3", f"target.name_or_path={REFERENCE_TARGET}", f"data.train=[{seven}]",
            f"data.cache_dir={tmp_path / 'cache'}", "data.max_length=96", "train.micro_batch_size=1",
            "data.capture.shard_tokens=150", f"target.shard={shard}", f"output_dir={tmp_path / shard}",
        ]  # fmt: skip
        if shard == "none":  # the reference: two ranks forked from this process; what is tested under torchrun
            done = run_forked_ranks(["-m", "data_prep.capture", *recipe], tmp_path / "logs")
        else:
            done = torchrun("-m", "data_prep.capture", *recipe)
        assert done.returncode == 0, done.stderr[-3000:]
        manifests[shard] = json.loads((tmp_path / shard / "features" / "manifest.json").read_text())
    per_rank = [sum(s["conversations"] for s in manifests["fsdp"]["shards"] if s["rank"] == rank) for rank in (0, 1)]
    assert per_rank == [3, 4]  # one forward per conversation: rank 0 ran out first and kept step
    assert [(s["file"], s["sha256"]) for s in manifests["fsdp"]["shards"]] == [
        (s["file"], s["sha256"]) for s in manifests["none"]["shards"]
    ]


@pytest.mark.slow
def test_two_rank_regeneration_with_a_sharded_target_writes_the_same_text(tmp_path, seven, one_thread):
    from draftsmith.data_prep.regenerate import regenerate

    def args(output: Path, shard: str) -> list[str]:
        return [
            "recipe=draft", f"drafter.name_or_path={REFERENCE_TARGET}", f"target.name_or_path={REFERENCE_TARGET}",
            f"data.train=[{seven}]", f"data.regenerate.output={output}", "data.regenerate.batch_size=3",
            "data.regenerate.max_new_tokens=12", f"target.shard={shard}", f"output_dir={output}.run",
        ]  # fmt: skip

    single = regenerate(load_recipe(args(tmp_path / "single", "none")))  # one process, the whole target
    done = torchrun("-m", "data_prep.regenerate", *args(tmp_path / "sharded", "fsdp"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "7 conversations in" in done.stdout
        and "(7 generated now, 0 of them ended early at a later prompt" in done.stdout
    )
    parts = sorted(p.name for p in single.directory.glob("part-*"))
    assert parts == ["part-00000.jsonl.gz", "part-00001.jsonl.gz", "part-00002.jsonl.gz"]  # rank 0 made two, rank 1 one
    match, mismatch, errors = filecmp.cmpfiles(single.directory, tmp_path / "sharded", parts, shallow=False)
    assert match == parts, (mismatch, errors)


def test_models_built_under_a_zero3_launch_are_whole():
    """accelerate keeps transformers' ZeRO-3 config alive even with zero3_init_flag false, and
    transformers then builds every model partitioned (the GPU tier's ZeRO-3 launch read the target's
    vocabulary as 0, in training and again in the eval after it); `load_target` and the trainer's
    drafter construction build inside `built_whole`."""
    pytest.importorskip("deepspeed")
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    from draftsmith.sharding import built_whole
    from draftsmith.target import load_target

    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    plugin.zero3_init_flag = False  # as recipes/accelerate/deepspeed_zero3.yaml says
    plugin.set_deepspeed_weakref()
    try:
        assert is_deepspeed_zero3_enabled()  # what transformers' model construction consults
        with built_whole():
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()  # restored for accelerator.prepare
        target = load_target(str(REPO / "demo" / "target"))
        assert target.get_output_embeddings().weight.shape[0] == target.config.vocab_size
        assert is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()
