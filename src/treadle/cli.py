"""treadle command line: profile / plan / explain / verify / train / run.

Each sub-command lives beside the layer it drives and exposes ``register(subparsers)``; this file only
assembles them. Sub-command modules set ``func`` on their parser; `main` calls it with the parsed args.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .viz.progress import add_quiet_flag

# modules whose register(subparsers) adds sub-commands
_SUBCOMMANDS = (
    "treadle.profile.cli",
    "treadle.planner.cli",
    "treadle.cost.cli",
    "treadle.verify.cli",
    "treadle.run.cli",
    "treadle.planner.price_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v for INFO, -vv for DEBUG logs")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
