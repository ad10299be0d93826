"""SimpleConsumer: RocketMQ 5's pop consumption (receive, ack, invisible duration)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Generator, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import attrs

from .._exceptions import ConfigurationError, ConsumerStateError, InvalidOptionError
from .._filter import TagFilter
from .._message import MessageQueue
from .._observability._hooks import (
    ConsumeMessageContext,
    ConsumeMessageHook,
    ConsumeReturnType,
    PullContext,
    SettleContext,
)
from .._observability._view import ConsumerStatistics
from .._options import _ratio, check_gray_options
from .._sources._gray import gray_member_id
from .._sources._group import new_client_id
from .._sources._pop import (
    InvalidReceiptHandleError,
    PopBackend,
    PopSettings,
    ReceivedMessage,
)
from .._sources._pop_backends import pop_backend
from .._sources._source import MessageSource
from ._hooks import HookRunner, loop_wall_offset
from ._shapes import check_client, check_hook
from ._simple_members import Membership

__all__ = ("AckFuture", "SimpleConsumer", "SimpleConsumerOptions")

MAX_INVISIBLE_DURATION = 12 * 3600.0
"""RocketMQ's longest invisible duration (12 hours)."""
MAX_MESSAGE_NUM = 1024


def _attempts(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise InvalidOptionError(f"{attribute.name} must be an int in [1, 1000], got {value!r}")


def _bool(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{attribute.name} must be a bool, got {value!r}")


def _optional_name(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidOptionError(f"{attribute.name} must be a property name or None, got {value!r}")


@attrs.frozen(kw_only=True)
class SimpleConsumerOptions:
    """Tunables of a :class:`SimpleConsumer` (RocketMQ 5's names and defaults).

    They describe the consumer *group*: every consumer of a group must use the same
    values (on the embedded broker a consumer with other values raises
    :class:`~stagedconsumer.ConfigurationError`).
    """

    max_delivery_attempts: int = attrs.field(default=16, validator=_attempts)
    """Deliveries of a message to the group before it goes to the dead-letter queue
    ``%DLQ%<group>`` (RocketMQ's ``maxDeliveryAttempts``, 16): a message not acked
    within the invisible duration of its last attempt is dead-lettered instead of
    delivered again."""
    fifo: bool = attrs.field(default=False, validator=_bool)
    """FIFO consumption (RocketMQ 5's FIFO group): messages of one message group are
    received one at a time, in queue order; the next is received (by any consumer of
    the group) only after the previous was acked or dead-lettered."""
    message_group_property: str | None = attrs.field(default=None, validator=_optional_name)
    """With ``fifo``: the property naming a message's group; ``None`` (the default):
    its first key. A message without one is not ordered. Messages of a group must be
    in one queue (a producer sending with the group as first key does that)."""

    enable_gray_switch: bool = attrs.field(default=False, validator=_bool)
    """Gray release (RocketMQ's RIP-72), as on the push side: while gray and normal
    members of the group are live, gray members receive from the gray queues only
    and normal members from the others; while only one kind is live, every member
    receives from every queue. Turn it on on every member of the group."""
    gray_tag: bool = attrs.field(default=False, validator=_bool)
    """With ``enable_gray_switch``: this member is gray (its ``client_id`` ends with
    ``@gray[<ratio>]``). A per-member setting, unlike the others."""
    gray_queue_ratio: float = attrs.field(default=0.1, validator=_ratio)
    """Share of each topic's queues that are gray, in (0, 1]: the last
    ``ceil(n * ratio)`` of the sorted queues. Only with ``enable_gray_switch``."""

    def __attrs_post_init__(self) -> None:
        if self.message_group_property is not None and not self.fifo:
            raise InvalidOptionError("message_group_property is used only with fifo=True")
        check_gray_options(self.enable_gray_switch, self.gray_tag, self.gray_queue_ratio)


def _check_duration(name: str, value: object, *, allow_zero: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
        or value > MAX_INVISIBLE_DURATION
    ):
        low = "0" if allow_zero else "more than 0"
        raise ConfigurationError(
            f"{name} must be a number of seconds, {low} and at most"
            f" {MAX_INVISIBLE_DURATION:g} (12 hours), got {value!r}"
        )
    return float(value)


class _AckBatch:
    """The acks queued by :meth:`SimpleConsumer.ack_async` until they are sent, and
    then their outcome."""

    __slots__ = ("consumer", "done", "error", "messages", "refused", "sending")

    def __init__(self, consumer: SimpleConsumer) -> None:
        self.consumer = consumer
        self.messages: list[ReceivedMessage] = []
        self.sending: anyio.Event | None = None
        self.done = False
        self.error: BaseException | None = None
        self.refused: set[int] = set()


class AckFuture:
    """The outcome of :meth:`SimpleConsumer.ack_async`: ``await`` it (which sends the
    acks queued, if they were not sent yet) to have ``None``, or the
    :class:`InvalidReceiptHandleError` (or the broker's error) raised."""

    __slots__ = ("_batch", "message")

    def __init__(self, batch: _AckBatch, message: ReceivedMessage) -> None:
        self._batch = batch
        self.message = message
        """The message acked."""

    def done(self) -> bool:
        """Whether the ack was sent and its outcome is known."""
        return self._batch.done

    def exception(self) -> BaseException | None:
        """The ack's error once :meth:`done` (``None``: acked, or not sent yet)."""
        batch = self._batch
        error = batch.error
        if isinstance(error, InvalidReceiptHandleError) and id(self.message) not in batch.refused:
            return None  # another message of the batch was refused
        return error

    async def _wait(self) -> None:
        batch = self._batch
        while not batch.done:
            if batch.sending is None:
                await batch.consumer._flush_acks()
            else:  # being sent by another task
                await batch.sending.wait()
        error = self.exception()
        if error is not None:
            raise error

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()


class SimpleConsumer:
    """Receives messages on demand and acks them: RocketMQ 5's ``SimpleConsumer``
    (pop consumption).

    ``await consumer.receive(max_message_num, invisible_duration)`` returns up to
    ``max_message_num`` messages of the subscribed topics, waiting up to
    ``await_duration`` seconds for at least one. Each is invisible to the group for
    ``invisible_duration`` seconds: :meth:`ack` it when done, or
    :meth:`change_invisible_duration` to take longer. A message not acked in time is
    delivered again (to any consumer of the group), its
    :attr:`~ReceivedMessage.delivery_attempt` one higher; after
    ``options.max_delivery_attempts`` (16) it goes to the group's dead-letter queue
    ``%DLQ%<group>``, stored as the push consumer stores a dead letter. An ack after
    the invisible duration passed raises :class:`InvalidReceiptHandleError`.

    The broker keeps the group's state (no offsets, queue locks or rebalance in the
    client): consumers of one group, in one process or many (``RedisBroker``), share
    the subscribed topics' messages. Delivery is at-least-once.

    ``subscriptions`` maps topics to tag expressions (``"*"``, ``"TagA || TagB"``);
    every consumer of a group subscribes the same way (a message a consumer's filter
    rejects is skipped for the group). Use it as ``async with consumer:``.
    """

    def __init__(
        self,
        group: str,
        source: MessageSource,
        *,
        subscriptions: Mapping[str, str | None] | None = None,
        await_duration: float = 30.0,
        options: SimpleConsumerOptions | None = None,
    ) -> None:
        options = check_client(group, source, options, SimpleConsumerOptions, consumer=True)
        self.group = group
        """The consumer group: its members share the topics' messages and progress."""
        self.source = source
        """The broker it receives from."""
        self.options = options
        """The ``SimpleConsumerOptions`` it runs with."""
        self.await_duration = _check_duration("await_duration", await_duration, allow_zero=True)
        """Seconds :meth:`receive` waits for a message at most (RocketMQ's
        ``awaitDuration``)."""
        self.client_id = new_client_id()
        """This consumer's name in the group (Redis: its consumer name); a gray
        member's ends with ``@gray[<ratio>]``."""
        if options.enable_gray_switch and options.gray_tag:
            self.client_id = gray_member_id(self.client_id, options.gray_queue_ratio)
        self._membership: Membership | None = None
        self._subscriptions: dict[str, TagFilter] = {}
        for topic, expression in (subscriptions or {}).items():
            self._subscribe(topic, expression)
        self._backend: PopBackend | None = None
        self._started = False
        self._closed = False
        self._hook_list: list[ConsumeMessageHook] = []
        self._hooks: HookRunner | None = None
        self._contexts: dict[tuple[str, int, int, int], ConsumeMessageContext] = {}
        """Hooks: the context of each delivery received here and not yet settled."""
        self._exit_stack: contextlib.AsyncExitStack | None = None
        self._wall_offset = 0.0
        self._counts = {"received": 0, "acked": 0, "refused": 0, "nacked": 0}
        self._ack_batch = _AckBatch(self)
        """Acks queued by :meth:`ack_async`, not sent yet."""
        self._acks_in_flight: anyio.Event | None = None
        """Set when the batch of acks on its way (``_flush_acks``) is answered."""
        self._receiving: set[anyio.CancelScope] = set()
        """Receives waiting for messages (cancelled when the consumer closes)."""

    @property
    def consumer_group(self) -> str:
        """RocketMQ's ``getConsumerGroup()``."""
        return self.group

    @property
    def subscriptions(self) -> dict[str, str]:
        """Topic -> tag expression (RocketMQ's ``getSubscriptionExpressions()``)."""
        return {topic: f.expression for topic, f in self._subscriptions.items()}

    def _subscribe(self, topic: str, expression: str | None) -> None:
        if not isinstance(topic, str) or not topic:
            raise ConfigurationError(f"topic must be a non-empty string, got {topic!r}")
        if topic.startswith("%"):
            raise ConfigurationError(f"cannot subscribe to system topic {topic!r}")
        if self.source.topic_exists(topic) is False:
            from .._exceptions import UnknownTopicError

            raise UnknownTopicError(f"topic {topic!r} does not exist")
        self._subscriptions[topic] = TagFilter.parse(expression)

    async def subscribe(self, topic: str, expression: str | None = "*") -> None:
        """Add (or change) a subscription, also while running."""
        self._subscribe(topic, expression)
        if self._backend is not None:
            await self._backend.start({topic: self._subscriptions[topic]})
            await self._gray_queues()

    async def _gray_queues(self) -> None:
        """Tell the membership the subscribed topics' queues (for the gray split)."""
        membership = self._membership
        if membership is not None and self.options.enable_gray_switch:
            membership.set_queues(
                {topic: list(await self.source.get_queues(topic)) for topic in self._subscriptions}
            )

    def unsubscribe(self, topic: str) -> None:
        """Stop receiving ``topic``'s messages (those received stay ackable)."""
        self._subscriptions.pop(topic, None)

    def register_consume_message_hook(self, hook: ConsumeMessageHook) -> None:
        """Run ``hook`` around each delivery (see :class:`ConsumeMessageHook`); call
        before starting. A delivery is a "call" from its receive to its settlement:
        ``consume_message_before`` runs for each message :meth:`receive` returns
        (mode ``"pop"``, one message per context, ``attempt`` its delivery attempt),
        ``consume_message_after`` when this consumer acks it (``SUCCESS``), hands it
        back with ``change_invisible_duration(message, 0)`` (``FAILED``), or has its
        ack refused (``TIME_OUT``, the exception in ``context.exception``). Message
        trace (:class:`ConsumeMessageTraceHook`) records a ``SubBefore`` and a
        ``SubAfter`` per delivery this way. A delivery whose consumer never settles it
        (it crashed, or let it expire without an ack) gets no ``after``.
        """
        if self._started:
            raise ConsumerStateError(
                "register_consume_message_hook() must be called before the consumer starts"
            )
        if not isinstance(hook, ConsumeMessageHook):
            raise ConfigurationError(
                f"hook must be a ConsumeMessageHook, got {type(hook).__name__}"
            )
        check_hook(hook, ConsumeMessageHook, ("consume_message_before", "consume_message_after"))
        self._hook_list.append(hook)

    def statistics(self) -> ConsumerStatistics:
        """A snapshot of this consumer's counters (``consumed_ok``: acks,
        ``consumed_failed``: refused acks and nacks, ``in_flight``: deliveries
        received here with hooks and not yet settled)."""
        counts = self._counts
        hooks = self._hooks
        return ConsumerStatistics(
            group=self.group,
            mode="pop",
            consumed_ok=counts["acked"],
            consumed_failed=counts["refused"] + counts["nacked"],
            sent_back=0,
            dead_lettered=0,
            in_flight=len(self._contexts),
            pull_errors=0,
            commit_errors=0,
            commits=0,
            queues={},
            hook_errors=0 if hooks is None else hooks.errors,
            trace_records_dropped=sum(h.records_dropped for h in self._hook_list),
        )

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Join the group and start receiving (``async with consumer:`` calls it);
        pair it with :meth:`aclose`."""
        if self._started:
            raise ConsumerStateError("the SimpleConsumer was started already")
        settings = PopSettings(
            group=self.group,
            max_delivery_attempts=self.options.max_delivery_attempts,
            fifo=self.options.fifo,
            message_group_property=self.options.message_group_property,
            gray_queue_ratio=(
                self.options.gray_queue_ratio if self.options.enable_gray_switch else None
            ),
        )
        backend = pop_backend(self.source, settings)
        for topic in self._subscriptions:
            await self.source.get_queues(topic)  # UnknownTopicError
        await backend.start(dict(self._subscriptions))
        membership = Membership(
            backend, self.client_id, self.options.enable_gray_switch, self.options.gray_queue_ratio
        )
        await membership.join()  # ConfigurationError: the group's members disagree
        self._membership = membership
        await self._gray_queues()
        self._started = True
        stack = contextlib.AsyncExitStack()
        self._exit_stack = stack
        try:
            stack.push_async_callback(membership.leave)
            # presence is refreshed in the background while the consumer is open (the
            # group's settings check and gray release rely on it), by a detached task:
            # the consumer may be closed from any task
            stack.push_async_callback(membership.start_beating().aclose)
            if self._hook_list:
                # a task group: only then is the consumer's lifetime a scope of its own
                tg = await stack.enter_async_context(anyio.create_task_group())
                stack.callback(tg.cancel_scope.cancel)
                self._hooks = HookRunner(self._hook_list)
                self._wall_offset = loop_wall_offset()
                stack.push_async_callback(self._hooks.aclose)
                for hook in self._hooks.services():
                    await tg.start(hook.run, self)
        except BaseException:
            self._exit_stack = None
            await stack.aclose()
            raise
        self._backend = backend

    async def aclose(self) -> None:
        """Stop: :meth:`receive` raises from now on. Messages received and not acked
        come back after their invisible duration. Receives waiting in other tasks
        return at once, raising :class:`ConsumerStateError`. Hooks are closed
        (flushed)."""
        if self._ack_batch.messages and not self._closed:
            await self._flush_acks()
        self._closed = True
        for scope in self._receiving:
            scope.cancel()
        stack, self._exit_stack = self._exit_stack, None
        if stack is not None:
            await stack.aclose()

    async def __aenter__(self) -> SimpleConsumer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _running(self, method: str) -> PopBackend:
        backend = self._backend
        if backend is None or self._closed:
            state = "closed" if self._closed else "not started"
            raise ConsumerStateError(
                f"{method}() needs a running SimpleConsumer (it is {state}): use"
                " `async with consumer:`"
            )
        return backend

    # -- RocketMQ 5's operations ---------------------------------------------------------

    async def receive(
        self, max_message_num: int, invisible_duration: float
    ) -> list[ReceivedMessage]:
        """Up to ``max_message_num`` messages, each invisible to the group for
        ``invisible_duration`` seconds; waits up to ``await_duration`` for at least
        one (an empty list when none came)."""
        backend = self._running("receive")
        if (
            isinstance(max_message_num, bool)
            or not isinstance(max_message_num, int)
            or not 1 <= max_message_num <= MAX_MESSAGE_NUM
        ):
            raise ConfigurationError(
                f"max_message_num must be an int in [1, {MAX_MESSAGE_NUM}], got {max_message_num!r}"
            )
        invisible = _check_duration("invisible_duration", invisible_duration)
        if not self._subscriptions:
            raise ConsumerStateError("receive() needs a subscription (subscriptions={topic: '*'})")
        hooks = self._hooks
        membership = self._membership
        acks = self._ack_batch
        if acks.messages and not backend.merges_acks:
            await self._flush_acks()
        if membership is not None and membership.beat_due():
            await membership.beat()
        started = anyio.current_time() if hooks is not None else 0.0
        with anyio.CancelScope() as scope:
            self._receiving.add(scope)
            try:
                messages = await self._ack_and_receive(
                    backend,
                    max_message_num,
                    invisible,
                    None if membership is None else membership.refresh(),
                )
            finally:
                self._receiving.discard(scope)
        if scope.cancelled_caught:
            raise ConsumerStateError("the SimpleConsumer was closed while receive() waited")
        self._counts["received"] += len(messages)
        if hooks is not None and messages:
            self._received_hooks(hooks, messages, started)
        return messages

    async def _ack_and_receive(
        self,
        backend: PopBackend,
        max_message_num: int,
        invisible: float,
        queues: frozenset[tuple[str, int]] | None,
    ) -> list[ReceivedMessage]:
        """The backend's receive, with the acks queued by :meth:`ack_async` when it
        sends them along (one round trip)."""
        batch = self._ack_batch
        acks = batch.messages
        if acks:
            self._ack_batch = _AckBatch(self)
            batch.sending = anyio.Event()
        started = anyio.current_time() if acks and self._hooks is not None else 0.0
        try:
            refused, messages = await backend.ack_and_receive(
                acks,
                self.client_id,
                self._subscriptions,
                max_message_num,
                invisible,
                self.await_duration,
                queues,
            )
        except BaseException as exc:  # the acks' fate is unknown: their futures say so
            if acks:
                batch.error = exc
            raise
        else:
            if acks:
                batch.error = self._acked(acks, refused, started)
                if batch.error is not None:
                    batch.refused = {id(m) for m in refused}
        finally:
            if acks:  # (without, ``batch`` is the one other tasks queue to now)
                batch.done = True
                assert batch.sending is not None
                batch.sending.set()
        return messages

    def _received_hooks(
        self, hooks: HookRunner, messages: list[ReceivedMessage], started: float
    ) -> None:
        """Tell the hooks of a receive: ``messages_pulled`` once, ``before`` per message."""
        now = anyio.current_time()
        if hooks.wants_pull:
            first = messages[0]
            hooks.pulled(
                PullContext(
                    consumer_group=self.group,
                    message_queue=MessageQueue(first.topic, first.queue_id),
                    messages=messages,
                    start_time=started,
                    end_time=now,
                    wall_offset=self._wall_offset,
                    max_offset=-1,
                )
            )
        for m in messages:
            context = ConsumeMessageContext._of_call(
                self.group,
                MessageQueue(m.topic, m.queue_id),
                [m],
                "pop",
                -1,
                None,
                None,
                m.delivery_attempt,
                [now],
                now,
                now,
                self._wall_offset,
            )
            hooks.before(context)
            self._contexts[m.topic, m.queue_id, m.queue_offset, m.delivery_attempt] = context

    def _settled(
        self,
        message: ReceivedMessage,
        status: ConsumeReturnType,
        exception: BaseException | None = None,
    ) -> None:
        """Count a settlement and tell the hooks."""
        if status is ConsumeReturnType.SUCCESS:
            self._counts["acked"] += 1
        elif status is ConsumeReturnType.TIME_OUT:
            self._counts["refused"] += 1
        else:
            self._counts["nacked"] += 1
        hooks = self._hooks
        if hooks is None:
            return
        key = (message.topic, message.queue_id, message.queue_offset, message.delivery_attempt)
        context = self._contexts.pop(key, None)
        if context is None:
            return
        context.end_time = anyio.current_time()
        context.success = status is ConsumeReturnType.SUCCESS
        context.status = status
        context.exception = exception
        hooks.after(context)

    def _settle_hooks(
        self,
        operation: str,
        messages: Sequence[ReceivedMessage],
        refused: Sequence[ReceivedMessage],
        exception: BaseException | None,
        duration: float | None,
        started: float,
    ) -> None:
        """Tell the hooks of one settle call (``messages_settled``)."""
        hooks = self._hooks
        if hooks is None or not hooks.settle_hooks:
            return
        hooks.settled(
            SettleContext(
                consumer_group=self.group,
                operation=operation,
                messages=messages,
                refused=refused,
                exception=exception,
                invisible_duration=duration,
                start_time=started,
                end_time=anyio.current_time(),
                wall_offset=self._wall_offset,
            )
        )

    async def ack(self, message: ReceivedMessage) -> None:
        """Finish ``message``: it is never delivered to the group again.

        Raises :class:`InvalidReceiptHandleError` when this delivery no longer holds
        the message: its invisible duration passed (it is visible again, maybe
        received by another consumer already), it was acked, or dead-lettered."""
        backend = self._running("ack")
        if self._hooks is None:
            await backend.ack(message)
            self._counts["acked"] += 1
            return
        started = anyio.current_time()
        try:
            await backend.ack(message)
        except InvalidReceiptHandleError as exc:
            self._settled(message, ConsumeReturnType.TIME_OUT, exc)
            self._settle_hooks("ack", [message], [message], exc, None, started)
            raise
        except Exception as exc:
            self._settle_hooks("ack", [message], [], exc, None, started)
            raise
        self._settled(message, ConsumeReturnType.SUCCESS)
        self._settle_hooks("ack", [message], [], None, None, started)

    async def ack_batch(self, messages: Sequence[ReceivedMessage]) -> None:
        """Ack several messages at once: one round trip on Redis (one per queue on a
        Cluster; RocketMQ 5's ack request carries many entries too). Every message
        still held is acked; then, if any was refused, raises
        :class:`InvalidReceiptHandleError` with them in its ``refused`` attribute."""
        backend = self._running("ack_batch")
        if not messages:
            return
        error = await self._ack_many(backend, list(messages))
        if error is not None:
            raise error

    async def _ack_many(
        self, backend: PopBackend, messages: list[ReceivedMessage]
    ) -> InvalidReceiptHandleError | None:
        """Ack ``messages``: the error naming those refused, or ``None`` (a broker's
        error raises)."""
        started = anyio.current_time() if self._hooks is not None else 0.0
        try:
            refused = await backend.ack_many(messages)
        except Exception as exc:
            self._settle_hooks("ack", messages, [], exc, None, started)
            raise
        return self._acked(messages, refused, started)

    def _acked(
        self, messages: list[ReceivedMessage], refused: list[ReceivedMessage], started: float
    ) -> InvalidReceiptHandleError | None:
        """Count acks the broker answered and tell the hooks; the error naming those
        refused, or ``None``."""
        if not refused and self._hooks is None:
            self._counts["acked"] += len(messages)
            return None
        refused_ids = {id(m) for m in refused}
        for m in messages:
            if id(m) not in refused_ids:
                self._settled(m, ConsumeReturnType.SUCCESS)
        error = None
        if refused:
            error = InvalidReceiptHandleError(
                f"ack of {len(refused)} of {len(messages)} messages refused (their invisible"
                " duration passed, or they were acked, received again or dead-lettered):"
                f" {', '.join(m.msg_id for m in refused[:10])}"
                + (" ..." if len(refused) > 10 else "")
            )
            error.refused = refused
            for m in refused:
                self._settled(m, ConsumeReturnType.TIME_OUT, error)
        self._settle_hooks("ack", messages, refused, error, None, started)
        return error

    def ack_async(self, message: ReceivedMessage) -> AckFuture:
        """Queue an ack of ``message`` and return at once (RocketMQ 5's ``ackAsync``):
        the acks queued are sent together with the next :meth:`receive` (on Redis
        within its script: one round trip for both; elsewhere as :meth:`ack_batch`
        sends them, before it), or when the consumer closes, or when one of their
        futures is awaited, whichever comes first.

        ``await`` the returned :class:`AckFuture` to know the outcome: it raises
        :class:`InvalidReceiptHandleError` when the ack was refused. Until it is sent,
        the message's invisible duration keeps running: a loop that acks this way
        and then receives again sends its acks with that receive."""
        if self._backend is None or self._closed:
            self._running("ack_async")
        batch = self._ack_batch
        batch.messages.append(message)
        return AckFuture(batch, message)

    async def _flush_acks(self) -> None:
        """Send the queued acks (:meth:`ack_async`); their futures get the outcome.
        A broker's error goes to the futures, not to the caller."""
        in_flight = self._acks_in_flight
        if in_flight is not None:
            # group commit: acks queued while one batch is on its way go in the next
            await in_flight.wait()
        batch = self._ack_batch
        if not batch.messages:
            return
        self._ack_batch = _AckBatch(self)
        batch.sending = self._acks_in_flight = anyio.Event()
        try:
            backend = self._backend
            if backend is None:
                raise ConsumerStateError("the SimpleConsumer stopped before the acks were sent")
            batch.error = await self._ack_many(backend, batch.messages)
            if batch.error is not None:
                batch.refused = {id(m) for m in batch.error.refused}
        except Exception as exc:
            batch.error = exc
        finally:
            batch.done = True
            batch.sending.set()
            if self._acks_in_flight is batch.sending:
                self._acks_in_flight = None

    async def change_invisible_duration(
        self, message: ReceivedMessage, invisible_duration: float
    ) -> None:
        """Make ``message`` invisible for ``invisible_duration`` seconds from now (to
        take longer than the receive asked for, or to have it back sooner: 0 hands
        it back at once, a nack). The message stays ackable while invisible; the
        same errors as :meth:`ack`."""
        duration = _check_duration("invisible_duration", invisible_duration, allow_zero=True)
        backend = self._running("change_invisible_duration")
        operation = "nack" if duration == 0 else "change_invisible_duration"
        started = anyio.current_time() if self._hooks is not None else 0.0
        try:
            await backend.change_invisible_duration(message, duration)
        except InvalidReceiptHandleError as exc:
            self._settled(message, ConsumeReturnType.TIME_OUT, exc)
            self._settle_hooks(operation, [message], [message], exc, duration, started)
            raise
        except Exception as exc:
            self._settle_hooks(operation, [message], [], exc, duration, started)
            raise
        if duration == 0:
            self._settled(message, ConsumeReturnType.FAILED)
        self._settle_hooks(operation, [message], [], None, duration, started)
