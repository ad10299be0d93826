"""Tag expressions of ``subscribe(topic, expression)``: ``"*"`` or ``"a || b || c"``.

RocketMQ's ``TAG`` grammar, and nothing else::

    expression := "*" | tag ( "||" tag )*
    tag        := one or more characters, none of them whitespace, "|", "&" or "*"

Spaces around ``||`` are allowed; an empty expression (or ``None``) means ``"*"``.
Anything else (``"a && b"``, ``"a | b"``, ``"tag with space"``, a tag ``"a*"``,
RocketMQ's SQL92 filters) raises :class:`~stagedconsumer.ConfigurationError` naming
the expression, instead of being taken as one literal tag that no message carries.
"""

from __future__ import annotations

import attrs

from ._exceptions import ConfigurationError
from ._message import TAG as _TAG
from ._message import Message

__all__ = ("TagFilter",)

_GRAMMAR = "expected '*' or tags separated by '||', e.g. 'TagA || TagB'"


def _reject(expression: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"invalid tag expression {expression!r}: {why}; {_GRAMMAR}")


@attrs.frozen
class TagFilter:
    """Accepts every message (``"*"``) or those whose tag is one of ``tags``."""

    expression: str
    tags: frozenset[str] | None

    @classmethod
    def parse(cls, expression: str | None) -> TagFilter:
        """Parse ``"*"`` (or empty/``None``: everything) or ``"tag1 || tag2"``."""
        if expression is None:
            return cls("*", None)
        if not isinstance(expression, str):
            raise ConfigurationError(
                f"tag expression must be a string such as '*' or 'TagA || TagB',"
                f" got {type(expression).__name__} {expression!r}"
            )
        if expression.strip() in ("", "*"):
            return cls("*", None)
        parts = [part.strip() for part in expression.split("||")]
        for part in parts:
            if not part:
                raise _reject(expression, "an empty tag around '||'")
            if part == "*":
                raise _reject(expression, "'*' cannot be combined with tags")
            if not _TAG.fullmatch(part):
                if "&" in part or "|" in part:
                    why = f"{part!r} uses an operator other than '||'"
                elif "*" in part:
                    why = f"{part!r}: '*' is not a wildcard inside a tag"
                else:
                    why = f"{part!r} contains whitespace (a tag cannot)"
                raise _reject(expression, why)
        return cls(expression, frozenset(parts))

    @property
    def accepts_all(self) -> bool:
        return self.tags is None

    def __call__(self, message: Message) -> bool:
        tags = self.tags
        return tags is None or message.tags in tags
