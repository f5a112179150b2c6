"""Bad input is the user's problem to fix, not ours to debug: one line on stderr and exit code 2."""
from __future__ import annotations

import sys
from typing import Callable, NoReturn, Sequence


class UserError(Exception):
    """Input the user can fix (a recipe key, a data file, a checkpoint). Reported as one line, exit 2."""


def run_cli(main: Callable[[Sequence[str]], object], argv: Sequence[str] | None = None) -> NoReturn:
    """Run an entry point; a UserError becomes `error: <message>` on stderr and exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        main(argv)
    except UserError as err:
        message = " ".join(str(err).split())  # one line, whatever the message held
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(0)
