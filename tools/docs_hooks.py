"""MkDocs hooks of the documentation site (``hooks:`` in ``mkdocs.yml``).

``<!-- cli-help -->`` in a page becomes the ``--help`` of every command of the
``stagedconsumer`` CLI, taken from the parser itself, so the reference cannot drift
from the code.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any

MARKER = "<!-- cli-help -->"
WIDTH = "74"  # lines of at most 72 characters: the width of the page's code blocks


def _commands(
    parser: argparse.ArgumentParser, words: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*words, name))


def cli_reference() -> str:
    """Markdown: a section with the help text of each command, in the order of the parser."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH  # the help is wrapped to the terminal; fix its width
    try:
        from stagedconsumer._cli import build_parser

        sections = []
        for words, parser in _commands(build_parser()):
            title = " ".join(("stagedconsumer", *words))
            level = "#" * min(2 + len(words), 4) if words else "##"
            shown = parser.format_help().rstrip()
            sections.append(f"{level} `{title}`\n\n```text\n$ {title} --help\n{shown}\n```")
        return "\n\n".join(sections)
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_reference())
    return markdown
