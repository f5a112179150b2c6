"""train.heldout's rows, as the trainer holds them out (trainer/setup.py `load_data`) and as the eval leaves them out
of what the run trained on (eval/accuracy.py `trained_rows`): the same rows, by one rule (data_prep/dataset.py
`split_heldout_rows`). The eval sliced them by hand, a second copy of the trainer's rule."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from draftsmith.data_prep import load_tokenized
from draftsmith.eval.accuracy import trained_rows
from draftsmith.recipe import load_recipe
from draftsmith.target import load_tokenizer
from draftsmith.trainer.setup import load_data
from tests.helpers import train_args


def test_the_eval_leaves_out_the_rows_the_trainer_held_out(tmp_path, small_data, token_cache):
    cfg = load_recipe(train_args(tmp_path / "run", small_data, token_cache, "train.heldout=5", "data.eval=[]"))
    tokenizer = load_tokenizer(cfg.target)
    one_process = SimpleNamespace(main_process_first=contextlib.nullcontext, is_main_process=True, num_processes=1)
    trained, _, heldout, _ = load_data(cfg, one_process, tokenizer, {})
    whole = load_tokenized(cfg, cfg.data.train, tokenizer, "data.train", {})

    def rows(dataset) -> list[list[int]]:
        return dataset.to_dict()["input_ids"]

    assert len(heldout) == 5 and rows(trained) + rows(heldout) == rows(whole)
    assert rows(trained_rows(cfg, tokenizer, {})) == rows(trained)
