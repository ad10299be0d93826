"""Checkers: the ordering contract, checked against a :class:`CallLog`.

Each ``check_*`` returns a list of :class:`Violation` (empty when the log keeps the
guarantee), each with an explanation naming the calls involved; each ``assert_*``
raises :class:`OrderingViolation` (an ``AssertionError``) listing them, so under
hypothesis the shrunk counterexample comes with a readable story.

The staged check compares the log with :class:`StagePlan`, a deliberately naive model
of the contract (design section 2): it walks each stage key's messages one at a time
in queue order, so it shares no code with the consumer it checks.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from .._listeners import MessageListenerStagedConcurrently
from .._message import Message, MessageQueue
from ._log import CallLog, HandlerCall, origin_id

__all__ = (
    "Assignment",
    "OrderingViolation",
    "StagePlan",
    "Violation",
    "assert_at_least_once",
    "assert_key_order",
    "assert_orderly",
    "assert_staged",
    "check_at_least_once",
    "check_key_order",
    "check_orderly",
    "check_staged",
    "stage_of",
)

TAIL = -1
MAX_LISTED = 10
"""How many violations an ``assert_*`` lists (the count says how many there were)."""

StageKeyTuple = tuple[MessageQueue, str, str | None]


@attrs.frozen
class Violation:
    """One broken guarantee: ``rule`` names it, ``explanation`` tells the story."""

    rule: str
    """A short name of the broken guarantee (``"wrong-key"``, ...)."""
    explanation: str
    """What happened, naming the calls and messages involved."""
    calls: tuple[HandlerCall, ...] = ()
    """The handler calls involved (the offending one first)."""

    def __str__(self) -> str:
        return self.explanation


class OrderingViolation(AssertionError):
    """Raised by the ``assert_*`` checkers; ``violations`` holds what was found."""

    def __init__(self, what: str, violations: Sequence[Violation]) -> None:
        self.violations = tuple(violations)
        """What was found, in the order the checker found it."""
        lines = [f"{len(violations)} violation(s) of {what}:"]
        for violation in violations[:MAX_LISTED]:
            lines.append(f"- [{violation.rule}] {violation.explanation}")
            lines.extend(f"    {call.describe()}" for call in violation.calls)
        if len(violations) > MAX_LISTED:
            lines.append(f"... and {len(violations) - MAX_LISTED} more")
        super().__init__("\n".join(lines))


def _raise_if(what: str, violations: list[Violation]) -> None:
    if violations:
        raise OrderingViolation(what, violations)


def _where(message: Message) -> str:
    return f"{message.topic}:{message.queue_id}@{message.queue_offset}"


# -- the stage model ------------------------------------------------------------------------


@attrs.frozen
class Assignment:
    """Where the contract puts one message."""

    key: StageKeyTuple | None
    """(queue, strategy, group); ``None``: consumed directly, with no stage."""
    stage: int
    """Stage index (``-1``: the tail, or no stage)."""
    epoch: int
    """Increases with every new stage of a key (a reset to an earlier stage too): a
    message may start only after every message of an earlier epoch of its key finished."""


@attrs.frozen
class StagePlan:
    """The stage of every sent message, as design section 2 defines it.

    Build it with :meth:`of` from your listener and the messages as sent (``sent``
    of ``run_virtual``'s result, or what :meth:`MemoryBroker.send` returned). It calls
    the listener's ``compute_strategy``, ``compute_group`` and
    ``reset_current_stage_offset_if_need`` the way the contract says the consumer
    does, so those must be pure functions of their arguments (as the contract needs
    anyway: a message must get the same stage after a crash).
    """

    assignments: Mapping[str, Assignment]
    """By message id (:func:`origin_id`)."""
    messages: Mapping[str, Message]
    """The sent messages by message id."""
    definitions: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict, kw_only=True)
    """The stage definitions by strategy id the plan was made from."""

    @classmethod
    def of(cls, listener: MessageListenerStagedConcurrently, sent: Iterable[Message]) -> StagePlan:
        """The plan of ``listener`` (or the listener a :class:`RecordingListener` wraps)
        for the messages ``sent``, in the order they were sent."""
        inner = getattr(listener, "inner", listener)  # a RecordingListener: its listener
        definitions = {
            str(name): list(sizes)
            for name, sizes in inner.get_stage_definition_strategies().items()
        }
        base = MessageListenerStagedConcurrently
        reset: Callable[[str, int], int] | None = None
        if (
            type(inner).reset_current_stage_offset_if_need
            is not base.reset_current_stage_offset_if_need
        ):
            reset = inner.reset_current_stage_offset_if_need
        return cls.from_definitions(
            definitions, sent, inner.compute_strategy, inner.compute_group, reset
        )

    @classmethod
    def from_definitions(
        cls,
        definitions: Mapping[str, Sequence[int]],
        sent: Iterable[Message],
        compute_strategy: Callable[[Message], str | None] = lambda m: "default",
        compute_group: Callable[[Message], str | None] = lambda m: None,
        reset: Callable[[str, int], int] | None = None,
    ) -> StagePlan:
        """The plan from stage definitions by strategy and the stage callbacks.

        Raises ``ValueError`` when ``compute_strategy`` gives a message a strategy id
        that ``definitions`` lacks (``None`` means no stage): the consumer stops that
        message's queue there, so no plan of the run exists."""
        counters: dict[StageKeyTuple, int] = defaultdict(int)
        last: dict[StageKeyTuple, tuple[int, int]] = {}
        epochs = itertools.count(1)
        out: dict[str, Assignment] = {}
        messages: dict[str, Message] = {}
        ordered = sorted(sent, key=lambda m: (m.topic, m.queue_id, m.queue_offset))
        for message in ordered:
            ident = origin_id(message)
            messages[ident] = message
            strategy = compute_strategy(message)
            if strategy is None:
                out[ident] = Assignment(None, TAIL, 0)
                continue
            if strategy not in definitions:
                known = ", ".join(repr(name) for name in sorted(definitions)) or "none"
                raise ValueError(
                    f"compute_strategy gives {strategy!r} for {_where(message)}, which is"
                    f" not a strategy of the definitions ({known}) nor None: the consumer"
                    " stops its queue at such a message (statistics().assignment_errors)"
                )
            sizes = definitions[strategy]
            key = (MessageQueue(message.topic, message.queue_id), strategy, compute_group(message))
            offset = counters[key]
            changed = False
            total = sum(sizes)
            starts = {0, *itertools.accumulate(sizes)}
            if reset is not None and (offset >= total or offset in starts):
                wanted = max(0, reset(message.topic, offset))
                if wanted != offset:
                    offset, changed = wanted, True
            stage = stage_of(sizes, offset)
            previous = last.get(key)
            if previous is None or changed or previous[0] != stage:
                previous = last[key] = (stage, next(epochs))
            counters[key] = offset + 1
            out[ident] = Assignment(key, stage, previous[1])
        return cls(
            out, messages, definitions={name: tuple(sizes) for name, sizes in definitions.items()}
        )

    def stage_of(self, message: Message) -> int:
        """The stage index ``message`` belongs in (``-1``: the tail stage)."""
        return self.assignments[origin_id(message)].stage


def stage_of(sizes: Sequence[int], offset: int) -> int:
    """The stage index of the message at stage offset ``offset`` of a stage key whose
    stage definition is ``sizes`` (design section 2): ``i`` while ``offset`` is below
    ``sizes[0] + ... + sizes[i]``, ``-1`` (the tail) from their sum on.

    The slow, obvious model the checkers use (it walks the stages one by one), and a
    reference for your own stage arithmetic: ``stage_of([2, 3], 4) == 1``,
    ``stage_of([2, 3], 5) == -1``. The first offset of a stage is where
    ``stage_of(sizes, offset - 1) != stage_of(sizes, offset)`` (or ``offset == 0``).
    """
    bound = 0
    for index, size in enumerate(sizes):
        bound += size
        if offset < bound:
            return index
    return TAIL


def _key_text(key: StageKeyTuple) -> str:
    mq, strategy, group = key
    return f"queue {mq.topic}:{mq.queue_id}, strategy {strategy!r}, group {group!r}"


def _definitions_hint(
    log: CallLog, plan: StagePlan, call: HandlerCall, assigned: Assignment
) -> str:
    """Why a message may have run in another stage than the plan's: the stage
    definitions the consumer read (recorded by a :class:`RecordingListener`) when they
    differ from the plan's, else the rule they break if they changed unseen."""
    if assigned.key is not None and plan.definitions:
        strategy = assigned.key[1]
        planned = plan.definitions.get(strategy)
        read = [(run, d) for run, d in log.stage_definitions if run == call.run]
        for run, definitions in read or log.stage_definitions:
            sizes = definitions.get(strategy)
            if sizes is not None and sizes != planned:
                return (
                    f": the stage definitions changed between calls (strategy {strategy!r}:"
                    f" {list(sizes)} when the consumer of run {run} read them,"
                    f" {list(planned or ())} when the plan did); they must be constant"
                )
    return (
        " (stage definitions must be constant: the consumer reads them when it is"
        " built, StagePlan.of reads them again)"
    )


def _finish_seqs_by_run(log: CallLog) -> dict[int, dict[str, int]]:
    """:meth:`CallLog.finish_seqs`, counting only each run's own calls and dead letters."""
    out: dict[int, dict[str, int]] = defaultdict(dict)
    for call in log.calls:
        for message in call.finished_messages:
            seen = out[call.run]
            ident = origin_id(message)
            seen[ident] = min(seen.get(ident, call.end_seq), call.end_seq)
    for dead in log.dead_letters:
        seen = out[dead.run]
        ident = origin_id(dead.message)
        seen[ident] = min(seen.get(ident, dead.seq), dead.seq)
    return out


def check_staged(log: CallLog, plan: StagePlan, *, within_runs: bool = False) -> list[Violation]:
    """Staged order: every message runs in the stage the contract gives it, a batch
    never mixes stage keys or stages, and no call of a later stage (or the tail) of a
    stage key starts before every message of the earlier stages of that key finished
    (succeeded or went to the DLQ).

    ``within_runs``: also, within each run (:attr:`HandlerCall.run`, one incarnation of
    the consumer), no call of a later stage of a key starts before every message of an
    earlier stage of that key which the same run consumed as well finished in that
    run. A consumer restarted after a crash delivers again what was not committed and
    must keep the barrier among those messages too, not only count on their first
    finish before the crash (holds when the runs do not overlap, as under
    :func:`run_virtual` or with one process at a time)."""
    violations: list[Violation] = []
    done = log.finish_seqs()
    run_done = _finish_seqs_by_run(log) if within_runs else {}
    run_started: dict[int, set[str]] = defaultdict(set)
    if within_runs:
        for call in log.calls:
            run_started[call.run].update(origin_id(m) for m in call.messages)
    by_key: dict[StageKeyTuple, list[tuple[int, str]]] = defaultdict(list)
    for ident, assigned in plan.assignments.items():
        if assigned.key is not None:
            by_key[assigned.key].append((assigned.epoch, ident))
    for members in by_key.values():
        members.sort()
    finishing = {call.end_seq: call for call in log.calls if call.finished_messages}
    for call in log.calls:
        if not call.messages:
            continue
        known = [m for m in call.messages if origin_id(m) in plan.assignments]
        violations.extend(
            Violation(
                "unknown-message",
                f"call #{call.number} consumed {_where(message)}, which the plan"
                " does not know (was it sent?)",
                (call,),
            )
            for message in call.messages
            if origin_id(message) not in plan.assignments
        )
        if not known:
            continue
        first = plan.assignments[origin_id(known[0])]
        for message in known:
            assigned = plan.assignments[origin_id(message)]
            if call.stage_index is not None and assigned.stage != call.stage_index:
                violations.append(
                    Violation(
                        "wrong-stage",
                        f"{_where(message)} ran in stage {call.stage_index} (call #{call.number}),"
                        f" but the stage definitions put it in stage {assigned.stage}"
                        + _definitions_hint(log, plan, call, assigned),
                        (call,),
                    )
                )
            if assigned.key != first.key or assigned.epoch != first.epoch:
                violations.append(
                    Violation(
                        "mixed-batch",
                        f"call #{call.number} mixes {_where(known[0])} and {_where(message)},"
                        " which belong to different stage keys or stages",
                        (call,),
                    )
                )
        if first.key is None:
            if call.stage_index is not None and call.strategy_id is not None:
                violations.append(
                    Violation(
                        "wrong-key",
                        f"call #{call.number} ran {_where(known[0])} as strategy"
                        f" {call.strategy_id!r}, but compute_strategy gives None for it:"
                        " it should run directly, with strategy None",
                        (call,),
                    )
                )
            continue
        if call.stage_index is not None and (call.strategy_id, call.group_id) != first.key[1:]:
            violations.append(
                Violation(
                    "wrong-key",
                    f"call #{call.number} ran {_where(known[0])} as strategy"
                    f" {call.strategy_id!r}, group {call.group_id!r}, but compute_strategy and"
                    f" compute_group now give strategy {first.key[1]!r}, group"
                    f" {first.key[2]!r}: a stage key must depend on the message alone (a"
                    " message delivered again must get the same stage)",
                    (call,),
                )
            )
        for epoch, ident in by_key[first.key]:
            if epoch >= first.epoch:
                break
            finished = done.get(ident)
            if finished is not None and finished < call.start_seq:
                continue
            earlier = plan.messages[ident]
            earlier_stage = plan.assignments[ident].stage
            stage_text = "the tail stage" if first.stage == TAIL else f"stage {first.stage}"
            if finished is None:
                how = "it never finished"
                involved: tuple[HandlerCall, ...] = (call,)
            else:
                ender = finishing.get(finished)
                how = f"it finished only at event {finished}" + (
                    f" (call #{ender.number}, t={ender.end:g})" if ender is not None else " (DLQ)"
                )
                involved = (call, ender) if ender is not None else (call,)
            violations.append(
                Violation(
                    "barrier",
                    f"{stage_text} of {_key_text(first.key)} started with"
                    f" {[m.queue_offset for m in known]} (call #{call.number}, t={call.start:g},"
                    f" event {call.start_seq}) before {_where(earlier)} of stage"
                    f" {earlier_stage} finished: {how}",
                    involved,
                )
            )
            break  # one barrier violation per call is enough to tell the story
        if within_runs:
            violations.extend(_run_barrier(call, first, known, by_key, run_started, run_done, plan))
    return violations


def _run_barrier(
    call: HandlerCall,
    first: Assignment,
    known: Sequence[Message],
    by_key: Mapping[StageKeyTuple, Sequence[tuple[int, str]]],
    run_started: Mapping[int, set[str]],
    run_done: Mapping[int, Mapping[str, int]],
    plan: StagePlan,
) -> list[Violation]:
    """The barrier within ``call``'s run (see :func:`check_staged`'s ``within_runs``)."""
    assert first.key is not None
    started = run_started.get(call.run, set())
    finished_here = run_done.get(call.run, {})
    for epoch, ident in by_key[first.key]:
        if epoch >= first.epoch:
            break
        if ident not in started:
            continue
        finished = finished_here.get(ident)
        if finished is not None and finished < call.start_seq:
            continue
        earlier = plan.messages[ident]
        how = "not in that run" if finished is None else f"only at event {finished}"
        stage_text = "the tail stage" if first.stage == TAIL else f"stage {first.stage}"
        return [
            Violation(
                "run-barrier",
                f"run {call.run}: {stage_text} of {_key_text(first.key)} started with"
                f" {[m.queue_offset for m in known]} (call #{call.number}, event"
                f" {call.start_seq}) before {_where(earlier)} of stage"
                f" {plan.assignments[ident].stage}, which that run consumed again, finished"
                f" in it: {how}",
                (call,),
            )
        ]
    return []


def assert_staged(log: CallLog, plan: StagePlan, *, within_runs: bool = False) -> None:
    """:func:`check_staged`, raising :class:`OrderingViolation`."""
    _raise_if("staged order", check_staged(log, plan, within_runs=within_runs))


def _calls_by_queue(log: CallLog) -> dict[MessageQueue, list[HandlerCall]]:
    out: dict[MessageQueue, list[HandlerCall]] = defaultdict(list)
    for call in log.calls:
        if call.messages:
            out[call.queue].append(call)
    for calls in out.values():
        calls.sort(key=lambda c: c.start_seq)
    return out


def _sequence_violations(
    calls: Sequence[HandlerCall], offsets_of: Callable[[HandlerCall], list[int]], what: str
) -> list[Violation]:
    """Calls that must run one at a time, in offset order: no overlap, ascending offsets
    in a call, and within one run a call goes back only to retry a failed call."""
    violations: list[Violation] = []
    for call in calls:
        offsets = offsets_of(call)
        if offsets != sorted(offsets):
            violations.append(
                Violation(
                    "batch-order",
                    f"{what}: call #{call.number} got offsets {offsets}, out of order",
                    (call,),
                )
            )
    for previous, call in itertools.pairwise(calls):
        before, now = offsets_of(previous), offsets_of(call)
        if not previous.ended or previous.end_seq > call.start_seq:
            violations.append(
                Violation(
                    "overlap",
                    f"{what}: call #{call.number} on {now} started (t={call.start:g}) while"
                    f" call #{previous.number} on {before} was still running",
                    (call, previous),
                )
            )
        if call.run == previous.run and now[0] <= before[-1]:
            if previous.succeeded:
                violations.append(
                    Violation(
                        "offset-order",
                        f"{what}: call #{call.number} on {now} ran after call #{previous.number}"
                        f" on {before} had succeeded (offsets went back)",
                        (call, previous),
                    )
                )
            elif not set(now) <= set(before):
                violations.append(
                    Violation(
                        "retry-batch",
                        f"{what}: call #{call.number} on {now} retried failed call"
                        f" #{previous.number} on {before} with other messages",
                        (call, previous),
                    )
                )
    return violations


def check_orderly(
    log: CallLog, *, queues: Iterable[MessageQueue] | None = None, upto: int | None = None
) -> list[Violation]:
    """Orderly consumption: the calls of each queue never overlap and run in offset
    order (a failed batch is retried, alone, before anything after it). ``upto``: only
    calls whose first offset is below it (``[1] * n`` stages are orderly for the first
    ``n`` messages). After a crash a queue may go back to its committed offset."""
    wanted = set(queues) if queues is not None else None
    violations: list[Violation] = []
    for mq, calls in sorted(_calls_by_queue(log).items(), key=lambda item: item[0].queue_id):
        if wanted is not None and mq not in wanted:
            continue
        if upto is not None:
            calls = [c for c in calls if c.offsets[0] < upto]
        violations.extend(
            _sequence_violations(
                calls, lambda c: list(c.offsets), f"queue {mq.topic}:{mq.queue_id}"
            )
        )
    return violations


def assert_orderly(
    log: CallLog, *, queues: Iterable[MessageQueue] | None = None, upto: int | None = None
) -> None:
    """:func:`check_orderly`, raising :class:`OrderingViolation`."""
    _raise_if("orderly consumption", check_orderly(log, queues=queues, upto=upto))


def _first_key(message: Message) -> str | None:
    return message.keys[0] if message.keys else None


def check_key_order(
    log: CallLog, *, key: Callable[[Message], str | None] = _first_key
) -> list[Violation]:
    """Key order (``Ordering.BY_KEY``): the messages of one key of a queue run one call
    at a time, in offset order; ``key`` gives a message's key (default: its first
    key; ``None`` is unordered)."""
    violations: list[Violation] = []
    for mq, calls in sorted(_calls_by_queue(log).items(), key=lambda item: item[0].queue_id):
        by_key: dict[str, list[HandlerCall]] = defaultdict(list)
        for call in calls:
            for k in {key(m) for m in call.messages} - {None}:
                assert k is not None
                by_key[k].append(call)
        for k, keyed in sorted(by_key.items()):

            def offsets(call: HandlerCall, k: str = k) -> list[int]:
                return [m.queue_offset for m in call.messages if key(m) == k]

            violations.extend(
                _sequence_violations(keyed, offsets, f"key {k!r} of queue {mq.topic}:{mq.queue_id}")
            )
    return violations


def assert_key_order(log: CallLog, *, key: Callable[[Message], str | None] = _first_key) -> None:
    """:func:`check_key_order`, raising :class:`OrderingViolation`."""
    _raise_if("key order", check_key_order(log, key=key))


def check_at_least_once(
    log: CallLog, sent: Iterable[Message], *, exactly_once: bool = False
) -> list[Violation]:
    """Every sent message finished (succeeded, or went to the DLQ), and nothing else
    was consumed. ``exactly_once``: also each finished once, its attempts numbered
    1, 2, 3, ... never overlapping and none after it finished (holds without crashes)."""
    violations: list[Violation] = []
    sent_by_id = {origin_id(m): m for m in sent}
    done = log.finish_seqs()
    attempts: dict[str, list[HandlerCall]] = defaultdict(list)
    for call in log.calls:
        for message in call.messages:
            attempts[origin_id(message)].append(call)
    for ident, message in sent_by_id.items():
        if ident not in done:
            tries = attempts.get(ident, [])
            how = (
                "it was never delivered"
                if not tries
                else f"its {len(tries)} call(s) all failed or were cancelled"
            )
            violations.append(
                Violation("lost", f"{_where(message)} never finished: {how}", tuple(tries))
            )
    for ident, calls in attempts.items():
        if ident not in sent_by_id:
            violations.append(
                Violation(
                    "unknown-message",
                    f"call #{calls[0].number} consumed message {ident}, which was not sent",
                    (calls[0],),
                )
            )
    if not exactly_once:
        return violations
    dead: dict[str, int] = defaultdict(int)
    for letter in log.dead_letters:
        dead[origin_id(letter.message)] += 1
    for ident, calls in attempts.items():
        if ident not in sent_by_id:
            continue
        where = _where(sent_by_id[ident])
        calls.sort(key=lambda c: c.start_seq)
        numbers = [c.attempt for c in calls]
        if numbers != list(range(1, len(calls) + 1)):
            violations.append(
                Violation(
                    "attempts",
                    f"{where}: attempts numbered {numbers}, not 1, 2, 3, ...",
                    tuple(calls),
                )
            )
        finishes = (
            sum(1 for c in calls if any(origin_id(m) == ident for m in c.finished_messages))
            + dead[ident]
        )
        if finishes > 1:
            violations.append(
                Violation(
                    "duplicate",
                    f"{where} finished {finishes} times ({dead[ident]} by the DLQ)",
                    tuple(calls),
                )
            )
        finished = done.get(ident)
        late = [c for c in calls if finished is not None and c.start_seq > finished]
        if late:
            violations.append(
                Violation(
                    "after-finish",
                    f"{where} was consumed again (call #{late[0].number}) after it finished",
                    tuple(late),
                )
            )
        for earlier, later in itertools.pairwise(calls):
            if not earlier.ended or earlier.end_seq > later.start_seq:
                violations.append(
                    Violation(
                        "overlap",
                        f"{where}: call #{later.number} started while call #{earlier.number}"
                        " on the same message was running",
                        (later, earlier),
                    )
                )
    return violations


def assert_at_least_once(
    log: CallLog, sent: Iterable[Message], *, exactly_once: bool = False
) -> None:
    """:func:`check_at_least_once`, raising :class:`OrderingViolation`."""
    what = "exactly-once delivery" if exactly_once else "at-least-once delivery"
    _raise_if(what, check_at_least_once(log, sent, exactly_once=exactly_once))
