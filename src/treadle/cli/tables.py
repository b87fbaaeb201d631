"""Where the CLI prints its tables: a rich Console that, when its stream is not a terminal (a log file, a pipe),
is as wide as the widest table or line rather than rich's 80 columns, so ``treadle plan > log`` keeps every
module path and layout whole. On a terminal it is rich's, the terminal's width."""

from __future__ import annotations

from typing import Any

WIDE = 10_000  # columns when not on a terminal: wider than any table treadle prints (tables take their own width)


def console(*, stderr: bool = False) -> Any:
    """A `rich.console.Console` on stdout (or stderr): the terminal's width, else `WIDE` columns."""
    from rich.console import Console

    con = Console(stderr=stderr)
    if not con.is_terminal:
        con.width = WIDE
    return con
