"""The one way the kit makes a rich `Console`: every line the CLI prints goes through `make_console()`."""

from __future__ import annotations

from rich.console import Console

PIPED_WIDTH = 160
"""Columns a table is laid out in when the output is not a terminal (a pipe, a file, a CI log)."""


def make_console(stderr: bool = False) -> Console:
    """Return a console on stdout (stderr if `stderr`). On a terminal it wraps at the terminal's width; elsewhere it
    never wraps a printed line (`soft_wrap`: the reader's viewer does, and a grep finds a whole line), and lays tables
    out in `PIPED_WIDTH` columns rather than rich's default 80."""
    terminal = Console(stderr=stderr)
    if terminal.is_terminal:
        return terminal
    return Console(stderr=stderr, soft_wrap=True, width=PIPED_WIDTH)
