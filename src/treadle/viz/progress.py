"""Progress of long CLI operations on a terminal (rich), silent when stderr is not a TTY or with --quiet.

    with progress("planning llama-3-8b", quiet=quiet) as report:
        plan_model(..., progress=lambda msg: report(msg))          # a stage text
        profile(..., progress=lambda stage, f: report(stage, f))   # or a stage and a fraction in [0, 1]

Only the CLI uses this (the library reports through its `progress=` callbacks and logging). The bar is
transient: nothing of it stays in the terminal or in redirected output.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

Report = Callable[..., None]


@contextlib.contextmanager
def progress(description: str, *, quiet: bool = False, console=None) -> Iterator[Report]:
    """A `report(stage, fraction=None)` callable that shows `description: stage` and a bar (a spinner while
    the fraction is unknown) on `console` (default: stderr), for the duration of the block. A no-op when
    `quiet` or when the console is not a terminal."""
    from rich.console import Console

    con = console or Console(stderr=True)
    if quiet or not con.is_terminal:
        yield lambda stage="", fraction=None: None
        return
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                  TimeElapsedColumn(), console=con, transient=True) as bar:
        task = bar.add_task(description, total=None)

        def report(stage: str = "", fraction: float | None = None) -> None:
            text = f"{description}: {stage}" if stage else description
            if fraction is None:
                bar.update(task, description=text)
            else:
                bar.update(task, description=text, total=1.0, completed=min(max(fraction, 0.0), 1.0))

        yield report
