"""Progress and logged values as a log file reads them: a bar in a file is whole lines, not carriage-return redraws
on one growing line; log.jsonl keeps small values TensorBoard has."""

from __future__ import annotations

import io

from draftsmith.progress import LogLines, progress_bar
from draftsmith.trainer.step_log import logged


def test_a_bar_into_a_file_writes_whole_lines(capsys):
    """tqdm redrew its bar with a carriage return on every update: a 5,000-step run wrote one line of hundreds of kB
    into a batch job's log. Where stderr is not a terminal (pytest's capture here), each redraw is a line."""
    bar = progress_bar(total=3, desc="train")
    for _ in range(3):
        bar.update(1)
        bar.refresh()
    bar.close()
    written = capsys.readouterr().err
    assert "\r" not in written and written.count("\n") >= 3 and "train" in written and "3/3" in written
    stream = io.StringIO()
    LogLines(stream).write("\rtrain:  50%|#####     | 1/2\r")
    LogLines(stream).write("\r")  # a redraw to nothing writes nothing
    assert stream.getvalue() == "train:  50%|#####     | 1/2\n"


def test_log_jsonl_keeps_significant_figures_and_whole_numbers():
    """At 6 decimals an lr of 5e-7 read 0.0 in log.jsonl where TensorBoard had it."""
    assert logged(5e-7) == 5e-7 and logged(3e-6 / 2) == 1.5e-6
    assert logged(12.345678901) == 12.3456789 and logged(123456789012.0) == 123456789012.0
