"""The head-to-head with speculators reports what its measure stage timed (benchmarks/peer_results.py, split out of
peer_speculators.py): a row per trainer and MT-bench category and `all`, the speed-up over the mean of the two plain
runs, lossless only where every output equals plain's, and draftsmith's own eval, or why it did not run."""

from __future__ import annotations

from types import SimpleNamespace

from tests.test_benchmarks_args import benchmark


def timed(seconds: float, outputs: list[list[int]]) -> dict:
    """A method's timing.json entry: each prompt 10 tokens in `seconds`, 4 drafts of which 2 tokens accepted."""
    one = {"seconds": seconds, "tokens": 10, "metrics": {"num_drafts": 4, "num_accepted_tokens": 2,
                                                         "accepted_per_position": [2]}}  # fmt: skip
    return {"per_prompt": [one] * len(outputs), "outputs": outputs, "load_avg": [0.5, 0.5]}


def test_the_report_rows_divide_by_both_plain_runs_per_category(tmp_path, monkeypatch):
    results = benchmark("peer_results", monkeypatch)
    plain = [[1], [2], [3]]
    timing = {
        "plain": timed(1.0, plain),
        "plain_rerun": timed(0.5, plain),  # twice as fast: the mean of the two plain runs is 15 tokens/s
        "speculators": timed(0.5, plain),
        "draftsmith": timed(0.25, [[1], [2], [9]]),  # the last output differs from plain's
    }
    trained = {name: {"settings": {}, "train_tokens": 100, "train_s": 10.0} for name in ("speculators", "draftsmith")}
    (tmp_path / "speculators" / "mtbench").mkdir(parents=True)
    (tmp_path / "speculators" / "mtbench" / "failed.txt").write_text("draftsmith's eval could not read it")
    args = SimpleNamespace(threads=2)
    rows, own = results.report(args, tmp_path, trained, timing, {"coding": plain[:2], "writing": plain[2:]})
    by = {(row["trainer"], row["category"]): row for row in rows}
    assert sorted(by) == [(trainer, category) for trainer in ("draftsmith", "speculators")
                          for category in ("all", "coding", "writing")]  # fmt: skip
    assert by["speculators", "all"]["speedup"] == round(20 / 15, 4) and by["draftsmith", "all"]["speedup"] == round(
        40 / 15, 4
    )
    assert by["draftsmith", "coding"]["lossless"] and not by["draftsmith", "writing"]["lossless"]
    assert by["speculators", "all"]["tau"] == 1.5 and by["speculators", "all"]["train_tokens_per_s_per_core"] == 5.0
    assert by["speculators", "all"]["own_eval_tau"] == "draftsmith's eval could not read it"
    assert own["draftsmith"] == {"not_run": "the own-eval stage was not run"}
