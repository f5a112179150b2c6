"""What loading a checkpoint (trainer/checkpoint.py `load_checkpoint`) can find wrong with one of its files, said in
one line naming the file: torch's and safetensors' own errors name none (`failed finding central directory`,
`OSError: [Errno 22] Invalid argument`, `incomplete metadata, file not fully covered`)."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Optional

from safetensors import SafetensorError

from draftsmith.errors import UserError, one_line

log = logging.getLogger("draftsmith.train")

# What torch's and safetensors' readers raise for a file cut short or changed (torch's zip reader: RuntimeError, or
# OSError EINVAL when a cut leaves a record pointing past the end; a file of no bytes: EOFError). A pickle torch's safe
# unpickler refuses (pickle.UnpicklingError) is not among them: wherever it is met, `unsafe_pickle` names it.
UNREADABLE = (SafetensorError, EOFError, RuntimeError, OSError)


def unreadable_file(path: Path) -> Optional[Path]:
    """The first of checkpoint `path`'s weights and pickles that does not load on its own (None: each does), for the
    line of a checkpoint that failed to load; read only on that failure (the optimizer's state is the model's size
    twice over). A pickle the safe unpickler refuses met first is `unsafe_pickle`'s line, raised."""
    from accelerate.utils import load
    from safetensors.torch import load_file

    for file in sorted([*path.glob("*.safetensors"), *path.glob("*.bin"), *path.glob("*.pkl")]):
        try:
            load_file(file) if file.suffix == ".safetensors" else load(file, map_location="cpu")
        except pickle.UnpicklingError:
            raise unsafe_pickle(path, [file]) from None
        except UNREADABLE:
            return file
    return None


def unsafe_pickle(path: Path, files: list[Path]) -> UserError:
    """The line naming the first of `files` torch's safe unpickler refuses (torch names none, says to unpickle)."""
    from accelerate.utils import load

    refused = None
    for file in files:
        try:
            load(file, map_location="cpu")
        except pickle.UnpicklingError:
            refused = refused or file
    return UserError(
        f"checkpoint {path}: {refused or 'a file of it'} holds more than tensors and plain values (damaged, or not a "
        "file draftsmith saved), and draftsmith does not unpickle more (that can run code it holds): give another one"
    )


def check_random_states(rank: int, path: Path) -> None:
    """This rank's random states, which accelerate skips when they do not load (an INFO line, on rank 0 alone): a
    missing file (saved by fewer ranks) is a warning naming it; one that does not load, or was not applied, refused."""
    import random

    from accelerate.utils import load

    file = path / f"random_states_{rank}.pkl"
    if not file.is_file():
        log.warning("checkpoint %s holds no %s: rank %d's random numbers are not restored, so its random draws "
                    "differ from an uninterrupted run's", path, file.name, rank)  # fmt: skip
        return
    try:
        restored = load(file)["random_state"] == random.getstate()
    except pickle.UnpicklingError:
        raise unsafe_pickle(path, [file]) from None
    except (OSError, EOFError, RuntimeError, KeyError, TypeError) as err:
        raise UserError(f"checkpoint {path}: {file} does not hold random states ({one_line(err)})") from None
    if not restored:
        raise UserError(f"checkpoint {path}: {file} does not hold random states that accelerate restores")
