"""ProcessQueue: the per-queue bookkeeping of cached and pending messages (sans-I/O).

A :class:`ProcessQueue` holds, for one assigned message queue,

- **cached** messages: pulled, not yet taken by a handler;
- **pending** messages: taken by a handler (running or suspended), not finished.

Messages are sorted into *lanes*. A lane is a stream of messages that must respect an
order rule; lanes never block each other:

- concurrent mode: one lane, no order: any cached message may be taken;
- orderly mode: one *exclusive* lane: at most one batch is pending at a time, and
  batches are taken in offset order;
- key-ordered mode: one exclusive lane per message key, created when a message of
  the key arrives and forgotten once none of its messages is cached or pending (so
  memory is bounded by the queue's flow control, whatever the number of keys);
  messages without a key go to a lane with no order;
- staged mode: one lane per stage key ``(strategy_id, group_id)``. Each message is
  assigned a stage offset on arrival and joins an *epoch*: the run of messages of
  one stage. A message may be taken only when every message of earlier epochs of
  its lane has finished. Messages whose strategy is ``None`` go to a direct lane
  with no order.

The committed consume offset is the lowest offset still cached, pending or held, or
highest-seen + 1 when none is left. It never passes an unfinished message.

When a stage callback of the listener (``compute_strategy``, ``compute_group``, the
reset hook) raises or returns a bad value for a message (a value of the wrong type, a
negative stage offset, a strategy id that none of the definitions has), that message
and every later one of the queue are *held*: not assigned to a stage, not taken, not
committed past (:attr:`ProcessQueue.assignment_error` says why) until
:meth:`ProcessQueue.retry_assignment` succeeds. Other queues are not affected.

Methods that change the queue return :data:`~._effects.Effects`.
The committed stage offset of a stage key is its stage counter *at* the committed
consume offset, so that a restart from committed progress assigns every message
the same stage it had before.

Sparse progress: besides the committed offset, :meth:`ProcessQueue.finished_ranges`
gives the runs of messages above it that already finished. A queue built with
``finished`` (those ranges, from committed progress) treats a message of a range as
finished when it arrives: it is assigned its stage as any other (so stage offsets
count it), never handed to a handler, and counts as finished for its stage's
barrier and for the committed offset (:attr:`ProcessQueue.skipped_count` counts them).

Nothing here reads a clock, logs or awaits: times are passed in.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat, starmap
from types import MappingProxyType
from typing import Final, TypeVar

import attrs

from offsetstore._types import StageKey

from .._message import Message, MessageQueue
from ._effects import COMMITTED, DRAINED, HELD, NOTHING, READY, ROOM, Effects
from ._stages import TAIL_STAGE, StageDefinition

__all__ = (
    "AssignmentFailure",
    "Batch",
    "ConsumeMode",
    "EraseStatus",
    "FlowControl",
    "ProcessQueue",
    "ProcessQueueStatistics",
    "StageKey",
    "StagePlan",
)


class ConsumeMode(enum.Enum):
    """How messages of one queue may be handed to handlers."""

    CONCURRENT = "concurrent"
    ORDERLY = "orderly"
    KEY_ORDERED = "key_ordered"
    STAGED = "staged"


class EraseStatus(enum.Enum):
    """How a taken message finished."""

    SUCCESS = "success"
    """The handler succeeded."""
    SENT_BACK = "sent_back"
    """Handed to the group's retry queue (concurrent mode): finished here."""
    DEAD_LETTER = "dead_letter"
    """Moved to the dead-letter queue after too many attempts: finished."""


_NEVER: Final = 1 << 62
"""An offset no queue reaches: nobody waits."""
_FOREVER: Final = float("inf")
NO_LEASE: Final = float("-inf")
"""``now`` of a take on queues without leases: only a closed queue gives nothing."""

DEFAULT_STRATEGY: Final = "default"
"""Strategy id of the single definition list of ``get_stage_definitions()``."""


@attrs.frozen(kw_only=True)
class FlowControl:
    """Per-queue pull thresholds (RocketMQ's defaults).

    Pulling stops while the queue holds ``>= count`` unfinished messages, or their
    bodies take ``>= size_bytes``, or (when ``max_span`` is set, concurrent mode) the
    unfinished messages span ``>= max_span`` (counted in messages, see
    :attr:`ProcessQueue.span`).
    """

    count: int = 1000
    size_bytes: int = 100 * 1024 * 1024
    max_span: int | None = None


@attrs.frozen(kw_only=True)
class StagePlan:
    """How staged mode assigns messages to stage keys and stages.

    ``compute_strategy`` returns a key of ``definitions``, or ``None`` to consume the
    message directly, with no stage; any other id is a bad value (the queue holds the
    message, see :class:`AssignmentFailure`), as is any strategy id when
    ``compute_strategy`` is ``None`` and ``definitions`` lacks :data:`DEFAULT_STRATEGY`.
    ``compute_group`` splits a strategy into independent stage sequences; ``reset`` is
    consulted at every stage boundary with ``(topic, current stage offset)`` and
    returns the stage offset to use. All three are plain synchronous callables
    supplied by the shell.
    """

    definitions: Mapping[str, StageDefinition]
    compute_strategy: Callable[[Message], str | None] | None = None
    compute_group: Callable[[Message], str | None] | None = None
    reset: Callable[[str, int], int] | None = None

    @classmethod
    def single(cls, sizes: Sequence[int]) -> StagePlan:
        """One strategy (:data:`DEFAULT_STRATEGY`), one group per queue."""
        return cls(definitions={DEFAULT_STRATEGY: StageDefinition.of(sizes)})


@attrs.frozen(kw_only=True)
class AssignmentFailure:
    """A stage callback of the listener failed on a message: the queue holds it."""

    message: Message
    """The message that could not be assigned (the first one held)."""
    callback: str
    """``"compute_strategy"``, ``"compute_group"``, ``"reset_current_stage_offset_if_need"``
    or (key-ordered mode) ``"compute_key"``."""
    detail: str
    """What went wrong, for the log."""
    exception: BaseException | None = None
    """What the callback raised (``None``: it returned a bad value)."""


class _AssignError(Exception):
    def __init__(self, failure: AssignmentFailure) -> None:
        super().__init__(failure.detail)
        self.failure = failure


def _callback_failed(message: Message, callback: str, exc: BaseException) -> _AssignError:
    return _AssignError(
        AssignmentFailure(
            message=message,
            callback=callback,
            detail=f"{callback}() raised {type(exc).__name__}: {exc}",
            exception=exc,
        )
    )


def _bad_value(message: Message, callback: str, value: object, expected: str) -> _AssignError:
    return _AssignError(
        AssignmentFailure(
            message=message,
            callback=callback,
            detail=f"{callback}() returned {type(value).__name__} {value!r}; expected {expected}",
        )
    )


def _strategy_ids(plan: StagePlan) -> str:
    known = ", ".join(repr(strategy) for strategy in sorted(plan.definitions)) or "none"
    return f"a strategy id of the stage definitions ({known}) or None (no stage)"


@attrs.define(eq=False, slots=True)
class _Epoch:
    """A run of consecutive messages of one lane that share a stage."""

    stage_index: int
    unfinished: int = 0
    cached: int = 0
    """Messages of this epoch still cached (not taken); they sit at the head of the
    lane's cache when this epoch is the head epoch."""
    queued: bool = False
    runnable_at: float = 0.0
    """When the epoch last became the head of its lane (its barrier opened); only
    maintained when the shell passes ``now``."""


_T = TypeVar("_T")


class _Small(list[_T]):
    """A list with the two deque methods lanes use beyond a list's: the containers of
    a key-ordered lane, which mostly holds a message or two (a deque reserves a block
    of 64 slots: 760 bytes empty, three per lane). ``popleft`` moves the rest, so a
    key's cache becomes a deque once it holds :data:`_SMALL_MAX` messages."""

    __slots__ = ()

    def popleft(self) -> _T:
        return self.pop(0)

    def extendleft(self, items: Iterable[_T]) -> None:
        self[:0] = list(items)[::-1]  # as deque.extendleft: the last item ends first


_SMALL_MAX: Final = 16
"""Messages a key-ordered lane's cache holds as a :class:`_Small` list."""
_NO_TIMES: Final[_Small[float]] = _Small()
"""The ``cached_at`` of every key-ordered lane that keeps no cached times: shared,
always empty (whatever writes cached times gets the lane's own container from
:func:`_align_cached_at` first)."""


@attrs.define(eq=False, slots=True)
class _Lane:
    key: StageKey | None
    definition: StageDefinition | None
    exclusive: bool
    name: str | None = None
    """The message key of a key-ordered lane (``None`` for other lanes)."""
    cached: deque[Message] | _Small[Message] = attrs.Factory(deque)
    """Cached messages in offset order; the head epoch's come first."""
    cached_at: deque[float] | _Small[float] = attrs.Factory(deque)
    """When each cached message was cached: empty, or aligned with ``cached`` (kept
    only once a ``now`` has been passed to ``put_messages``)."""
    epochs: deque[_Epoch] | _Small[_Epoch] = attrs.Factory(deque)
    current_epoch: _Epoch | None = None
    next_stage_offset: int = 0
    stage_start: int = 0
    """Stage offsets [stage_start, stage_end) belong to the stage of current_epoch."""
    stage_end: int = 0
    committed_stage_offset: int = -1
    """Stage offset of this lane at the committed consume offset (-1: none yet)."""
    in_flight: int = 0
    in_ready: bool = False

    def dispatchable(self) -> bool:
        if not self.cached:
            return False
        if self.exclusive and self.in_flight:
            return False
        return self.epochs[0].cached > 0


@attrs.define(eq=False, slots=True)
class Batch:
    """Messages taken together for one handler call.

    All messages of a batch belong to one queue, one stage key and one stage. A
    suspended batch is retried as a whole (``attempt`` counts its handler calls).
    """

    process_queue: ProcessQueue
    messages: list[Message]
    stage_index: int
    strategy_id: str | None
    group_id: str | None
    _lane: _Lane
    _epoch: _Epoch
    _cached_at: list[float] | None = None
    attempt: int = 1
    retry_at: float = 0.0

    @property
    def message_queue(self) -> MessageQueue:
        return self.process_queue.message_queue

    @property
    def cached_times(self) -> Sequence[float]:
        """When each message was cached (the ``now`` given to ``put_messages``), in
        the order of ``messages``. The batch's own list: read it, do not change it."""
        cached_at = self._cached_at
        return cached_at if cached_at is not None else [0.0] * len(self.messages)

    @property
    def runnable_at(self) -> float:
        """When the batch's stage last became runnable (its barrier opened), given
        ``now`` was passed to ``put_messages`` and the ``erase_*`` calls."""
        return self._epoch.runnable_at

    def __len__(self) -> int:
        return len(self.messages)

    def __iter__(self) -> Iterator[Message]:
        return iter(self.messages)


@attrs.frozen(kw_only=True)
class ProcessQueueStatistics:
    """A snapshot of one queue of a consumer (``statistics().queues[queue]``)."""

    message_queue: MessageQueue
    """The queue."""
    cached_count: int
    """Messages pulled and not yet taken by a handler."""
    pending_count: int
    """Messages taken by a handler (running or suspended) and not finished."""
    suspended_count: int
    """Pending messages waiting to be retried after a failure."""
    cached_bytes: int
    """Body bytes of cached and pending messages."""
    committed_offset: int
    """The lowest offset not finished: what a commit stores."""
    highest_offset: int
    """The highest offset pulled so far."""
    span: int
    """How far the unfinished messages reach, counted in messages (concurrent mode's
    flow control stops pulling at ``consume_concurrently_max_span``)."""
    stage_offsets: Mapping[StageKey, int]
    """Per stage key, its stage offset at the committed offset."""
    dropped: bool
    """Whether the queue was released: nothing more is taken from it."""
    held_count: int = 0
    """Messages held because a stage callback failed on the first of them."""
    max_offset: int | None = None
    """The broker's max offset of the queue (the offset the next message will get),
    as its last pull reported it; while the queue is not pulled (paused, or over its
    flow-control thresholds) the consumer asks the source for it every
    ``persist_consumer_offset_interval`` instead, so it is at most that old. ``None``
    until first known."""
    paused: bool = False
    """Whether handing out batches is paused (``PushConsumer.pause``)."""
    key_count: int = 0
    """Key-ordered mode: keys with messages cached or in a handler."""
    skipped_count: int = 0
    """Messages that arrived already finished (recorded by sparse progress, or by an
    exactly-once effect's mark) and were not handed to a handler."""
    finished_above: int = 0
    """Messages above the committed offset that finished (what sparse progress records)."""

    @property
    def lag(self) -> int | None:
        """Messages of the queue past its committed offset (``max_offset`` minus the
        committed offset): what is left to consume, as of ``max_offset`` (at most
        ``persist_consumer_offset_interval`` old for a paused queue); ``None`` while
        the max offset is unknown."""
        if self.max_offset is None:
            return None
        return max(0, self.max_offset - self.committed_offset)


def _align_cached_at(lane: _Lane) -> deque[float] | _Small[float]:
    """Pad ``lane.cached_at`` (on the left) to the length of ``lane.cached`` and return
    it (made, for a key-ordered lane that had none: see :data:`_NO_TIMES`)."""
    cached_at = lane.cached_at
    if cached_at is _NO_TIMES:
        cached_at = lane.cached_at = _Small() if type(lane.cached) is _Small else deque()
    missing = len(lane.cached) - len(cached_at)
    if missing > 0:
        cached_at.extendleft([0.0] * missing)
    return cached_at


def _put_back(lane: _Lane, messages: list[Message], times: list[float] | None) -> None:
    """Put ``messages`` (taken from the head of ``lane``, in offset order) back at its
    head, with their cached ``times``, keeping the cache in offset order: messages
    taken after them and given back first are merged in."""
    cached = lane.cached
    last = messages[-1].queue_offset
    if times is None and not lane.cached_at:  # no cached times kept
        if cached and cached[0].queue_offset < last:
            front = list(messages)
            while cached and cached[0].queue_offset < last:
                front.append(cached.popleft())
            front.sort(key=_offset_of)
            cached.extendleft(reversed(front))
        else:
            cached.extendleft(reversed(messages))
        return
    cached_at = _align_cached_at(lane)
    pairs = list(zip(messages, times if times is not None else [0.0] * len(messages), strict=True))
    if cached and cached[0].queue_offset < last:
        while cached and cached[0].queue_offset < last:
            pairs.append((cached.popleft(), cached_at.popleft()))
        pairs.sort(key=lambda pair: pair[0].queue_offset)
    cached.extendleft([message for message, _ in reversed(pairs)])
    cached_at.extendleft([at for _, at in reversed(pairs)])


def _pop_left(items: deque[_T], n: int) -> None:
    """Drop the first ``n`` items of ``items``: in C for many (a deque to consume the
    pops costs an allocation: few are dropped one by one)."""
    if n < 8:
        for _ in range(n):
            items.popleft()
    else:
        deque(starmap(items.popleft, repeat((), n)), 0)


_ONE_LANE: Final = (DEFAULT_STRATEGY, None)
"""The name (strategy, group) of the lane of a one-lane staged queue."""


def _offset_of(message: Message) -> int:
    return message.queue_offset


def _check_arguments(
    mode: ConsumeMode,
    start_offset: int,
    plan: StagePlan | None,
    key_of: Callable[[Message], str | None] | None,
) -> None:
    """Raise ``ValueError`` for arguments a :class:`ProcessQueue` cannot work with."""
    if start_offset < 0:
        raise ValueError(f"start_offset must be >= 0, got {start_offset}")
    if mode is ConsumeMode.STAGED and plan is None:
        raise ValueError("staged mode needs a StagePlan")
    if mode is ConsumeMode.KEY_ORDERED and key_of is None:
        raise ValueError("key-ordered mode needs key_of")


def _is_one_lane(plan: StagePlan | None) -> bool:
    """Whether every message of a staged queue joins one lane and takes the next stage
    offset: one strategy, no groups, no reset hook. The queue then keeps the two
    deques parallel to its order empty and counts the stage offset at the committed
    offset instead (``_stage_popped``: the lane's first stage offset plus the
    messages popped from the order)."""
    return plan is not None and (
        plan.compute_strategy is None and plan.compute_group is None and plan.reset is None
    )


def _ranges_ahead(
    finished: Sequence[tuple[int, int]], start_offset: int
) -> list[tuple[int, int]] | None:
    """The ranges of ``finished`` that reach ``start_offset`` or beyond, sorted; None
    when there are none."""
    return sorted((first, last) for first, last in finished if last >= start_offset) or None


class ProcessQueue:
    """Cached and pending messages of one message queue, and its committed progress.

    Ordering guarantee: depends on ``mode`` (see the module docstring); within every
    mode, the committed offset never passes an unfinished message.

    ``start_offset`` is the offset the queue resumes at and ``stage_offsets`` the
    committed stage offsets that go with it.
    """

    __slots__ = (
        "_awaiting_room",
        "_cached_bytes",
        "_cached_count",
        "_direct_lane",
        "_finished",
        "_flow",
        "_held",
        "_held_bytes",
        "_key_of",
        "_keyed",
        "_lanes",
        "_lanes_by_name",
        "_notice",
        "_one_lane",
        "_order",
        "_order_lanes",
        "_order_stages",
        "_pending_count",
        "_plan",
        "_skip",
        "_skip_at",
        "_stage_offsets",
        "_stage_popped",
        "_suspended_count",
        "_topic",
        "assignment_error",
        "dropped",
        "highest_offset",
        "in_ready",
        "lease_deadline",
        "max_offset",
        "message_queue",
        "mode",
        "notify_offset",
        "open_until",
        "paused",
        "ready_lanes",
        "ready_retries",
        "skipped_count",
        "transacted",
        "transactor",
    )

    def __init__(
        self,
        message_queue: MessageQueue,
        mode: ConsumeMode,
        *,
        start_offset: int = 0,
        stage_offsets: Mapping[StageKey, int] | None = None,
        plan: StagePlan | None = None,
        flow_control: FlowControl | None = None,
        key_of: Callable[[Message], str | None] | None = None,
        finished: Sequence[tuple[int, int]] = (),
    ) -> None:
        _check_arguments(mode, start_offset, plan, key_of)
        self._key_of = key_of
        self.message_queue = message_queue
        self.mode = mode
        self._topic = message_queue.topic
        self._plan = plan
        self._flow = flow_control if flow_control is not None else FlowControl()
        self.highest_offset = start_offset - 1
        # Offsets of unfinished messages (cached or pending) in offset order, with
        # finished offsets not yet at the head in ``_finished``. In staged mode two
        # parallel deques hold each message's lane and stage offset, for the committed
        # stage offsets. No object per message: the garbage collector's cost grows
        # with the number of live container objects, and these are ints.
        self._order: deque[int] = deque()
        self._finished: set[int] = set()
        self._order_lanes: deque[_Lane] | None = deque() if plan is not None else None
        self._order_stages: deque[int] = deque()
        self._one_lane = _is_one_lane(plan)
        self._cached_count = self._pending_count = self._suspended_count = 0
        self._cached_bytes = 0
        self._stage_offsets: dict[StageKey, int] = dict(stage_offsets or {})
        self._stage_popped = self._stage_offsets.get(StageKey(DEFAULT_STRATEGY, None), 0)
        self._lanes: dict[StageKey | None, _Lane] = {}
        self._lanes_by_name: dict[tuple[str | None, str | None], _Lane] = {}
        self.ready_lanes: deque[_Lane] = deque()
        """Lanes with a batch ready to take (read it, do not change it)."""
        self.ready_retries: deque[Batch] = deque()
        """Suspended batches due again (read it, do not change it)."""
        self._held: deque[Message] = deque()
        self._held_bytes = 0
        self.assignment_error: AssignmentFailure | None = None
        """Why messages are held (``None``: none are)."""
        self._awaiting_room = False
        self._notice = False
        """Whether finishing messages must look at ``_awaiting_room`` or ``dropped``
        (kept off the hot path otherwise)."""
        self._direct_lane = _Lane(None, None, exclusive=False)
        self.dropped = self.in_ready = False
        self.notify_offset = _NEVER
        """The shell's request: report ``COMMITTED`` when the committed offset reaches
        this offset (someone waits for it). By default nobody waits and ``COMMITTED`` is
        never reported; ``-1`` reports every move."""
        self.lease_deadline = _FOREVER
        """When the lease under which this queue is consumed ends (the shell's clock;
        infinite unless the queue is owned through a group lock). Set it with
        :meth:`set_lease`."""
        self.paused = False
        """Whether handing out batches is paused (:meth:`pause`)."""
        self.max_offset: int | None = None
        """The broker's max offset as the shell last saw it (statistics and lag)."""
        self.open_until = _FOREVER
        """Batches are handed out while the clock is before this: the lease deadline,
        or never while paused or dropped (the one thing the dispatcher checks)."""
        self._keyed: dict[str, _Lane] = {}
        self._skip = _ranges_ahead(finished, start_offset)
        """Ranges (first, last) of offsets that finished before this queue was built
        (sparse progress); None once the queue is past the last one."""
        self._skip_at = 0
        self.skipped_count = 0
        """Messages that arrived already finished (sparse progress) and were not
        handed to a handler."""
        self.transactor: object = None
        """The shell's: what ``transact`` of a handler's context calls."""
        self.transacted: set[int] | None = None
        """Offsets of pending messages whose finished mark the shell committed
        (exactly-once effects): finished whatever their handler call returns."""
        if mode is ConsumeMode.CONCURRENT or mode is ConsumeMode.ORDERLY:  # one lane
            self._lanes[None] = _Lane(None, None, exclusive=mode is ConsumeMode.ORDERLY)
        # (key-ordered lanes come and go with their keys, see _put_keyed; staged ones
        # with their stage keys, see _assign)

    # -- arrival -------------------------------------------------------------

    def put_messages(
        self,
        messages: Sequence[Message],
        *,
        highest_offset: int | None = None,
        now: float | None = None,
    ) -> Effects:
        """Cache pulled messages (in offset order).

        Messages at or below the highest offset already seen are ignored, so a
        repeated pull cannot count a message twice. ``highest_offset`` records
        offsets pulled but filtered out (for example by tag), so that the committed
        offset can move past them. ``now`` (optional) is recorded as the messages'
        cached time and, for a stage that becomes runnable, its runnable time (the
        shell passes it when message trace or metrics need them).

        Returns ``READY`` when a batch became ready, ``COMMITTED`` when the committed
        offset moved (filtered offsets) to :attr:`notify_offset` or past it, ``HELD``
        when a stage callback failed on a message (it and the rest are held, see
        :attr:`assignment_error`).
        """
        if self._skip is not None:
            return self._put_skipping(messages, highest_offset, now)
        if self._plan is None and self._key_of is None:
            return self._put_unstaged(messages, highest_offset, now)
        return self._put_assigned(messages, highest_offset, now)

    def _put_assigned(
        self, messages: Sequence[Message], highest_offset: int | None, now: float | None
    ) -> Effects:
        """:meth:`put_messages` for staged and key-ordered mode."""
        before = self.committed_offset
        if self._held:  # the queue stopped at a held message: the new ones wait behind it
            effects = self._hold(messages, 0, self.highest_offset)
        elif self._key_of is not None:
            effects = self._put_keyed(messages, self.highest_offset, now)
        else:
            effects = self._put_staged(messages, self.highest_offset, now)
        if highest_offset is not None and highest_offset > self.highest_offset:
            self.highest_offset = highest_offset
        return effects | self._committed_since(before)

    def _committed_since(self, before: int) -> Effects:
        """``COMMITTED`` if the committed offset moved from ``before`` to
        :attr:`notify_offset` or past it."""
        after = self.committed_offset
        return COMMITTED if after != before and after >= self.notify_offset else NOTHING

    def retry_assignment(self, now: float | None = None) -> Effects:
        """Assign the held messages again (the shell calls this a while after
        ``HELD``); returns ``HELD`` again if a callback still fails."""
        if not self._held:
            return NOTHING
        held = list(self._held)
        self._held.clear()
        self._held_bytes = 0
        self.assignment_error = None
        before = self.committed_offset
        if self._skip is not None:
            self.highest_offset = held[0].queue_offset - 1
            self._skip_at = 0  # held offsets were looked up already: from the start
            return self._put_skipping(held, None, now)
        put = self._put_keyed if self._key_of is not None else self._put_staged
        effects = put(held, held[0].queue_offset - 1, now)
        return effects | self._committed_since(before)

    # -- sparse progress -------------------------------------------------------

    def _already_finished(self, offset: int) -> bool:
        """Whether ``offset`` is in a range given as ``finished`` (offsets asked in
        ascending order)."""
        skip = self._skip
        assert skip is not None
        i = self._skip_at
        while i < len(skip) and skip[i][1] < offset:
            i += 1
        self._skip_at = i
        return i < len(skip) and skip[i][0] <= offset

    def _put_skipping(
        self, messages: Sequence[Message], highest_offset: int | None, now: float | None
    ) -> Effects:
        """:meth:`put_messages` while ranges of finished offsets lie ahead: messages in
        them join the queue finished, the others as usual."""
        before = self.committed_offset
        effects = NOTHING
        plain: list[Message] = []
        for message in messages:
            offset = message.queue_offset
            if offset <= self.highest_offset or not self._already_finished(offset):
                plain.append(message)
                continue
            if plain:
                effects |= self._put_plain(plain, now)
                plain = []
            effects |= self._put_finished(message)
        if plain:
            effects |= self._put_plain(plain, now)
        if highest_offset is not None and highest_offset > self.highest_offset:
            self.highest_offset = highest_offset
        skip = self._skip
        if skip is not None and self.highest_offset >= skip[-1][1]:
            self._skip = None  # past the last range: back to the plain path
        self._pop_finished_head()
        return effects | self._committed_since(before)

    def _put_plain(self, messages: Sequence[Message], now: float | None) -> Effects:
        if self._plan is None and self._key_of is None:
            return self._put_unstaged(messages, None, now)
        return self._put_assigned(messages, None, now)

    def _put_finished(self, message: Message) -> Effects:
        """Add ``message``, which finished before the queue was built: in staged mode
        assigned its stage (stage offsets count it), finished at once."""
        offset = message.queue_offset
        if self._held:  # behind a held message: it waits with the rest
            return self._hold((message,), 0, self.highest_offset)
        order_lanes = self._order_lanes
        if order_lanes is not None and self._key_of is None:
            try:
                lane, _epoch, stage_offset = self._assign(message)
            except _AssignError as error:
                self.assignment_error = error.failure
                return self._hold((message,), 0, self.highest_offset)
            if not self._one_lane:
                order_lanes.append(lane)
                self._order_stages.append(stage_offset)
        self._order.append(offset)
        self._finished.add(offset)
        self.highest_offset = offset
        self.skipped_count += 1
        return NOTHING

    def _pop_finished_head(self) -> None:
        if self._one_lane:
            self._pop_staged_head(0)
            return
        order = self._order
        finished = self._finished
        order_lanes = self._order_lanes
        while order and order[0] in finished:
            finished.remove(order.popleft())
            if order_lanes is not None:
                order_lanes.popleft().committed_stage_offset = self._order_stages.popleft() + 1

    def finished_ranges(self, limit: int) -> tuple[tuple[tuple[int, int], ...], bool]:
        """Runs ``(first, last)`` of finished offsets above :attr:`committed_offset`, in
        offset order (no unfinished message lies within a run), at most ``limit`` of
        them: the lowest ones, and whether some were left out. The ranges given as
        ``finished`` that the queue has not reached yet are among them."""
        ranges, cut = self._seen_ranges(limit)
        skip = self._skip
        if skip is None or cut:
            return ranges, cut
        ahead = [
            (max(first, self.highest_offset + 1), last)
            for first, last in skip[self._skip_at :]
            if last > self.highest_offset
        ]
        if not ahead:
            return ranges, cut
        merged = list(ranges)
        if merged and ahead[0][0] == merged[-1][1] + 1 and not self._order_ends_unfinished():
            merged[-1] = (merged[-1][0], ahead.pop(0)[1])
        merged += ahead
        if len(merged) > limit:
            return tuple(merged[:limit]), True
        return tuple(merged), False

    def _order_ends_unfinished(self) -> bool:
        order = self._order
        return bool(order) and order[-1] not in self._finished

    def _seen_ranges(self, limit: int) -> tuple[tuple[tuple[int, int], ...], bool]:
        finished = self._finished
        if not finished:
            return (), False
        if limit <= 0:
            return (), True
        ranges: list[tuple[int, int]] = []
        first = last = -1
        seen = 0
        for offset in self._order:
            if offset in finished:
                if first < 0:
                    first = offset
                last = offset
                seen += 1
            elif first >= 0:
                ranges.append((first, last))
                first = -1
                if len(ranges) == limit:
                    return tuple(ranges), seen < len(finished)
                if seen == len(finished):
                    break
        if first >= 0:
            if len(ranges) == limit:
                return tuple(ranges), True
            ranges.append((first, last))
        return tuple(ranges), False

    def _hold(self, messages: Sequence[Message], start: int, highest: int) -> Effects:
        """Hold ``messages[start:]`` (those above ``highest``) behind the held ones."""
        held = self._held
        size = 0
        for message in messages[start:] if start else messages:
            if message.queue_offset > highest:
                held.append(message)
                highest = message.queue_offset
                size += len(message.body)
        self._held_bytes += size
        if highest > self.highest_offset:
            self.highest_offset = highest
        return HELD

    def _put_staged(self, messages: Sequence[Message], highest: int, now: float | None) -> Effects:
        """Assign ``messages`` above ``highest`` to stages and cache them, in order.

        Stops at the first message a stage callback fails on and holds it and the
        rest (``HELD``)."""
        at = 0.0 if now is None else now
        one_lane = self._one_lane  # within a stage, assigning is then counting (fast)
        fast: _Lane | None = None
        fast_epoch = _Epoch(TAIL_STAGE)  # replaced with fast's epoch before use
        touched: list[_Lane] = []
        if one_lane:  # the lane's current stage goes on where the last put left it
            fast = self._lanes_by_name.get(_ONE_LANE)
            if fast is not None and fast.current_epoch is not None:
                fast_epoch = fast.current_epoch
                touched.append(fast)
            else:
                fast = None
        order, order_lanes, order_stages = self._order, self._order_lanes, self._order_stages
        assert order_lanes is not None
        timed = now is not None
        effects = NOTHING
        added = size_total = i = 0
        count = len(messages)
        while i < count:
            message = messages[i]
            offset = message.queue_offset
            if offset <= highest:
                i += 1
                continue
            run: Sequence[Message]
            if fast is not None and fast.next_stage_offset < fast.stage_end:
                # The rest of the current stage of the only lane joins at once (pulled
                # messages come in offset order, so all of the run is new).
                lane, epoch = fast, fast_epoch
                k = min(count - i, lane.stage_end - lane.next_stage_offset)
                run = messages[i : i + k]
                first_stage_offset = lane.next_stage_offset
                lane.next_stage_offset = first_stage_offset + k
            else:
                try:
                    lane, epoch, first_stage_offset = self._assign(message)
                except _AssignError as error:
                    self.assignment_error = error.failure
                    effects = self._hold(messages, i, highest)
                    break
                if one_lane:
                    fast, fast_epoch = lane, epoch
                if not touched or touched[-1] is not lane:
                    touched.append(lane)
                k = 1
                run = (message,)
            for message in run:
                size_total += len(message.body)
            epoch.unfinished += k
            epoch.cached += k
            if not epoch.queued:
                epoch.queued = True
                if not lane.epochs:
                    epoch.runnable_at = at
                lane.epochs.append(epoch)
            if timed or lane.cached_at:
                _align_cached_at(lane).extend([at] * k)
            lane.cached.extend(run)
            first = run[0].queue_offset
            if run[-1].queue_offset - first == k - 1:  # consecutive (offsets ascend)
                order.extend(range(first, first + k))
            else:
                order.extend([message.queue_offset for message in run])
            if not one_lane:
                order_lanes.extend([lane] * k)
                order_stages.extend(range(first_stage_offset, first_stage_offset + k))
            highest = run[-1].queue_offset
            added += k
            i += k
        if highest > self.highest_offset:
            self.highest_offset = highest
        self._cached_count += added
        self._cached_bytes += size_total
        return effects | self._ready_touched(touched)

    def _ready_touched(self, touched: list[_Lane]) -> Effects:
        """Put the lanes of ``touched`` that have a batch to take now in line:
        ``READY`` if any."""
        effects = NOTHING
        for lane in touched:
            if not lane.in_ready and lane.dispatchable():
                lane.in_ready = True
                self.ready_lanes.append(lane)
                effects = READY
        return effects

    def _put_unstaged(
        self, messages: Sequence[Message], highest_offset: int | None, now: float | None
    ) -> Effects:
        """:meth:`put_messages` for concurrent and orderly mode: one lane, one epoch."""
        at = 0.0 if now is None else now
        lane = self._lanes[None]
        epoch = lane.current_epoch
        if epoch is None:
            epoch = lane.current_epoch = _Epoch(TAIL_STAGE)
        cached = lane.cached
        order = self._order
        highest = self.highest_offset
        committed_before = order[0] if order else highest + 1
        before = len(cached)
        size_total = 0
        if messages and messages[0].queue_offset > highest:  # the usual case: all new
            for message in messages:
                size_total += len(message.body)
            cached.extend(messages)
            first = messages[0].queue_offset
            highest = messages[-1].queue_offset
            if highest - first == len(messages) - 1:  # consecutive (offsets ascend)
                order.extend(range(first, highest + 1))
            else:
                order.extend([message.queue_offset for message in messages])
        else:
            for message in messages:
                offset = message.queue_offset
                if offset <= highest:
                    continue
                highest = offset
                size_total += len(message.body)
                cached.append(message)
                order.append(offset)
        if highest_offset is not None and highest_offset > highest:
            highest = highest_offset
        self.highest_offset = highest
        effects = self._committed_since(committed_before)
        added = len(cached) - before
        if not added:
            return effects
        if now is not None or lane.cached_at:
            cached_at = lane.cached_at
            if len(cached_at) < before:
                cached_at.extendleft([0.0] * (before - len(cached_at)))
            cached_at.extend([at] * added)
        if not epoch.queued:
            epoch.queued = True
            epoch.runnable_at = at
            lane.epochs.append(epoch)
        epoch.unfinished += added
        epoch.cached += added
        self._cached_count += added
        self._cached_bytes += size_total
        if not lane.in_ready and lane.dispatchable():
            lane.in_ready = True
            self.ready_lanes.append(lane)
            return effects | READY
        return effects

    def _put_keyed(self, messages: Sequence[Message], highest: int, now: float | None) -> Effects:
        """Key-ordered mode: cache ``messages`` above ``highest``, each in the exclusive
        lane of its key (made on first use), or the unordered lane without a key. Stops
        at the first message ``key_of`` fails on and holds it and the rest (``HELD``)."""
        key_of = self._key_of
        assert key_of is not None
        at = 0.0 if now is None else now
        order = self._order
        lanes = self._keyed
        touched: list[_Lane] = []
        effects = NOTHING
        added = 0
        size_total = 0
        for i, message in enumerate(messages):
            offset = message.queue_offset
            if offset <= highest:
                continue
            try:
                key = key_of(message)
            except Exception as exc:
                self.assignment_error = _callback_failed(message, "compute_key", exc).failure
                effects = self._hold(messages, i, highest)
                break
            if key is None:
                lane = self._direct_lane
            elif type(key) is not str:
                failed = _bad_value(message, "compute_key", key, "a str or None")
                self.assignment_error = failed.failure
                effects = self._hold(messages, i, highest)
                break
            else:
                lane_or_none = lanes.get(key)
                if lane_or_none is None:
                    lane = lanes[key] = _Lane(None, None, True, key, _Small(), _NO_TIMES, _Small())
                else:
                    lane = lane_or_none
                    if len(lane.cached) == _SMALL_MAX and type(lane.cached) is _Small:
                        lane.cached = deque(lane.cached)  # a key with a backlog
                        if lane.cached_at is not _NO_TIMES:
                            lane.cached_at = deque(lane.cached_at)
            epoch = lane.current_epoch
            if epoch is None:
                epoch = lane.current_epoch = _Epoch(TAIL_STAGE)
            if not epoch.queued:
                epoch.queued = True
                epoch.runnable_at = at
                lane.epochs.append(epoch)
            epoch.unfinished += 1
            epoch.cached += 1
            if now is not None or lane.cached_at:
                _align_cached_at(lane).append(at)
            lane.cached.append(message)
            order.append(offset)
            highest = offset
            size_total += len(message.body)
            added += 1
            if not lane.in_ready:
                touched.append(lane)
        if highest > self.highest_offset:
            self.highest_offset = highest
        self._cached_count += added
        self._cached_bytes += size_total
        return effects | self._ready_touched(touched)

    @property
    def key_count(self) -> int:
        """Keys with messages cached or pending (key-ordered mode): the lanes kept."""
        return len(self._keyed)

    def _assign(self, message: Message) -> tuple[_Lane, _Epoch, int]:
        plan = self._plan
        if plan is None:
            lane = self._lanes[None]
            epoch = lane.current_epoch
            if epoch is None:
                epoch = lane.current_epoch = _Epoch(TAIL_STAGE)
            return lane, epoch, -1
        strategy: str | None = DEFAULT_STRATEGY
        group: str | None = None
        if plan.compute_strategy is not None:
            try:
                strategy = plan.compute_strategy(message)
            except Exception as exc:
                raise _callback_failed(message, "compute_strategy", exc) from exc
            if strategy is not None and type(strategy) is not str:
                raise _bad_value(message, "compute_strategy", strategy, "a str or None")
        if plan.compute_group is not None:
            try:
                group = plan.compute_group(message)
            except Exception as exc:
                raise _callback_failed(message, "compute_group", exc) from exc
            if group is not None and type(group) is not str:
                raise _bad_value(message, "compute_group", group, "a str or None")
        lane_or_none = self._lanes_by_name.get((strategy, group))
        if lane_or_none is None:
            if strategy is None:
                lane = self._direct_lane
                epoch = lane.current_epoch
                if epoch is None:
                    epoch = lane.current_epoch = _Epoch(TAIL_STAGE)
                return lane, epoch, -1
            definition = plan.definitions.get(strategy)
            if definition is None:  # a typo must not drop the ordering silently
                raise _bad_value(message, "compute_strategy", strategy, _strategy_ids(plan))
            key = StageKey(strategy, group)
            lane = self._lanes[key] = _Lane(key, definition, exclusive=False)
            lane.next_stage_offset = self._stage_offsets.get(key, 0)
            self._lanes_by_name[(strategy, group)] = lane
        else:
            lane = lane_or_none
        if lane is self._direct_lane:
            epoch = lane.current_epoch
            assert epoch is not None
            return lane, epoch, -1
        offset = lane.next_stage_offset
        epoch = lane.current_epoch
        reset = plan.reset
        if reset is None and epoch is not None and lane.stage_start <= offset < lane.stage_end:
            lane.next_stage_offset = offset + 1  # same stage as the previous message
            return lane, epoch, offset
        definition = lane.definition
        assert definition is not None
        changed = False
        if reset is not None and (offset >= definition.total or definition.is_boundary(offset)):
            name = "reset_current_stage_offset_if_need"
            try:
                wanted = reset(self._topic, offset)
            except Exception as exc:
                raise _callback_failed(message, name, exc) from exc
            if type(wanted) is not int or wanted < 0:
                raise _bad_value(message, name, wanted, "an int >= 0")
            if wanted != offset:
                offset = wanted
                changed = True
        index = definition.stage_index(offset)
        if epoch is None or changed or epoch.stage_index != index:
            epoch = lane.current_epoch = _Epoch(index)
        if index == TAIL_STAGE:
            lane.stage_start, lane.stage_end = definition.total, 1 << 62
        else:
            lane.stage_start = definition.boundaries[index - 1] if index else 0
            lane.stage_end = definition.boundaries[index]
        lane.next_stage_offset = offset + 1
        return lane, epoch, offset

    # -- taking ----------------------------------------------------------------

    def has_ready(self) -> bool:
        """Whether a batch can be taken now."""
        return bool(self.ready_lanes or self.ready_retries)

    def try_take_messages(self, max_count: int) -> Batch | None:
        """Take a batch of up to ``max_count`` messages that may run now, or ``None``.

        A batch holds messages of one lane and one stage, in offset order. Retries of
        suspended batches come first (``max_count`` does not split them). In staged
        mode this is the stage-aware take: a
        batch never crosses a stage boundary, and no message of a later stage is
        taken while a message of an earlier stage of its key is unfinished.
        """
        if self.ready_retries:
            batch = self.ready_retries.popleft()
            self._suspended_count -= len(batch.messages)
            return batch
        ready = self.ready_lanes
        while ready:
            lane = ready.popleft()
            cached = lane.cached
            if not cached or (lane.exclusive and lane.in_flight):
                lane.in_ready = False
                continue
            epoch = lane.epochs[0]
            n = epoch.cached
            if not n:  # the head stage is all taken: its barrier is closed
                lane.in_ready = False
                continue
            if n > max_count:
                n = max_count
            if n == 1:
                messages = [cached.popleft()]
            else:
                messages = list(starmap(cached.popleft, repeat((), n)))
            epoch.cached -= n
            lane.in_flight += 1
            if epoch.cached and not lane.exclusive:
                ready.append(lane)
            else:
                lane.in_ready = False
            self._cached_count -= n
            self._pending_count += n
            cached_at = lane.cached_at
            if not cached_at:
                times = None
            elif n == 1:
                times = [cached_at.popleft()]
            else:
                times = list(starmap(cached_at.popleft, repeat((), n)))
            key = lane.key
            if key is None:
                return Batch(self, messages, epoch.stage_index, None, None, lane, epoch, times)
            return Batch(
                self,
                messages,
                epoch.stage_index,
                key.strategy_id,
                key.group_id,
                lane,
                epoch,
                times,
            )
        return None

    def take_next(self, batch: Batch, now: float = NO_LEASE) -> Message | None:
        """Add the next cached message of ``batch``'s lane and stage to ``batch`` and
        return it, or ``None`` when there is none (or the queue gives nothing now:
        paused, dropped or past its lease at ``now``, as for :meth:`Dispatcher.take`;
        or ``batch`` is a retry).

        For handler calls of one message each that run back to back on one batch,
        finished together: each message costs what taking it costs, not a batch of its
        own (the shell's runs take several at once, :meth:`take_more`). The lane's
        readiness is untouched: the messages left stay where any worker can take them.
        """
        if self.take_more(batch, 1, now):
            return batch.messages[-1]
        return None

    def take_more(self, batch: Batch, max_count: int, now: float = NO_LEASE) -> int:
        """Add up to ``max_count`` next cached messages of ``batch``'s lane and stage
        to ``batch`` and return how many: 0 when there is none, ``max_count`` is 0, the
        queue gives nothing now (paused, dropped or past its lease at ``now``, as for
        :meth:`Dispatcher.take`) or ``batch`` is a retry.

        For the shell's runs, which take messages ahead of the calls they make: what a
        run took and did not call goes back with :meth:`untake_rest` before anything
        else can see the queue.
        """
        epoch = batch._epoch
        n = epoch.cached
        if not n or self.open_until <= now or batch.attempt != 1:
            return 0
        if n > max_count:
            n = max_count
        lane = batch._lane
        cached = lane.cached
        if n == 1:
            batch.messages.append(cached.popleft())
        else:
            batch.messages += starmap(cached.popleft, repeat((), n))
        epoch.cached -= n
        self._cached_count -= n
        self._pending_count += n
        cached_at = lane.cached_at
        times = batch._cached_at
        if cached_at:
            taken = list(starmap(cached_at.popleft, repeat((), n)))
            if times is not None:
                times += taken
        elif times is not None:
            times += [0.0] * n
        return n

    def untake_rest(self, batch: Batch, keep: int) -> None:
        """Give back the messages of ``batch`` from index ``keep`` on, taken by
        :meth:`take_next` or :meth:`take_more` and not handed to a handler, as if they
        had never been taken: they go back to the head of their lane's cache, with
        their cached times; the counts are as before the take. The lane's readiness
        is untouched (taking them did not change it)."""
        messages = batch.messages
        n = len(messages) - keep
        if n <= 0:
            return
        rest = messages[keep:]
        del messages[keep:]
        times = batch._cached_at
        rest_times = None
        if times is not None:
            rest_times = times[keep:]
            del times[keep:]
        _put_back(batch._lane, rest, rest_times)
        batch._epoch.cached += n
        self._cached_count += n
        self._pending_count -= n

    def try_take_fifo_message(self) -> Batch | None:
        """Take the next single message of an exclusive (orderly) lane, or ``None``."""
        return self.try_take_messages(1)

    def untake_messages(self, batch: Batch) -> Effects:
        """Give back ``batch``, taken and not handed to a handler, as if it had never
        been taken.

        For the shell, when a queue's lease ended (or it was released) between the
        take and the start of the handler: the handler must not run, and whoever
        consumes the queue then gets the messages as they were. The messages go back
        to the head of their lane's cache in offset order, with their cached times;
        the lane is first in line again. A retry (a suspended batch taken again) is
        suspended again and first in line among the retries. Taking changed nothing
        else, so nothing else changes: no attempt is counted, no ``reconsume_times``
        raised, the committed offset, stage offsets and flow control stay as they
        are. Returns ``READY``, or, when the queue was dropped meanwhile (nothing of
        it is handed out again), ``DRAINED`` if no other batch of it is in a handler.
        """
        n = len(batch.messages)
        if batch.attempt != 1:  # a retry: pending and suspended, as before the take
            self._suspended_count += n
            if not self.dropped:
                self.ready_retries.appendleft(batch)
                return READY
        else:
            lane = batch._lane
            _put_back(lane, batch.messages, batch._cached_at)
            batch._epoch.cached += n  # the head epoch: its messages are unfinished
            lane.in_flight -= 1
            self._cached_count += n
            self._pending_count -= n
            if not self.dropped:
                ready = self.ready_lanes
                if lane.in_ready:
                    ready.remove(lane)  # first in line again, as before the take
                lane.in_ready = True
                ready.appendleft(lane)
                return READY
        return DRAINED if self._pending_count == self._suspended_count else NOTHING

    # -- finishing ---------------------------------------------------------------

    def erase_messages(
        self, batch: Batch, status: EraseStatus, now: float | None = None
    ) -> Effects:
        """Mark every message of ``batch`` finished.

        Finished means: the handler succeeded, or the message was handed to the retry
        queue or to the dead-letter queue. The committed offset moves past the lowest
        run of finished messages. Returns ``READY`` when a batch became ready,
        ``COMMITTED`` when the committed offset moved to :attr:`notify_offset` or past
        it, ``ROOM`` when pulling paused for flow control may resume, ``DRAINED`` when
        the last batch in a handler of a dropped queue finished.
        """
        del status  # every status finishes the message; the caller keeps the counts
        lane = batch._lane
        lane.in_flight -= 1
        return self._finish_messages(batch.messages, lane, batch._epoch, now)

    def erase_fifo_message(
        self, batch: Batch, status: EraseStatus, now: float | None = None
    ) -> Effects:
        """:meth:`erase_messages` for a batch taken by :meth:`try_take_fifo_message`."""
        return self.erase_messages(batch, status, now)

    def erase_some(
        self,
        batch: Batch,
        messages: Sequence[Message],
        status: EraseStatus,
        now: float | None = None,
    ) -> Effects:
        """Finish only ``messages`` of ``batch``; the rest stay pending in the batch.

        Used when some messages of a failed batch go to the dead-letter queue and the
        others are suspended.
        """
        del status
        wanted = {id(m) for m in messages}
        keep = [i for i, m in enumerate(batch.messages) if id(m) not in wanted]
        done = [m for m in batch.messages if id(m) in wanted]
        if batch._cached_at is not None:
            batch._cached_at = [batch._cached_at[i] for i in keep]
        batch.messages = [batch.messages[i] for i in keep]
        lane = batch._lane
        if not keep:
            lane.in_flight -= 1
        return self._finish_messages(done, lane, batch._epoch, now)

    def _noticed(self) -> Effects:
        """``ROOM`` or ``DRAINED``, after messages finished (see ``_notice``)."""
        effects = NOTHING
        if self._awaiting_room and not self.is_cache_full():
            self._awaiting_room = False
            self._notice = self.dropped
            effects = ROOM
        if self.dropped and self._pending_count == self._suspended_count:
            effects |= DRAINED
        return effects

    def _finish_messages(
        self, messages: list[Message], lane: _Lane, epoch: _Epoch, now: float | None = None
    ) -> Effects:
        """Mark ``messages`` (all of ``epoch`` of ``lane``) finished."""
        effects = NOTHING
        n = len(messages)
        order = self._order
        finished = self._finished
        head = 0  # how many of the order's first offsets are the messages'
        at_head = False
        if n == 1:
            message = messages[0]
            self._cached_bytes -= len(message.body)
            offset = message.queue_offset
            if order[0] != offset:
                finished.add(offset)
            else:
                head = 1
                at_head = True
        else:
            size = 0
            if order[0] == messages[0].queue_offset and order[n - 1] == messages[-1].queue_offset:
                # The messages (in offset order, all pending) are the order's first n
                # (a run, a queue's only worker): they leave without entering the set.
                for message in messages:
                    size += len(message.body)
                head = n
                at_head = True
            else:
                for message in messages:
                    size += len(message.body)
                    finished.add(message.queue_offset)
                at_head = order[0] in finished
            self._cached_bytes -= size
        epoch.unfinished -= n
        self._pending_count -= n
        epochs = lane.epochs
        while epochs and not epochs[0].unfinished:
            epochs.popleft().queued = False
            if epochs and now is not None:
                epochs[0].runnable_at = now  # the next stage's barrier opens
        if at_head:
            # Pop the finished run at the head; a single message finished at the head
            # is popped without entering the set.
            order_lanes = self._order_lanes
            if order_lanes is None:
                if head == 1:
                    order.popleft()
                elif head:
                    deque(starmap(order.popleft, repeat((), head)), 0)  # pops `head`, in C
                while order and order[0] in finished:
                    finished.remove(order.popleft())
            else:
                self._pop_staged_head(head)
            notify = self.notify_offset
            if notify != _NEVER:  # someone waits for progress
                held = self._held
                committed = (
                    order[0] if order else held[0].queue_offset if held else self.highest_offset + 1
                )
                if committed >= notify:
                    effects = COMMITTED
        if self._notice:  # pulling paused for flow control, or the queue was dropped
            effects |= self._noticed()
            if self.dropped:
                return effects
        if lane.name is not None and not epochs and not lane.in_flight:
            del self._keyed[lane.name]  # nothing of this key left: forget it
            return effects
        if lane.in_ready or not lane.cached or (lane.exclusive and lane.in_flight):
            return effects
        if not epochs[0].cached:
            return effects
        lane.in_ready = True
        self.ready_lanes.append(lane)
        return effects | READY

    def _pop_staged_head(self, head: int) -> None:
        """Staged mode: pop the finished run at the head of the order (its first
        ``head`` offsets, messages of one lane, and those finished before), moving the
        committed stage offset of each lane it passes."""
        order, order_lanes, order_stages = self._order, self._order_lanes, self._order_stages
        assert order_lanes is not None
        finished = self._finished
        if self._one_lane:
            before = len(order)
            if head == 1:
                order.popleft()
            elif head:
                _pop_left(order, head)
            while order and order[0] in finished:
                finished.remove(order.popleft())
            if before != len(order):
                self._stage_popped += before - len(order)
                lane = self._lanes_by_name[_ONE_LANE]
                lane.committed_stage_offset = self._stage_popped
            return
        if head > 1:  # the messages, all of one lane: its offset is the last's
            skip = head - 1
            _pop_left(order, skip)
            _pop_left(order_lanes, skip)
            _pop_left(order_stages, skip)
        if head:
            order.popleft()
            order_lanes.popleft().committed_stage_offset = order_stages.popleft() + 1
        while order and order[0] in finished:
            finished.remove(order.popleft())
            order_lanes.popleft().committed_stage_offset = order_stages.popleft() + 1

    def suspend_messages(self, batch: Batch, retry_at: float) -> None:
        """Hold ``batch`` back until ``retry_at``, counting one more attempt.

        The messages stay pending (they are neither cached twice nor counted twice),
        keep the stage they had, and their ``reconsume_times`` goes up by one. Until
        the batch finishes, its stage does not complete (and, in orderly mode, the
        queue takes nothing else).
        """
        batch.retry_at = retry_at
        batch.attempt += 1
        batch.messages = [
            attrs.evolve(message, reconsume_times=message.reconsume_times + 1)
            for message in batch.messages
        ]
        self._suspended_count += len(batch.messages)

    def resume(self, batch: Batch) -> Effects:
        """Make a suspended ``batch`` ready to be taken again (its timer expired)."""
        if self.dropped:
            return NOTHING
        self.ready_retries.append(batch)
        return READY

    # -- progress ----------------------------------------------------------------

    @property
    def committed_offset(self) -> int:
        """Lowest unfinished offset (held ones included), or highest-seen + 1 when
        nothing is unfinished."""
        order = self._order
        if order:
            return order[0]
        if self._held:
            return self._held[0].queue_offset
        return self.highest_offset + 1

    @property
    def committed_stage_offsets(self) -> Mapping[StageKey, int]:
        """Stage offset of every known stage key at :attr:`committed_offset`."""
        offsets = dict(self._stage_offsets)
        for key, lane in self._lanes.items():
            if key is not None and lane.committed_stage_offset >= 0:
                offsets[key] = lane.committed_stage_offset
        return MappingProxyType(offsets)

    @property
    def finished_above(self) -> int:
        """Finished messages above :attr:`committed_offset` (see :meth:`finished_ranges`)."""
        return len(self._finished)

    @property
    def unfinished_count(self) -> int:
        return self._cached_count + self._pending_count + len(self._held)

    @property
    def in_handlers(self) -> int:
        """Messages taken and not finished, suspended ones left out: those in a
        handler call (or about to be settled)."""
        return self._pending_count - self._suspended_count

    @property
    def held_count(self) -> int:
        """Messages held behind a failed stage assignment (see :attr:`assignment_error`)."""
        return len(self._held)

    @property
    def cached_count(self) -> int:
        return self._cached_count

    @property
    def pending_count(self) -> int:
        return self._pending_count

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    @property
    def span(self) -> int:
        """How far the unfinished messages reach, counted in messages: from the
        oldest unfinished one to the newest cached, one less than their number (the
        offset distance when offsets are consecutive). Counted, not subtracted, so
        that sparse offsets (a Redis stream attached with its entry ids) span what
        the queue holds, not the distance between ids."""
        n = len(self._order) or len(self._held)
        return n - 1 if n else 0

    def is_cache_full(self) -> bool:
        """Whether pulling should pause (flow control by count, bytes and span)."""
        flow = self._flow
        if self._cached_count + self._pending_count + len(self._held) >= flow.count:
            return True
        if self._cached_bytes + self._held_bytes >= flow.size_bytes:
            return True
        return flow.max_span is not None and self.span >= flow.max_span

    def should_pause_pull(self) -> bool:
        """:meth:`is_cache_full`, for the pull loop: when it returns ``True``, the call
        that brings the queue back under its thresholds returns ``ROOM``."""
        full = self._awaiting_room = self.is_cache_full()
        self._notice = full or self.dropped
        return full

    def set_lease(self, deadline: float) -> None:
        """The lease under which the queue is consumed now ends at ``deadline``."""
        self.lease_deadline = deadline
        self._reopen()

    def pause(self) -> None:
        """Hand out no more batches (those in handlers finish) until :meth:`unpause`."""
        self.paused = True
        self._reopen()

    def unpause(self) -> None:
        """Undo :meth:`pause`."""
        self.paused = False
        self._reopen()

    def _reopen(self) -> None:
        closed = self.paused or self.dropped
        self.open_until = float("-inf") if closed else self.lease_deadline

    def move_to(self, offset: int) -> None:
        """Resume an idle queue at ``offset``: the next message expected is ``offset``
        and the committed offset becomes ``offset``, backwards too, stage offsets
        unchanged. For the shell's correction of a position past the source's end
        (RocketMQ's ``OFFSET_ILLEGAL``); only when nothing is unfinished, so the
        committed offset still passes no unfinished message."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        if self.unfinished_count:
            raise ValueError(
                f"{self.message_queue}: cannot move a queue with {self.unfinished_count}"
                " unfinished messages"
            )
        self.highest_offset = offset - 1

    def drop(self) -> None:
        """Mark the queue released: nothing more is taken from it (finishing its last
        batch in a handler returns ``DRAINED``; see :attr:`in_handlers`)."""
        self.dropped = True
        self._notice = True
        self._reopen()
        self.ready_lanes.clear()
        self.ready_retries.clear()

    def statistics(self) -> ProcessQueueStatistics:
        return ProcessQueueStatistics(
            message_queue=self.message_queue,
            cached_count=self._cached_count,
            pending_count=self._pending_count,
            suspended_count=self._suspended_count,
            cached_bytes=self._cached_bytes,
            committed_offset=self.committed_offset,
            highest_offset=self.highest_offset,
            span=self.span,
            stage_offsets=self.committed_stage_offsets,
            dropped=self.dropped,
            held_count=len(self._held),
            skipped_count=self.skipped_count,
            finished_above=len(self._finished),
            max_offset=self.max_offset,
            paused=self.paused,
            key_count=len(self._keyed),
        )
