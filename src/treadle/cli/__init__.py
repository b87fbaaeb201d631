"""treadle command line: profile / plan / explain / verify / train / run.

The top layer: each sub-command is a module of this package and exposes ``register(subparsers)``; this file
only assembles them. Sub-command modules set ``func`` on their parser; `main` calls it with the parsed args.

A user error (a TreadleError, or a file that cannot be read) prints one line naming the culprit and exits
with status 2; ``--debug`` (before or after the sub-command) shows the traceback instead; under ``treadle run``
the failed rank's traceback too. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..errors import TreadleError
from .output import add_quiet_flag

# modules whose register(subparsers) adds sub-commands
_SUBCOMMANDS = (
    "treadle.cli.profile",
    "treadle.cli.plan",
    "treadle.cli.cost",
    "treadle.cli.verify",
    "treadle.cli.run",
    "treadle.cli.price",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v for INFO, -vv for DEBUG logs")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    add_quiet_flag(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", required=True)
    for mod_name in _SUBCOMMANDS:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as exc:
            if exc.name == mod_name:  # that layer is not part of this install
                continue
            raise
        mod.register(sub)
    for p in sub.choices.values():  # `treadle plan ... --debug` as well as `treadle --debug plan ...`
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error (treadle run: each failed rank's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (TreadleError, OSError) as exc:
        if args.debug:
            raise
        print(f"treadle {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


def one_line(exc: BaseException) -> str:
    """The first line of an error's message (its culprit), noting when more was left out."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename is not None:
        text = f"{exc.strerror or text}: {exc.filename}"
    first, _, rest = text.partition("\n")
    return first + (" (more with --debug)" if rest.strip() else "")

