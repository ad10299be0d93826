"""Properties of pop consumption on the embedded broker, over random schedules of
sends, receives, acks, invisible-time changes, time passing and consumer crashes,
in virtual time (the broker's clock is set by the schedule).

Checked against a model of every message's deliveries:

- an acked (or dead-lettered) message is never received again;
- a message is received again only after its invisible time passed, with its
  delivery attempt one higher;
- an ack or change is refused exactly when the model says this delivery no longer
  holds the message (received again, acked, or its invisible time passed);
- a message goes to the dead-letter queue only after ``max_delivery_attempts``
  deliveries, the last one's invisible time passed;
- FIFO: a message is received only when every earlier message of its message
  group was acked or dead-lettered;
- nothing is lost: when time goes on and one consumer acks whatever it receives,
  every message ends acked or dead-lettered.
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagedconsumer import (
    InvalidReceiptHandleError,
    MemoryBroker,
    ReceivedMessage,
    SimpleConsumer,
    SimpleConsumerOptions,
)

pytestmark = pytest.mark.anyio

CONSUMERS = 3
KEYS = ("A", "B", "C", None)


@attrs.define
class Model:
    sent: list[str] = attrs.Factory(list)
    group_of: dict[str, str | None] = attrs.Factory(dict)
    attempts: dict[str, int] = attrs.Factory(dict)
    deadline: dict[str, float] = attrs.Factory(dict)
    done: dict[str, str] = attrs.Factory(dict)
    """msg id -> "acked" or "dlq"."""

    def holds(self, m: ReceivedMessage, now: float) -> bool:
        return (
            m.msg_id not in self.done
            and self.attempts.get(m.msg_id) == m.delivery_attempt
            and now < self.deadline[m.msg_id]
        )


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


operations = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.sampled_from(KEYS)),
        st.tuples(
            st.just("receive"),
            st.integers(0, CONSUMERS - 1),
            st.integers(1, 4),
            st.sampled_from([1.0, 5.0, 10.0]),
        ),
        st.tuples(st.just("ack"), st.integers(0, CONSUMERS - 1), st.integers(0, 20)),
        st.tuples(
            st.just("change"),
            st.integers(0, CONSUMERS - 1),
            st.integers(0, 20),
            st.sampled_from([0.0, 3.0, 20.0]),
        ),
        st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, 6.0, 11.0])),
        st.tuples(st.just("crash"), st.integers(0, CONSUMERS - 1)),
    ),
    max_size=60,
)


@pytest.mark.slow
@given(
    ops=operations,
    fifo=st.booleans(),
    max_attempts=st.integers(1, 4),
    queues=st.integers(1, 3),
)
async def test_pop_consumption_properties(
    ops: list[tuple[Any, ...]], fifo: bool, max_attempts: int, queues: int
) -> None:
    clock = Clock()
    broker = MemoryBroker(clock=clock)
    broker.create_topic("t", queues)
    options = SimpleConsumerOptions(fifo=fifo, max_delivery_attempts=max_attempts)
    consumers = [
        SimpleConsumer("g", broker, subscriptions={"t": "*"}, await_duration=0, options=options)
        for _ in range(CONSUMERS)
    ]
    held: list[list[ReceivedMessage]] = [[] for _ in range(CONSUMERS)]
    model = Model()
    dead_seen = 0

    def check_dead_letters() -> None:
        nonlocal dead_seen
        dead = broker.messages("%DLQ%g")
        for m in dead[dead_seen:]:
            assert m.msg_id not in model.done, "dead-lettered twice, or after its ack"
            assert model.attempts[m.msg_id] == max_attempts
            assert clock.now >= model.deadline[m.msg_id]
            model.done[m.msg_id] = "dlq"
        dead_seen = len(dead)

    def check_received(got: list[ReceivedMessage], inv: float) -> None:
        for m in got:
            mid = m.msg_id
            assert mid not in model.done, f"{mid} received after it was {model.done.get(mid)}"
            previous = model.attempts.get(mid, 0)
            assert m.delivery_attempt == previous + 1
            if previous:
                assert clock.now >= model.deadline[mid], "received again while invisible"
            if fifo and model.group_of[mid] is not None:
                group = model.group_of[mid]
                earlier = model.sent[: model.sent.index(mid)]
                pending = [e for e in earlier if model.group_of[e] == group and e not in model.done]
                assert not pending, f"{mid} of group {group} received before {pending}"
                assert m.message_group == group
            model.attempts[mid] = m.delivery_attempt
            model.deadline[mid] = clock.now + inv

    async with contextlib.AsyncExitStack() as stack:
        for c in consumers:
            await stack.enter_async_context(c)
        for op in ops:
            kind = op[0]
            if kind == "send":
                key = op[1]
                m = broker.send("t", b"", keys=[key] if key else [])
                model.sent.append(m.msg_id)
                model.group_of[m.msg_id] = key
            elif kind == "receive":
                _, who, n, inv = op
                got = await consumers[who].receive(n, inv)
                assert len(got) <= n
                check_dead_letters()
                check_received(got, inv)
                held[who].extend(got)
            elif kind in ("ack", "change"):
                who, pick = op[1], op[2]
                if not held[who]:
                    continue
                m = held[who].pop(pick % len(held[who]))
                expected = model.holds(m, clock.now)
                try:
                    if kind == "ack":
                        await consumers[who].ack(m)
                    else:
                        await consumers[who].change_invisible_duration(m, op[3])
                except InvalidReceiptHandleError:
                    assert not expected, f"{kind} of {m.msg_id} refused while held"
                else:
                    assert expected, f"{kind} of {m.msg_id} accepted while not held"
                    if kind == "ack":
                        model.done[m.msg_id] = "acked"
                    else:
                        model.deadline[m.msg_id] = clock.now + op[3]
                        held[who].append(m)
            elif kind == "advance":
                clock.now += op[1]
            else:  # crash: what the consumer held is never acked
                held[op[1]].clear()

        # time goes on and one consumer acks everything: nothing is lost
        for _ in range(len(model.sent) + max_attempts + 2):
            if len(model.done) == len(model.sent):
                break
            clock.now += 100
            got = await consumers[0].receive(1024, 10)
            check_dead_letters()
            check_received(got, 10)
            for m in got:
                await consumers[0].ack(m)
                model.done[m.msg_id] = "acked"
        assert sorted(model.done) == sorted(model.sent)
        assert len(broker.messages("%DLQ%g")) == sum(v == "dlq" for v in model.done.values())
