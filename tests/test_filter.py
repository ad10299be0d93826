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


@pytest.mark.parametrize(
    "expression",
    ["a && b", "a | b", "tag with space", "a || b c", "a|b", "a*", "a ||| b", "a & b"],
)
def test_other_grammars_are_rejected_naming_the_expression(expression: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        TagFilter.parse(expression)
    assert repr(expression) in str(info.value)
    assert "||" in str(info.value)  # says what the grammar is


@pytest.mark.parametrize("expression", [5, b"a", ["a", "b"]])
def test_non_string_expression_is_a_configuration_error(expression: object) -> None:
    with pytest.raises(ConfigurationError, match="tag expression must be a string"):
        TagFilter.parse(expression)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("expression", "tags"),
    [("TagA", {"TagA"}), ("a||b", {"a", "b"}), ("  a  ||  b.c-d:e  ", {"a", "b.c-d:e"})],
)
def test_rocketmq_grammar_is_accepted(expression: str, tags: set[str]) -> None:
    assert TagFilter.parse(expression).tags == frozenset(tags)


def test_subscribe_rejects_a_bad_expression_at_once() -> None:
    from stagedconsumer import MemoryBroker, MessageListenerConcurrently, PushConsumer

    class Listener(MessageListenerConcurrently):
        async def consume_message(self, msgs: object, context: object) -> None:
            pass

    broker = MemoryBroker()
    broker.create_topic("t", 1)
    consumer = PushConsumer("g", broker, Listener())
    with pytest.raises(ConfigurationError, match="'a && b'"):
        consumer.subscribe("t", "a && b")
