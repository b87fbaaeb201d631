"""The start of ``python -m treadle.run`` on one rank: its command line, its settings and the checks that need no
process group (`precheck`), before torch.distributed, the model or the data load."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import TreadleError
from .config import DEBUG_ENV, LAUNCHER_ENV, RunConfig, add_arguments, config_from_args

DESCRIPTION = "The training entry point torchrun launches on every rank (see treadle.run)."


def say_once(line: str) -> None:
    """A note of the settings, said by rank 0 alone, and not at all under `treadle run` (its launcher says it)."""
    if os.environ.get("RANK", "0") == "0" and os.environ.get(LAUNCHER_ENV) != "1":
        print(line, file=sys.stderr, flush=True)


def settings(argv: list[str] | None = None) -> RunConfig | int:
    """This rank's settings from its command line, checked against the job's world size (``WORLD_SIZE``) before
    anything is built; or the exit status of a settings error, said once for the job
    (`failure.report_before_start`)."""
    p = argparse.ArgumentParser(prog="python -m treadle.run", description=DESCRIPTION)
    add_arguments(p)
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("--debug", action="store_true", help="a failed rank writes its traceback (user errors too)")
    args = p.parse_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # read by `failure` when this rank fails
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args, say=say_once)
        from .precheck import check_before_start

        world = os.environ.get("WORLD_SIZE", "")
        check_before_start(cfg, world=int(world) if world.isdigit() else None)
    except TreadleError as exc:
        from .failure import report_before_start

        return report_before_start(exc)
    return cfg
