"""A griffe extension for the API reference: the docstrings' reST inline markup as
Markdown, so that ``:class:`~stagedconsumer.PushConsumer``` reads as ``PushConsumer``
in code font (the same text ``stagedconsumer --help`` shows, see
``stagedconsumer._cli.plain_text``)."""

from __future__ import annotations

import re
from typing import Any

import griffe

# :class:`~a.b.C`  :meth:`C.m`  :ref:`text <target>`  (the roles the docstrings use)
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(?:([^`<]*?)\s*<[^`>]*>|(~?)([^`]*))`")


def markdown_of(text: str) -> str:
    """``text`` with reST roles made Markdown code spans."""

    def role(match: re.Match[str]) -> str:
        if match.group(1) is not None:
            return match.group(1)
        target = match.group(3)
        if match.group(2):
            target = target.rsplit(".", 1)[-1]
        return f"`{target}`"

    return _ROLE.sub(role, text)


class RestRoles(griffe.Extension):
    """Rewrite every docstring's reST roles when griffe loads an object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_of(obj.docstring.value)
