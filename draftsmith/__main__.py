"""`python -m draftsmith COMMAND ...`: the `draftsmith` command, also as a module, so several processes
start from an installed wheel: `accelerate launch -m draftsmith train recipe=NAME ...`."""

from draftsmith.cli import main

if __name__ == "__main__":
    main()
