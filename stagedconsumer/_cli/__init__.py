"""The ``stagedconsumer`` command.

Each subcommand lives in its own module with a ``register(subparsers)`` function
that adds its parser and sets ``handler`` (a callable taking the parsed arguments
and returning an exit code). Descriptions may be module docstrings: their reST
markup (````literal````, ``:class:`~x.Name```) is turned into plain text for the
terminal here, once, for every parser.

Exit codes: 0 success (and ``--help``, ``--version``), 1 a command that failed,
2 a usage error (no command, an unknown command, bad arguments). A command whose
stdout reader went away (``stagedconsumer group show ... | head -4``) exits 1
quietly, without a traceback: :func:`main` handles that for every command.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn, cast

from .._version import __version__

__all__ = ("build_parser", "main", "plain_text")

Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(?:([^`<]*?)\s*<[^`>]*>|~?([^`]*))`")
_LITERAL = re.compile(r"``(.+?)``", re.S)


def plain_text(text: str) -> str:
    """``text`` with reST inline markup made plain: ````x```` -> ``x``,
    ``:class:`~a.b.C``` -> ``C``, ``:func:`a.b``` -> ``a.b``, ``:ref:`t <x>``` -> ``t``."""

    def role(match: re.Match[str]) -> str:
        if match.group(1) is not None:
            return match.group(1)
        target = match.group(2)
        whole = match.group(0)
        return target.rsplit(".", 1)[-1] if "`~" in whole else target

    return _LITERAL.sub(r"\1", _ROLE.sub(role, text))


def _registrars() -> list[Registrar]:
    from . import _demo, _group, _offsets, _run, _trace

    return [_demo.register, _group.register, _offsets.register, _run.register, _trace.register]


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors also say where the help is."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\nRun '{self.prog} --help' for help.\n")


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _parsers(sub)


def _refill(text: str) -> str:
    """Re-wrap the plain paragraphs of ``text`` to the terminal's width (the markup
    removed, a docstring's lines are ragged); indented blocks and lists stay."""
    width = max(40, min(shutil.get_terminal_size().columns - 2, 88))
    paragraphs = []
    for paragraph in text.strip().split("\n\n"):
        lines = paragraph.splitlines()
        if any(line[:1].isspace() or line.startswith(("- ", "* ")) for line in lines):
            paragraphs.append(paragraph)
        else:
            paragraphs.append(textwrap.fill(" ".join(lines), width))
    return "\n\n".join(paragraphs)


def _make_plain(parser: argparse.ArgumentParser) -> None:
    for each in _parsers(parser):
        if each.description:
            each.description = _refill(plain_text(each.description))
            each.formatter_class = argparse.RawDescriptionHelpFormatter
        if each.epilog:
            each.epilog = plain_text(each.epilog)
        for action in each._actions:
            if action.help and action.help is not argparse.SUPPRESS:
                action.help = plain_text(action.help)
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    if choice.help:
                        choice.help = plain_text(choice.help)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stagedconsumer",
        description=(
            "Staged-concurrent ordered message consumption (Apache RocketMQ's RIP-22)"
            " on anyio: messages inside a stage run concurrently, stage k + 1 starts"
            " only after every message of stage k has finished."
        ),
        epilog=(
            "Run 'stagedconsumer COMMAND --help' for the options of a command,"
            " e.g. 'stagedconsumer demo --help'."
        ),
    )
    parser.add_argument(
        "-V",
        "--version",
        action="version",
        version=f"%(prog)s {__version__}",
        help="print the version and exit",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)"
    )
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", title="commands", parser_class=_Parser
    )
    for register in _registrars():
        # _Parser is an ArgumentParser: the registrars add parsers of that class
        register(cast("argparse._SubParsersAction[argparse.ArgumentParser]", subparsers))
    _make_plain(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command of ``argv`` (default ``sys.argv[1:]``); its exit code.

    A closed stdout (the reader of a pipe exited early) ends any command quietly
    with exit code 1, after the recipe in Python's ``signal`` documentation ("Note
    on SIGPIPE"): stdout is flushed here, where the error can still be caught
    (output still in the buffer would otherwise fail at interpreter exit, with a
    message), then pointed at ``os.devnull`` so that the flush at exit cannot fail.
    rich's consoles (the tables) apply the same recipe, with the same exit code,
    when their own write fails.
    """
    try:
        try:
            code = _main(argv)
        except SystemExit:  # --help, --version, a usage error: their output too
            sys.stdout.flush()
            raise
        sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
        return 1
    return code


def _discard_stdout() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced (tests) or closed: nothing to do
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = getattr(args, "handler", None)
    if handler is None:  # no command: the help, with the commands, as a usage error
        parser.print_help()
        return 2
    return int(handler(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
