"""Hypothesis strategies for workloads: messages, stage definitions, failures, costs.

Each returns a plain ``SearchStrategy`` that composes with your own (``.map``,
``st.builds``, ``@st.composite``): pass your key or body strategies in, or draw a
strategy's parts yourself.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from .._message import OutgoingMessage

__all__ = (
    "HYPOTHESIS_PROFILE",
    "FailureKind",
    "FailureSchedule",
    "MessageSpec",
    "failure_schedules",
    "handler_costs",
    "messages",
    "stage_definitions",
)


HYPOTHESIS_PROFILE = "stagedconsumer"
"""A hypothesis settings profile for ``run_virtual`` properties, registered on import:
no deadline (an example takes milliseconds on an idle machine, far more on a loaded
one), no ``too_slow`` health check, and no ``explain`` phase (it re-runs a failing
example hundreds of times under a tracer). Load it with
``settings.load_profile(HYPOTHESIS_PROFILE)`` or ``pytest --hypothesis-profile
stagedconsumer``; the example budget stays hypothesis's default (100)."""

settings.register_profile(
    HYPOTHESIS_PROFILE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[phase for phase in Phase if phase is not Phase.explain],
)


@attrs.frozen(kw_only=True)
class MessageSpec:
    """A message to send before consuming: what :func:`messages` draws and
    ``run_virtual`` sends, in order (``queue_id=None``: the broker picks the queue, by
    the hash of the first key, else round-robin)."""

    topic: str
    """The topic to send to."""
    queue_id: int | None
    """The queue to send to, or ``None``: the broker picks it."""
    body: bytes = b""
    """The message body."""
    keys: tuple[str, ...] = ()
    """The message's keys (the first one picks its queue when ``queue_id`` is ``None``)."""
    tags: str | None = None
    """The message's tag, or ``None``."""
    properties: Mapping[str, str] = attrs.field(factory=dict)
    """The message's user properties."""

    @classmethod
    def of(
        cls, topic: str, message: OutgoingMessage, *, queue_id: int | None = None
    ) -> MessageSpec:
        """The spec of sending ``message`` to ``topic`` (and ``queue_id``)."""
        return cls(
            topic=topic,
            queue_id=queue_id,
            body=message.body,
            keys=message.keys,
            tags=message.tags,
            properties=dict(message.properties),
        )


def messages(
    *,
    topic: str = "topic",
    queues: int | st.SearchStrategy[int] = 1,
    keys: st.SearchStrategy[tuple[str, ...]] | None = None,
    bodies: st.SearchStrategy[bytes] | None = None,
    tags: st.SearchStrategy[str | None] | None = None,
    min_size: int = 0,
    max_size: int = 30,
) -> st.SearchStrategy[list[MessageSpec]]:
    """Lists of :class:`MessageSpec` for ``topic``, each on a queue in
    ``range(queues)`` (``queues`` an int, or a strategy drawn once per list).

    ``keys`` (default: no keys), ``bodies`` (default: short byte strings) and ``tags``
    (default: none) are strategies for one message's fields; pass your own to draw
    traffic like yours, e.g. ``keys=st.sampled_from(["laptop", "phone"]).map(lambda k: (k,))``.
    """
    if isinstance(queues, int):
        if queues < 1:
            raise ValueError(f"queues must be >= 1, got {queues}")
        queue_counts: st.SearchStrategy[int] = st.just(queues)
    else:
        queue_counts = queues
    key_strategy = keys if keys is not None else st.just(())
    body_strategy = bodies if bodies is not None else st.binary(max_size=8)
    tag_strategy: st.SearchStrategy[str | None] = tags if tags is not None else st.none()

    @st.composite
    def draw_list(draw: st.DrawFn) -> list[MessageSpec]:
        count = draw(queue_counts)
        one = st.builds(
            MessageSpec,
            topic=st.just(topic),
            queue_id=st.integers(0, count - 1),
            body=body_strategy,
            keys=key_strategy,
            tags=tag_strategy,
        )
        return draw(st.lists(one, min_size=min_size, max_size=max_size))

    return draw_list()


def stage_definitions(*, max_stages: int = 5, max_size: int = 8) -> st.SearchStrategy[list[int]]:
    """Valid stage definitions, weighted towards the edge cases the contract names:
    ``[]`` (concurrent) and ``[1] * n`` (orderly for the first ``n`` messages)."""
    return st.one_of(
        st.just([]),
        st.integers(1, max_stages + 3).map(lambda n: [1] * n),
        st.lists(st.integers(1, max_size), min_size=1, max_size=max_stages),
    )


class FailureKind(enum.Enum):
    """How a scheduled failure fails the handler call."""

    RAISE = "raise"
    """The call raises :class:`InjectedFailure`."""
    RETURN = "return"
    """The call returns the failure status (``SUSPEND_CURRENT_QUEUE_A_MOMENT``, or
    ``RECONSUME_LATER`` for a concurrent listener)."""


@attrs.frozen
class FailureSchedule:
    """Which attempts of which messages fail, and how.

    Keys are ``(index, attempt)``: ``index`` is the message's position in the list
    given to ``run_virtual``, ``attempt`` 1 for its first delivery. A batch fails when
    any of its messages is scheduled to fail on this attempt; the listener is then not
    called (the call still takes its cost in time).
    """

    failures: Mapping[tuple[int, int], FailureKind] = attrs.field(factory=dict)
    """How each ``(index, attempt)`` fails."""

    @classmethod
    def of(cls, failures: Mapping[tuple[int, int], FailureKind]) -> FailureSchedule:
        """A schedule of ``failures`` (copied), e.g. ``{(0, 1): FailureKind.RAISE}``."""
        return cls(dict(failures))

    def kind(self, index: int, attempt: int) -> FailureKind | None:
        """How attempt ``attempt`` of message ``index`` fails (``None``: it does not)."""
        return self.failures.get((index, attempt))

    def __len__(self) -> int:
        return len(self.failures)


def failure_schedules(
    message_count: int | None = None,
    *,
    max_attempt: int = 3,
    max_failures: int = 6,
    kinds: Sequence[FailureKind] = (FailureKind.RAISE, FailureKind.RETURN),
) -> st.SearchStrategy[FailureSchedule]:
    """Failure schedules for messages ``0 .. message_count - 1`` (default: the first 64;
    entries past the end of your list never fire), failing attempts up to
    ``max_attempt``, at most ``max_failures`` of them, raising or returning the failure
    status. Shrinks towards no failures."""
    top = (message_count if message_count is not None else 64) - 1
    if top < 0:
        return st.just(FailureSchedule())
    entry = st.tuples(
        st.tuples(st.integers(0, top), st.integers(1, max_attempt)), st.sampled_from(list(kinds))
    )
    return st.lists(entry, max_size=max_failures, unique_by=lambda e: e[0]).map(
        lambda entries: FailureSchedule(dict(entries))
    )


def handler_costs(
    *, max_cost: float = 4.0, max_size: int = 8, integers: bool = True
) -> st.SearchStrategy[tuple[float, ...]]:
    """Handler costs in (virtual) seconds, cycled over the messages by index: a call
    takes the largest cost of its batch. ``integers``: whole seconds (0 included),
    which makes ties, and so races between calls, likely."""
    one: st.SearchStrategy[float]
    if integers:
        one = st.integers(0, int(max_cost)).map(float)
    else:
        one = st.floats(0.0, max_cost, allow_nan=False, allow_infinity=False)
    return st.lists(one, min_size=1, max_size=max_size).map(tuple)
