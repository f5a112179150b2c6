"""Released vision-language wrappers whose language model transformers has a causal LM class for (MiniMax-M3's
`minimax_m3_vl`, Inkling's `inkling_mm_model`): a release folder is a target, loaded as that class around the
wrapper's language model and lm_head, proven at load to compute the wrapper's own logits; one whose language model
is not that class's model, or whose logits it does not give, is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith.random_target import RANDOM_TARGET_TOKENIZER_FILES, demo_tokenizer_dir
from draftsmith.target import FeatureRequest, load_target, loaded_config, run_target
from draftsmith.tiny_config import build_config
from tests.helpers import assert_one_line_error, run_entry_in_process, saved_release, train_args, train_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

VIT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
TEXT_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}
# each family's vision (and audio) tower at a tiny size, under its config class's own field names
TOWERS = {
    "minimax_m3_vl": (
        "minimax_m3_vl",
        {"vision_config": VIT},
    ),
    "inkling_mm_model": (
        "inkling_text",
        {
            "vision_config": {"hidden_size": 32, "n_layers": 1, "num_attention_heads": 2, "patch_size": 4},
            "audio_config": {"mel_vocab_size": 8, "n_mel_bins": 4},
        },
    ),
}


def write_release(model_type: str, directory: Path, std: float = 0.2, **shape) -> Path:
    """A tiny release folder of `model_type`'s wrapper as its checkpoints ship (config.json naming the wrapper's
    architecture, its language model under `model.language_model.*`, a vision tower beside it), random weights
    (decisive logits at `std`), the demo target's tokenizer."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    source = demo_tokenizer_dir()
    demo = json.loads((source / "config.json").read_text())
    special = {key: demo[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    text_type, towers = TOWERS[model_type]
    text = build_config(text_type, demo["vocab_size"], special, sliding_window=48, **{**TEXT_SHAPE, **shape})
    towers = {name: {**tower, "text_hidden_size": text.hidden_size} for name, tower in towers.items()}
    config = AutoConfig.for_model(model_type, text_config=text.to_dict(), **towers)
    torch.manual_seed(0)
    release = AutoModelForImageTextToText.from_config(config)
    return saved_release(release, directory, std)


@pytest.mark.parametrize(
    "model_type, causal_lm",
    [("minimax_m3_vl", "MiniMaxM3VLForCausalLM"), ("inkling_mm_model", "InklingForCausalLM")],
)
@pytest.mark.slow
def test_a_release_loads_as_its_language_models_causal_lm_with_the_wrappers_logits_and_taps(
    model_type, causal_lm, tmp_path
):
    """The recipe check lets the release folder through; the target, whole and sharded, is the language model's
    causal LM class, its config naming the wrapper's architecture (what an engine serves from the folder), its
    logits and taps the wrapper's. Inkling's class scales the final state before the lm_head: the bare lm_head on the
    language model's output (what a wrapper with no such class loads as) would not give the wrapper's logits."""
    from transformers import AutoModelForImageTextToText

    from draftsmith.causal_lm import not_a_causal_lm
    from draftsmith.target import local_target_config

    folder = write_release(model_type, tmp_path / model_type)
    assert not_a_causal_lm(local_target_config(str(folder)), str(folder)) is None
    wrapper = AutoModelForImageTextToText.from_pretrained(folder).eval()
    ids = torch.randint(3, wrapper.config.text_config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = wrapper(input_ids=ids, output_hidden_states=True)
        bare = wrapper.lm_head(wrapper.model.language_model(input_ids=ids).last_hidden_state)
    assert torch.equal(bare, expected.logits) == (model_type == "minimax_m3_vl")
    for shard in ("none", "fsdp"):
        target = load_target(str(folder), shard=shard)
        assert type(target).__name__ == ("FSDP" if shard == "fsdp" else "") + causal_lm  # FSDP2 subclasses it
        assert loaded_config(target)["architectures"] == wrapper.config.architectures
        out = run_target(target, ids, request=FeatureRequest(layers=(0, 1)))
        torch.testing.assert_close(out.logits, expected.logits)
        torch.testing.assert_close(out.layers[1], expected.hidden_states[2])


def untokenizable_data(tmp_path: Path, small_data: dict[str, Path]) -> tuple[dict[str, Path], Path]:
    """(a data.train that is no JSONL file, reading which would be refused, with small_data's eval split; an empty
    data.cache_dir): a target refused before the data is read says so, and writes no tokenized cache."""
    broken = tmp_path / "broken.jsonl"
    broken.write_text("this line is no JSON\n")
    cache = tmp_path / "token_cache"
    cache.mkdir()
    return {**small_data, "train": broken}, cache


def test_a_wrapper_whose_language_model_is_not_its_causal_lm_classes_model_is_refused_in_one_line(
    tmp_path, small_data, capsys
):
    """BLIP-2 (`blip-2`) holds a whole causal LM (OPT's) as its language model, not the model OPT's causal LM class
    holds: `train.py` on its folder is refused in one line (exit 2) naming both, before its data.train (no JSONL) is
    read; nothing is trained or tokenized."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = build_config("opt", 256, hidden_size=64, num_hidden_layers=2, ffn_dim=128, word_embed_proj_dim=64)
    config = AutoConfig.for_model(
        "blip-2",
        text_config=text.to_dict(),
        vision_config=VIT,
        qformer_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                        "encoder_hidden_size": 32},
        num_query_tokens=4,
    )  # fmt: skip
    folder = tmp_path / "blip2"
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    for name in RANDOM_TARGET_TOKENIZER_FILES:  # any tokenizer: the load is refused before one is used
        if (demo_tokenizer_dir() / name).is_file():
            shutil.copyfile(demo_tokenizer_dir() / name, folder / name)
    out = tmp_path / "run"
    data, cache = untokenizable_data(tmp_path, small_data)
    args = train_args(out, data, cache, f"target.name_or_path={folder}")
    done = run_entry_in_process(["train.py", *args], capsys)
    line = assert_one_line_error(done, 2, "language model is a OPTForCausalLM, not the OPTModel of OPTForCausalLM")
    assert line.startswith(f"error: cannot load target {str(folder)!r}"), line
    assert not (out / "final").exists() and not list(out.glob("checkpoint-*")) and not list(cache.iterdir())


def test_a_wrapper_whose_logits_its_language_models_causal_lm_does_not_give_is_refused_in_one_line(
    tmp_path, small_data, capsys, monkeypatch
):
    """A wrapper whose forward does on text what its language model's causal LM class does not (here MiniMax-M3's,
    its logits doubled, standing in for such a family) is refused by `train.py` in one line (exit 2) when the target
    loads, naming both classes, and nothing is trained: never a drafter of another model than the wrapper. The target
    loads before the data: its data.train (no JSONL) is not read, nothing is tokenized."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl

    folder = write_release("minimax_m3_vl", tmp_path / "target")
    wrapper_class = modeling_minimax_m3_vl.MiniMaxM3SparseForConditionalGeneration
    own_forward = wrapper_class.forward

    def doubled(self, *args, **kwargs):
        outputs = own_forward(self, *args, **kwargs)
        outputs.logits = outputs.logits * 2
        return outputs

    monkeypatch.setattr(wrapper_class, "forward", doubled)
    out = tmp_path / "run"
    data, cache = untokenizable_data(tmp_path, small_data)
    args = train_args(out, data, cache, f"target.name_or_path={folder}")
    done = run_entry_in_process(["train.py", *args], capsys)
    line = assert_one_line_error(
        done, 2, "its language model as a causal LM (MiniMaxM3VLForCausalLM) does not compute its "
        "MiniMaxM3SparseForConditionalGeneration's logits on text (differs by"
    )  # fmt: skip
    assert line.startswith(f"error: cannot load target {str(folder)!r}"), line
    assert not (out / "final").exists() and not list(out.glob("checkpoint-*")) and not list(cache.iterdir())


@pytest.mark.slow
def test_eagle3_trains_on_a_release_and_decodes_losslessly(tmp_path, small_data, token_cache):
    """`train.py` with `target.name_or_path` a MiniMax-M3 release folder: EAGLE-3 trains against its language model,
    and the eval decodes the target's own tokens."""
    target = write_release("minimax_m3_vl", tmp_path / "target", std=0.08, num_hidden_layers=4)
    final, _ = train_in_process([
        "recipe=eagle3", f"target.name_or_path={target}", f"data.train=[{small_data['train']}]",
        f"eval.data=[{small_data['eval']}]", "data.eval=[]",  # the report's prompts; no split accuracy, unread
        f"data.cache_dir={token_cache}", "data.max_length=64",
        "data.max_conversations=8", "train.micro_batch_size=4", "train.max_steps=2", "train.save_every=0",
        "eval.max_prompts=1", "eval.max_new_tokens=16", "eval.tree=0", "eval.batch_size=1", f"output_dir={tmp_path}",
    ])  # fmt: skip
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["drafter"]["type"] == "eagle3" and (final / "config.json").is_file()
    chains = [rows["chain"] for rows in report["domains"].values()]
    assert chains and all(row["lossless"] is True and row["drafted"] > 0 for row in chains)
