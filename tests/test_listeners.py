"""Listener methods whose shape cannot work are refused when the consumer is built
(:class:`~stagedconsumer.MessageListener`'s rule), and valid shapes, odd ones
included, are accepted and called."""

from __future__ import annotations

import functools
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import pytest

from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumeMessageContext,
    ConsumeMessageHook,
    ConsumeMessageTraceHook,
    ListenerTypeError,
    MemoryBroker,
    Message,
    MessageListener,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    Ordering,
    Producer,
    PushConsumer,
    SendMessageContext,
    SendMessageHook,
    SendMessageTraceHook,
)

KINDS = {
    "concurrently": MessageListenerConcurrently,
    "orderly": MessageListenerOrderly,
    "staged": MessageListenerStagedConcurrently,
}


def _stages(self: object) -> Sequence[int]:
    return [2]


def listener_of(kind: type[MessageListener], **methods: object) -> MessageListener:
    """An instance of a subclass of ``kind`` named ``Bad`` with ``methods``."""
    namespace: dict[str, object] = {"consume_message": _fine}
    if kind is MessageListenerStagedConcurrently:
        namespace["get_stage_definitions"] = _stages
    namespace.update(methods)
    listener: MessageListener = type("Bad", (kind,), namespace)()
    return listener


def build(listener: MessageListener) -> PushConsumer:
    return PushConsumer("g", MemoryBroker(), listener)


async def _fine(self: object, msgs: Sequence[Message], context: object) -> None:
    pass


# -- consume_message shapes that never work -------------------------------------------


async def _no_context(self: object, msgs: Sequence[Message]) -> None:
    pass


def _extra_required(self: object, msgs: Sequence[Message], context: object, extra: int) -> None:
    pass


def _keyword_only_required(
    self: object, msgs: Sequence[Message], context: object, *, retries: int
) -> None:
    pass


def _no_self(msgs: Sequence[Message], context: object) -> None:
    pass


async def _async_generator(self: object, msgs: Sequence[Message], context: object) -> Any:
    yield None


def _generator(self: object, msgs: Sequence[Message], context: object) -> Any:
    yield None


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize(
    ("method", "fragment"),
    [
        pytest.param(
            _no_context,
            r"Bad\.consume_message\(self, msgs\) cannot be called as"
            r" consume_message\(msgs, context\) \(too many positional arguments\); expected"
            r" async def or def consume_message\(self, msgs, context\)$",
            id="missing context",
        ),
        pytest.param(
            _extra_required,
            r"Bad\.consume_message\(self, msgs, context, extra\) cannot be called as"
            r" consume_message\(msgs, context\) \(missing a required argument: 'extra'\)",
            id="extra required parameter",
        ),
        pytest.param(
            _keyword_only_required,
            r"\(missing a required argument: 'retries'\)",
            id="keyword-only required parameter",
        ),
        pytest.param(
            _no_self,
            r"Bad\.consume_message\(msgs, context\) cannot be called as consume_message\(msgs,"
            r" context\) \(too many positional arguments\) \(is self missing\? a method's first"
            r" parameter receives the listener\)",
            id="no self",
        ),
        pytest.param(
            _async_generator,
            r"Bad\.consume_message is an async generator function \(its body has yield\).*"
            r" expected async def or def consume_message\(self, msgs, context\) without yield",
            id="async generator",
        ),
        pytest.param(
            _generator,
            r"Bad\.consume_message is a generator function \(its body has yield\)",
            id="generator",
        ),
    ],
)
def test_consume_message_of_the_wrong_shape_is_refused_at_construction(
    kind: type[MessageListener], method: Callable[..., Any], fragment: str
) -> None:
    with pytest.raises(ListenerTypeError, match=fragment):
        build(listener_of(kind, consume_message=method))


# -- valid shapes ---------------------------------------------------------------------


async def _star_args(self: object, *args: Any) -> None:
    pass


async def _extra_with_defaults(
    self: object, msgs: Sequence[Message], context: object, extra: int = 1, *, kw: int = 2
) -> None:
    pass


async def _static(msgs: Sequence[Message], context: object) -> None:
    pass


async def _three(msgs: Sequence[Message], context: object, extra: int) -> None:
    pass


class _CallableObject:
    async def __call__(self, msgs: Sequence[Message], context: object) -> None:
        pass


def _injecting(
    handler: Callable[..., Awaitable[None]],
) -> Callable[[object, Sequence[Message], object], Awaitable[None]]:
    """A decorator whose wrapper takes (self, msgs, context) while what it wraps takes
    more: the wrapper is what is called, so its signature is what counts."""

    @functools.wraps(handler)
    async def wrapper(self: object, msgs: Sequence[Message], context: object) -> None:
        await handler(self, msgs, context, "injected")

    return wrapper


@_injecting
async def _decorated(self: object, msgs: Sequence[Message], context: object, db: str) -> None:
    pass


async def _class_method(cls: type, msgs: Sequence[Message], context: object) -> None:
    pass


VALID: dict[str, object] = {
    "*args": _star_args,
    "defaults and keyword-only defaults": _extra_with_defaults,
    "functools.partial": staticmethod(functools.partial(_three, extra=3)),
    "callable object": _CallableObject(),
    "staticmethod": staticmethod(_static),
    "bound method of another object": staticmethod(_fine.__get__(object())),
    "classmethod": classmethod(_class_method),
    "decorated": _decorated,
    "no readable signature": staticmethod(print),  # a builtin: accepted unchecked
}


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("method", VALID.values(), ids=VALID.keys())
def test_valid_consume_message_shapes_are_accepted(
    kind: type[MessageListener], method: object
) -> None:
    build(listener_of(kind, consume_message=method))


@pytest.mark.anyio
@pytest.mark.parametrize(
    "shape",
    [
        "*args",
        "defaults",
        "partial",
        "async partial",
        "callable object",
        "async callable object",
        "decorated",
        "bound",
    ],
)
async def test_valid_odd_shapes_are_called_with_msgs_and_context(shape: str) -> None:
    seen: list[tuple[int, object]] = []
    threads: set[threading.Thread] = set()

    def record(msgs: Sequence[Message], context: object, **unused: object) -> None:
        seen.extend((m.queue_offset, context) for m in msgs)
        threads.add(threading.current_thread())

    async def record_async(msgs: Sequence[Message], context: object, **unused: object) -> None:
        record(msgs, context)

    async def star(self: object, *args: Any) -> None:
        record(*args)

    async def defaults(
        self: object, msgs: Sequence[Message], context: object, extra: int = 1, *, kw: int = 2
    ) -> None:
        record(msgs, context)

    class Recorder:
        def __call__(self, msgs: Sequence[Message], context: object) -> None:
            record(msgs, context)

        async def handle(self, msgs: Sequence[Message], context: object) -> None:
            record(msgs, context)

    class AsyncRecorder:
        async def __call__(self, msgs: Sequence[Message], context: object) -> None:
            record(msgs, context)

    @_injecting
    async def decorated(self: object, msgs: Sequence[Message], context: object, db: str) -> None:
        assert db == "injected"
        record(msgs, context)

    method = {
        "*args": star,
        "defaults": defaults,
        "partial": staticmethod(functools.partial(record, extra=None)),  # a worker thread
        "async partial": staticmethod(functools.partial(record_async, extra=None)),
        "callable object": Recorder(),  # a worker thread
        "async callable object": AsyncRecorder(),  # awaited on the event loop
        "decorated": decorated,
        "bound": staticmethod(Recorder().handle),  # a bound method of another object
    }[shape]
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for i in range(3):
        broker.send("t", str(i).encode(), queue_id=0)
    listener = listener_of(MessageListenerConcurrently, consume_message=method)
    consumer = PushConsumer("g", broker, listener)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert consumer.statistics().consumed_ok == 3
    assert sorted(offset for offset, _ in seen) == [0, 1, 2]
    assert all(isinstance(context, ConsumeConcurrentlyContext) for _, context in seen)
    on_the_loop = shape not in ("partial", "callable object")  # those are plain def
    assert (threads == {threading.current_thread()}) is on_the_loop, threads


# -- the callbacks the consumer calls -----------------------------------------------------


async def _async_strategy(self: object, msg: Message) -> str:
    return "default"


class _AsyncStrategy:
    async def __call__(self, msg: Message) -> str:
        return "default"


def _generator_group(self: object, msg: Message) -> Any:
    yield "g"


@pytest.mark.parametrize(
    ("methods", "fragment"),
    [
        pytest.param(
            {"compute_strategy": lambda self: "default"},
            r"Bad\.compute_strategy\(self\) cannot be called as compute_strategy\(msg\) \(too"
            r" many positional arguments\); expected def compute_strategy\(self, msg\)$",
            id="compute_strategy without msg",
        ),
        pytest.param(
            {"compute_strategy": _async_strategy},
            r"Bad\.compute_strategy is async def: the consumer calls compute_strategy\(msg\)"
            r" synchronously",
            id="async compute_strategy",
        ),
        pytest.param(
            {"compute_strategy": _AsyncStrategy()},
            r"Bad\.compute_strategy is async def: the consumer calls compute_strategy\(msg\)"
            r" synchronously",
            id="callable object with an async __call__ as compute_strategy",
        ),
        pytest.param(
            {"compute_group": _generator_group},
            r"Bad\.compute_group is a generator function",
            id="generator compute_group",
        ),
        pytest.param(
            {"reset_current_stage_offset_if_need": lambda self, current: current},
            r"cannot be called as reset_current_stage_offset_if_need\(topic, current\)",
            id="reset without topic",
        ),
        pytest.param(
            {"get_stage_definitions": lambda self, topic: [2]},
            r"Bad\.get_stage_definitions\(self, topic\) cannot be called as"
            r" get_stage_definitions\(\)",
            id="get_stage_definitions with a parameter",
        ),
        pytest.param(
            {"get_stage_definition_strategies": lambda self, topic: {"default": [2]}},
            r"cannot be called as get_stage_definition_strategies\(\)",
            id="get_stage_definition_strategies with a parameter",
        ),
        pytest.param(
            {"compute_strategy": 5},
            r"Bad\.compute_strategy must be a method \(def compute_strategy\(self, msg\)\), got"
            r" int 5",
            id="compute_strategy not callable",
        ),
    ],
)
def test_stage_callbacks_of_the_wrong_shape_are_refused(
    methods: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ListenerTypeError, match=fragment):
        build(listener_of(MessageListenerStagedConcurrently, **methods))


def test_only_callbacks_the_consumer_calls_are_checked() -> None:
    # get_stage_definitions is never called once the strategies are overridden
    build(
        listener_of(
            MessageListenerStagedConcurrently,
            get_stage_definitions=lambda self, unused: [2],
            get_stage_definition_strategies=lambda self: {"default": [2]},
        )
    )
    # compute_key is called only with Ordering.BY_KEY
    wrong_key = {"compute_key": lambda self: None}
    build(listener_of(MessageListenerOrderly, **wrong_key))
    with pytest.raises(ListenerTypeError, match=r"Bad\.compute_key\(self\) cannot be called"):
        build(listener_of(MessageListenerOrderly, ordering=Ordering.BY_KEY, **wrong_key))
    # valid odd shapes of callbacks pass
    build(
        listener_of(
            MessageListenerStagedConcurrently,
            compute_strategy=staticmethod(lambda msg: "default"),
            compute_group=lambda self, msg, *rest: None,
            reset_current_stage_offset_if_need=lambda self, topic, current, extra=0: current,
        )
    )


def test_strategies_without_default_need_a_compute_strategy() -> None:
    def strategies(self: object) -> Mapping[str, Sequence[int]]:
        return {"vip": [1], "bulk": [5]}

    with pytest.raises(
        ConfigurationError,
        match=r"Bad\.get_stage_definition_strategies\(\) has no 'default' strategy \(it has"
        r" 'bulk', 'vip'\), and the default compute_strategy\(\) picks 'default' for every"
        r" message: add it, or override compute_strategy",
    ):
        build(
            listener_of(
                MessageListenerStagedConcurrently, get_stage_definition_strategies=strategies
            )
        )
    build(
        listener_of(
            MessageListenerStagedConcurrently,
            get_stage_definition_strategies=strategies,
            compute_strategy=lambda self, msg: "vip",
        )
    )


def test_the_checks_do_not_call_anything() -> None:
    calls: list[str] = []

    def strategy(self: object, msg: Message) -> str:
        calls.append("compute_strategy")
        return "default"

    build(listener_of(MessageListenerStagedConcurrently, compute_strategy=strategy))
    assert calls == []


# -- hooks ---------------------------------------------------------------------------------


class _AsyncBefore(ConsumeMessageHook):
    async def consume_message_before(self, context: ConsumeMessageContext) -> None:  # type: ignore[override]
        pass

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        pass


class _PulledWithoutContext(ConsumeMessageHook):
    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        pass

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        pass

    def messages_pulled(self) -> None:  # type: ignore[override]
        pass


class _AsyncAfterSend(SendMessageHook):
    def send_message_before(self, context: SendMessageContext) -> None:
        pass

    async def send_message_after(self, context: SendMessageContext) -> None:  # type: ignore[override]
        pass


def test_hooks_of_the_wrong_shape_are_refused_when_registered() -> None:
    # an async def hook method would return a coroutine that never runs: nothing
    # would be traced, with only a RuntimeWarning to show for it
    consumer = build(listener_of(MessageListenerConcurrently))
    with pytest.raises(
        ListenerTypeError,
        match=r"_AsyncBefore\.consume_message_before is async def: the consumer calls"
        r" consume_message_before\(context\) synchronously, so the coroutine it returns"
        r" would never run",
    ):
        consumer.register_consume_message_hook(_AsyncBefore())
    with pytest.raises(
        ListenerTypeError,
        match=r"_PulledWithoutContext\.messages_pulled\(self\) cannot be called as"
        r" messages_pulled\(context\)",
    ):
        consumer.register_consume_message_hook(_PulledWithoutContext())
    with pytest.raises(ConfigurationError, match="hook must be a ConsumeMessageHook, got str"):
        consumer.register_consume_message_hook("trace")  # type: ignore[arg-type]
    producer = Producer(MemoryBroker())
    with pytest.raises(
        ListenerTypeError, match=r"_AsyncAfterSend\.send_message_after is async def"
    ):
        producer.register_send_message_hook(_AsyncAfterSend())
    with pytest.raises(ConfigurationError, match=r"sink must be a TraceSink .*, got MemoryBroker"):
        ConsumeMessageTraceHook(MemoryBroker())  # type: ignore[arg-type]
    # hooks of the right shape, the project's own included, are accepted
    consumer.register_consume_message_hook(ConsumeMessageTraceHook())
    producer.register_send_message_hook(SendMessageTraceHook())
