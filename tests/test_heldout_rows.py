"""train.heldout's rows, as the trainer holds them out (trainer/setup.py `load_data`) and as the eval leaves them out
of what the run trained on (eval/accuracy.py `trained_rows`): the same rows, by one rule (data_prep/dataset.py
`split_heldout_rows`). The eval sliced them by hand, a second copy of the trainer's rule."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from draftsmith.data_prep.dataset import load_tokenized
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


def test_a_conversation_rendered_a_row_per_turn_is_held_out_whole():
    """A thinking template renders a conversation a row per turn (consecutive rows, one `sample`): train.heldout
    counts conversations, so the held-out turn's earlier turns, its context, are not trained on. The tail alone is
    read, in chunks: a data.train longer than one chunk splits where the count says."""
    import datasets

    from draftsmith.data_prep.dataset import split_heldout_rows

    samples = ["a:0", "b:1", "b:1", "c:2", "c:2", "c:2"]
    data = datasets.Dataset.from_dict({"sample": samples, "row": list(range(len(samples)))})
    for count, trained in ((0, 6), (1, 3), (2, 1), (3, 0), (9, 0)):
        kept, held = split_heldout_rows(data, count)
        assert (kept["row"], held["row"]) == (list(range(trained)), list(range(trained, 6))), count
    long = datasets.Dataset.from_dict({"sample": [f"s:{i // 3}" for i in range(9000)]})  # 3000 conversations
    kept, held = split_heldout_rows(long, 1500)
    assert (len(kept), len(held)) == (4500, 4500)
