"""The ``stagedconsumer`` command.

Each subcommand lives in its own module with a ``register(subparsers)`` function
that adds its parser and sets ``handler`` (a callable taking the parsed arguments
and returning an exit code).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

__all__ = ("main",)

Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _registrars() -> list[Registrar]:
    from . import _demo, _offsets, _trace

    return [_demo.register, _offsets.register, _trace.register]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stagedconsumer",
        description="Staged-concurrent ordered message consumption.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in _registrars():
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return int(handler(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
