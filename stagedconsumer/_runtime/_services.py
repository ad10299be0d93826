"""Consume services: what differs between concurrent, orderly and staged consumption.

After RocketMQ's ``ConsumeMessageConcurrentlyService`` /
``ConsumeMessageOrderlyService``: a consumer picks one service for its listener at
construction and never tests the mode again. A service says how queues of its mode
are cached (the :class:`~stagedconsumer._core.ProcessQueue` mode, flow control,
retry queues), builds the handler's context for a batch, names the result that means
success, and judges a failed call into a
:class:`~stagedconsumer._core.Settlement` that the worker applies in one call. The
worker loop itself (``_workers.py``) is the same for every mode.
"""

from __future__ import annotations

import abc
import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import anyio
import attrs

from offsetstore import StageKey

from .._core import (
    DEFAULT_STRATEGY,
    Batch,
    ConsumeMode,
    FlowControl,
    ProcessQueue,
    Settlement,
    StageDefinition,
    StagePlan,
    clamp_suspend_millis,
    split_exhausted,
)
from .._exceptions import ConfigurationError, ListenerTypeError, SourceError
from .._listeners import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
    ConsumeStagedConcurrentlyContext,
    MessageListener,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    Ordering,
    _concurrently_context,
    _orderly_context,
    _staged_context,
)
from .._message import Message, MessageQueue
from .._options import ConsumerOptions
from .._sources._gray import PROPERTY_GRAY
from .._sources._source import MessageSource, SendBackResult
from ._shapes import check_listener, overrides
from ._state import ConsumerState

__all__ = (
    "ConcurrentlyConsumeService",
    "ConsumeService",
    "OrderlyConsumeService",
    "StagedConsumeService",
)

logger = logging.getLogger("stagedconsumer")

SEND_BACK_FAILED_DELAY = 5.0
"""Seconds before a message that could not be handed to the retry queue is retried
locally (RocketMQ's value)."""


class ConsumeService(abc.ABC):
    """How one consumption mode caches, hands out and settles messages."""

    mode: ClassVar[ConsumeMode]
    success: ClassVar[object]
    """The handler result (besides ``None``) that means success."""
    partial_ack: ClassVar[bool] = False
    """Whether a successful result may acknowledge only part of the batch
    (``context.ack_index``, concurrent mode)."""
    retry_queues: ClassVar[bool] = False
    """Whether the consumer also consumes its group's retry queue (``%RETRY%<group>``)."""
    plan: StagePlan | None = None
    """How messages are assigned to stages (staged mode only)."""
    key_of: Callable[[Message], str | None] | None = None
    """The ordering key of a message (key-ordered mode only)."""
    gray_queue: Callable[[MessageQueue], bool] | None = None
    """Gray release: whether a queue is gray. A message handed back (retry, DLQ)
    from a gray queue gets the ``GRAY`` property, which keeps its retries on gray
    retry queues."""

    def _handed_back(self, message: Message, mq: MessageQueue) -> Message:
        """``message`` as handed back to the source: marked gray when it is."""
        gray_queue = self.gray_queue
        if (
            gray_queue is None
            or message.properties.get(PROPERTY_GRAY) == "true"
            or not gray_queue(mq)
        ):
            return message
        return attrs.evolve(message, properties={**message.properties, PROPERTY_GRAY: "true"})

    def __init__(
        self, group: str, source: MessageSource, state: ConsumerState, options: ConsumerOptions
    ) -> None:
        self.group = group
        self.source = source
        self.state = state
        self.options = options
        self.active_runs = []
        concurrent = self.mode is ConsumeMode.CONCURRENT
        self.max_reconsume_times = options.effective_max_reconsume_times(concurrent=concurrent)
        self.flow = FlowControl(
            count=options.pull_threshold_for_queue,
            size_bytes=options.pull_threshold_size_for_queue,
            max_span=options.consume_concurrently_max_span if concurrent else None,
        )

    @staticmethod
    def for_listener(
        listener: MessageListener,
        group: str,
        source: MessageSource,
        state: ConsumerState,
        options: ConsumerOptions,
    ) -> ConsumeService:
        """The service of ``listener``'s kind; raises :class:`ListenerTypeError`."""
        check_listener(listener)
        if isinstance(listener, MessageListenerStagedConcurrently):
            return StagedConsumeService(group, source, state, options, build_plan(listener))
        if isinstance(listener, MessageListenerOrderly):
            if listener.ordering is Ordering.BY_KEY:
                return KeyOrderlyConsumeService(group, source, state, options, listener)
            if listener.ordering is not Ordering.BY_QUEUE:
                raise ConfigurationError(
                    f"{type(listener).__name__}.ordering must be an Ordering, got"
                    f" {listener.ordering!r}"
                )
            return OrderlyConsumeService(group, source, state, options)
        if isinstance(listener, MessageListenerConcurrently):
            return ConcurrentlyConsumeService(group, source, state, options)
        raise ListenerTypeError(
            "listener must be a MessageListenerConcurrently, MessageListenerOrderly or"
            f" MessageListenerStagedConcurrently, got {type(listener).__name__}"
        )

    def new_process_queue(
        self,
        mq: MessageQueue,
        start_offset: int,
        stage_offsets: Mapping[StageKey, int],
        finished: Sequence[tuple[int, int]] = (),
    ) -> ProcessQueue:
        """The process queue of ``mq`` (of this mode), resuming at ``start_offset``
        (the messages of the ``finished`` ranges above it finished already)."""
        pq = ProcessQueue(
            mq,
            self.mode,
            start_offset=start_offset,
            stage_offsets=stage_offsets,
            plan=self.plan,
            flow_control=self.flow,
            key_of=self.key_of,
            finished=finished,
        )
        pq.transactor = self.transactor
        return pq

    transactor: Any = None
    """What ``context.transact`` calls (set by the consumer)."""
    active_runs: list[Any]
    """The workers' runs (``_runs.Run``): a run's calls share one batch, and the
    call in progress is ``run.batch.messages[run.done]`` while ``run.context`` is its
    context (what ``context.transact`` marks)."""

    context_for: Callable[[Batch, int], Any]
    """Builds the context handed to the listener with a batch: ``(batch, suspend
    millis)``; a plain function, called once per handler call."""

    _said_not_a_status = False

    def _not_a_status(self, result: object, status: type[enum.Enum], treated_as: str) -> None:
        """A handler returned ``result``, neither ``None`` nor a ``status``: counted
        (``statistics().invalid_returns``); the first one is an ERROR saying so (the
        usual mistake: a string such as ``'SUCCESS'``, or ``True``), later ones the
        WARNING of any failure."""
        self.state.invalid_returns += 1
        if self._said_not_a_status:
            logger.warning(
                "group %s: handler returned %r, treated as %s", self.group, result, treated_as
            )
            return
        self._said_not_a_status = True
        names = " or ".join(f"{status.__name__}.{member.name}" for member in status)
        logger.error(
            "group %s: the handler returned %r (a %s), which is not a status: return None"
            " or %s. It is treated as %s, a failure, so its messages are consumed again;"
            " said once, every such return is counted in statistics().invalid_returns",
            self.group,
            result,
            type(result).__name__,
            names,
            treated_as,
        )

    async def _dead_letter(
        self, exhausted: Sequence[Message], mq: MessageQueue, suspended: list[Message]
    ) -> list[Message]:
        """Move ``exhausted`` to the dead-letter queue; those it could not move are
        appended to ``suspended`` (retried here). Returns those moved."""
        dead: list[Message] = []
        for message in exhausted:
            try:
                await self.source.send_to_dlq(self.group, self._handed_back(message, mq))
            except SourceError as exc:
                logger.warning(
                    "group %s: could not move %s to the DLQ (%s); retrying it",
                    self.group,
                    message.msg_id,
                    exc,
                )
                suspended.append(message)
                continue
            dead.append(message)
        self.state.dead_lettered += len(dead)
        return dead

    @staticmethod
    def _retry_at(suspend_millis: int, suspended: Sequence[Message]) -> float:
        """When suspended messages are retried (0.0 when there are none)."""
        if not suspended:
            return 0.0
        return anyio.current_time() + clamp_suspend_millis(suspend_millis) / 1000

    @abc.abstractmethod
    async def settle_failure(
        self, batch: Batch, context: Any, error: Exception | None, result: object
    ) -> Settlement:
        """Judge a failed handler call (``error`` raised, or ``result`` returned) and
        do its I/O (send back, dead-letter); the worker applies the settlement."""


class ConcurrentlyConsumeService(ConsumeService):
    """Concurrent mode: no order. A failed message is handed to the group's retry
    queue (RocketMQ's delay levels), or to its dead-letter queue after
    ``max_reconsume_times`` (default 16), and counts as finished here; if the source
    cannot take it back it is retried locally after 5 s."""

    mode = ConsumeMode.CONCURRENT
    success = ConsumeConcurrentlyStatus.CONSUME_SUCCESS
    partial_ack = True
    retry_queues = True

    context_for: Callable[[Batch, int], Any] = staticmethod(_concurrently_context)

    async def settle_failure(
        self,
        batch: Batch,
        context: ConsumeConcurrentlyContext,
        error: Exception | None,
        result: object,
    ) -> Settlement:
        state = self.state
        messages = batch.messages
        mq = batch.process_queue.message_queue
        succeeded: Sequence[Message] = ()
        if error is None and (result is None or result is self.success):
            ack = max(-1, context.ack_index)  # acknowledged the first ack + 1 only
            succeeded = messages[: ack + 1]
            failed = messages[ack + 1 :]
            state.consumed_ok += len(succeeded)
        else:
            if error is not None:
                logger.warning(
                    "group %s: handler failed on %d message(s) of %s; %s",
                    self.group,
                    len(messages),
                    mq,
                    "retrying them here" if self.options.retry_in_place else "sending them back",
                    exc_info=error,
                )
            elif result is not ConsumeConcurrentlyStatus.RECONSUME_LATER:
                self._not_a_status(result, ConsumeConcurrentlyStatus, "RECONSUME_LATER")
            failed = messages
        state.consumed_failed += len(failed)
        if self.options.retry_in_place:
            return await self._retry_in_place(batch, succeeded, failed, context)
        kept: list[Message] = []
        retried: list[Message] = []
        dead: list[Message] = []
        limit = self.max_reconsume_times
        for message in failed:
            try:
                where = await self.source.send_back(
                    self.group,
                    self._handed_back(message, mq),
                    delay_level=context.delay_level_when_next_consume,
                    max_reconsume_times=limit if limit is not None else 2**31 - 1,
                )
            except SourceError as exc:
                logger.warning(
                    "group %s: could not send %s back (%s); retrying it here in %.0f s",
                    self.group,
                    message.msg_id,
                    exc,
                    SEND_BACK_FAILED_DELAY,
                )
                kept.append(message)
                continue
            if where is SendBackResult.DLQ:
                dead.append(message)
            else:
                retried.append(message)
        state.sent_back += len(retried)
        state.dead_lettered += len(dead)
        return Settlement(
            succeeded=succeeded,
            retried=retried,
            dead=dead,
            suspended=kept,
            retry_at=anyio.current_time() + SEND_BACK_FAILED_DELAY if kept else 0.0,
        )

    async def _retry_in_place(
        self,
        batch: Batch,
        succeeded: Sequence[Message],
        failed: Sequence[Message],
        context: ConsumeConcurrentlyContext,
    ) -> Settlement:
        """``retry_in_place``: the failed messages stay in their queue and are retried
        after ``suspend_current_queue_time_millis``; those that used up their attempts
        (or asked for it with a negative delay level) go to the dead-letter queue."""
        mq = batch.process_queue.message_queue
        suspended: list[Message]
        exhausted: list[Message]
        if context.delay_level_when_next_consume < 0:
            suspended, exhausted = [], list(failed)
        else:
            suspended, exhausted = split_exhausted(failed, self.max_reconsume_times)
        dead = await self._dead_letter(exhausted, mq, suspended)
        return Settlement(
            succeeded=succeeded,
            dead=dead,
            suspended=suspended,
            retry_at=self._retry_at(self.options.suspend_current_queue_time_millis, suspended),
        )


class OrderlyConsumeService(ConsumeService):
    """Orderly mode: one batch at a time per queue, in offset order. A failed batch is
    retried locally after ``context.suspend_current_queue_time_millis`` and holds its
    queue meanwhile; a message that used up ``max_reconsume_times`` (default
    unlimited) goes to the dead-letter queue and counts as finished."""

    mode = ConsumeMode.ORDERLY
    success = ConsumeOrderlyStatus.SUCCESS

    context_for: Callable[[Batch, int], Any] = staticmethod(_orderly_context)

    async def settle_failure(
        self,
        batch: Batch,
        context: ConsumeOrderlyContext | ConsumeStagedConcurrentlyContext,
        error: Exception | None,
        result: object,
    ) -> Settlement:
        messages = batch.messages
        if error is not None:
            logger.warning(
                "group %s: handler failed on %d message(s) of %s (attempt %d); suspending",
                self.group,
                len(messages),
                batch.process_queue.message_queue,
                batch.attempt,
                exc_info=error,
            )
        elif result is not ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT:
            self._not_a_status(result, ConsumeOrderlyStatus, "SUSPEND_CURRENT_QUEUE_A_MOMENT")
        self.state.consumed_failed += len(messages)
        suspended, exhausted = split_exhausted(messages, self.max_reconsume_times)
        dead = await self._dead_letter(exhausted, batch.process_queue.message_queue, suspended)
        return Settlement(
            dead=dead,
            suspended=suspended,
            retry_at=self._retry_at(context.suspend_current_queue_time_millis, suspended),
        )


class KeyOrderlyConsumeService(OrderlyConsumeService):
    """Key-ordered mode: one batch at a time per message key, in offset order; keys
    of a queue run concurrently; failures as in orderly mode (a suspended batch holds
    only its key)."""

    mode = ConsumeMode.KEY_ORDERED

    def __init__(
        self,
        group: str,
        source: MessageSource,
        state: ConsumerState,
        options: ConsumerOptions,
        listener: MessageListenerOrderly,
    ) -> None:
        super().__init__(group, source, state, options)
        self.key_of = listener.compute_key


class StagedConsumeService(OrderlyConsumeService):
    """Staged mode: concurrent inside a stage, stage ``k + 1`` of a stage key only
    after every message of stage ``k`` finished; failures as in orderly mode (a
    suspended message holds its stage)."""

    mode = ConsumeMode.STAGED

    def __init__(
        self,
        group: str,
        source: MessageSource,
        state: ConsumerState,
        options: ConsumerOptions,
        plan: StagePlan,
    ) -> None:
        super().__init__(group, source, state, options)
        self.plan: StagePlan = plan

    context_for: Callable[[Batch, int], Any] = staticmethod(_staged_context)


def build_plan(listener: MessageListenerStagedConcurrently) -> StagePlan:
    """The stage plan of a staged listener: its definitions, validated, and the stage
    callbacks it overrides."""
    strategies = listener.get_stage_definition_strategies()
    if not isinstance(strategies, Mapping):
        raise ConfigurationError(
            "get_stage_definition_strategies() must return a mapping of strategy id to"
            f" stage sizes, got {type(strategies).__name__}"
        )
    definitions = {
        str(strategy): StageDefinition.of(sizes, name=f"stage definitions of {strategy!r}")
        for strategy, sizes in strategies.items()
    }
    base = MessageListenerStagedConcurrently
    if DEFAULT_STRATEGY not in definitions and not overrides(listener, base, "compute_strategy"):
        known = ", ".join(repr(strategy) for strategy in sorted(definitions)) or "none"
        raise ConfigurationError(
            f"{type(listener).__name__}.get_stage_definition_strategies() has no"
            f" {DEFAULT_STRATEGY!r} strategy (it has {known}), and the default"
            f" compute_strategy() picks {DEFAULT_STRATEGY!r} for every message: add it, or"
            " override compute_strategy"
        )
    reset: Callable[[str, int], int] | None = None
    if overrides(listener, base, "reset_current_stage_offset_if_need"):
        reset = listener.reset_current_stage_offset_if_need
    return StagePlan(
        definitions=definitions,
        compute_strategy=listener.compute_strategy
        if overrides(listener, base, "compute_strategy")
        else None,
        compute_group=listener.compute_group
        if overrides(listener, base, "compute_group")
        else None,
        reset=reset,
    )
