"""Tag expressions of ``subscribe(topic, expression)``: ``"*"`` or ``"a || b || c"``."""

from __future__ import annotations

import attrs

from ._exceptions import ConfigurationError
from ._message import Message

__all__ = ("TagFilter",)


@attrs.frozen
class TagFilter:
    """Accepts every message (``"*"``) or those whose tag is one of ``tags``."""

    expression: str
    tags: frozenset[str] | None

    @classmethod
    def parse(cls, expression: str | None) -> TagFilter:
        """Parse ``"*"`` (or empty/``None``: everything) or ``"tag1 || tag2"``."""
        if expression is None or expression.strip() in ("", "*"):
            return cls("*", None)
        if not isinstance(expression, str):
            raise ConfigurationError(f"tag expression must be a string, got {expression!r}")
        parts = [part.strip() for part in expression.split("||")]
        if any(not part for part in parts):
            raise ConfigurationError(
                f"malformed tag expression {expression!r}: expected 'tag' or 'tag1 || tag2'"
            )
        if "*" in parts:
            raise ConfigurationError(
                f"'*' cannot be combined with tags in expression {expression!r}"
            )
        return cls(expression, frozenset(parts))

    @property
    def accepts_all(self) -> bool:
        return self.tags is None

    def __call__(self, message: Message) -> bool:
        tags = self.tags
        return tags is None or message.tags in tags
