"""Where the CLI writes: a rich Console that keeps tables whole off a terminal, the ``-q/--quiet`` flag, and the
progress display (`treadle.viz.progress`, imported when a command runs: the parser is built without it).

A Console whose stream is not a terminal (a log file, a pipe) is as wide as the widest table or line rather
than rich's 80 columns, so ``treadle plan > log`` keeps every module path and layout whole. On a terminal it is
rich's, the terminal's width."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any, Callable

WIDE = 10_000  # columns when not on a terminal: wider than any table treadle prints (tables take their own width)


def console(*, stderr: bool = False) -> Any:
    """A `rich.console.Console` on stdout (or stderr): the terminal's width, else `WIDE` columns."""
    from rich.console import Console

    con = Console(stderr=stderr)
    if not con.is_terminal:
        con.width = WIDE
    return con


def add_quiet_flag(parser: argparse.ArgumentParser, *, top_level: bool = False) -> None:
    """`-q/--quiet` on a parser. The top-level parser holds the default (False); sub-commands accept the flag
    too without overriding a top-level one (`treadle -q plan ...` and `treadle plan ... -q` both work)."""
    parser.add_argument("-q", "--quiet", action="store_true", default=False if top_level else argparse.SUPPRESS,
                        help="no progress display")


def is_quiet(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "quiet", False))


@contextlib.contextmanager
def progress(description: str, *, quiet: bool = False, console=None) -> Iterator[Callable[..., None]]:
    """`treadle.viz.progress.progress`: a `report(stage, fraction=None)` shown on a terminal, else a no-op."""
    from ..viz.progress import progress as bar

    with bar(description, quiet=quiet, console=console) as report:
        yield report
