"""Progress bars on long work (training, the eval's decoding, capture, regeneration): tqdm's on a terminal; where
stderr is a file (a batch job, `2> run.log`, a scheduler's log), one whole line per update at most every
`LOG_INTERVAL_S` seconds. tqdm redraws its bar with a carriage return on every update: in a file that is one
line that grows by a bar per update (hundreds of kB over a long run), which no log viewer shows."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm.auto import tqdm

LOG_INTERVAL_S = 30.0


class LogLines:
    """A stream that writes each of tqdm's redraws as a line of its own."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(**settings: Any) -> tqdm:
    """tqdm with `settings` on a terminal; lines into a log otherwise (the module docstring)."""
    if sys.stderr.isatty():
        return tqdm(file=sys.stderr, **settings)
    return tqdm(file=LogLines(sys.stderr), mininterval=LOG_INTERVAL_S, ascii=True, **settings)
