from __future__ import annotations

import pytest

from stagedconsumer import ConfigurationError, Message
from stagedconsumer._filter import TagFilter


def message(tags: str | None) -> Message:
    return Message(topic="t", queue_id=0, queue_offset=0, body=b"", tags=tags)


@pytest.mark.parametrize("expression", ["*", "", " * ", None])
def test_star_accepts_everything(expression: str | None) -> None:
    f = TagFilter.parse(expression)
    assert f.accepts_all
    assert f(message(None))
    assert f(message("x"))


def test_or_expression() -> None:
    f = TagFilter.parse("a || b")
    assert f(message("a"))
    assert f(message("b"))
    assert not f(message("c"))
    assert not f(message(None))


@pytest.mark.parametrize("expression", ["a ||", "|| b", "a || || b", "a || *"])
def test_malformed_expressions(expression: str) -> None:
    with pytest.raises(ConfigurationError, match="expression"):
        TagFilter.parse(expression)
