"""Consumer groups on the embedded broker, and gray release (RIP-72).

- pure: the gray split, AllocateMessageQueueByGray (hypothesis over queue counts,
  ratios and member sets), SelectMessageQueueByGray, the options;
- MemoryBroker groups: two PushConsumers of one group share the queues, rebalance
  when one leaves, nothing lost, staged barrier intact across the hand-over;
- gray release end to end on the embedded broker: who consumes what, retries of gray
  messages only on gray members, the DLQ record keeps gray-ness, cut-over.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import anyio
import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from offsetstore import MemoryOffsetStore
from stagedconsumer import (
    AllocateMessageQueueAveragely,
    AllocateMessageQueueByGray,
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    GroupOptions,
    InvalidOptionError,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerStagedConcurrently,
    MessageQueue,
    OutgoingMessage,
    PushConsumer,
    SelectMessageQueueByGray,
)
from stagedconsumer._sources._gray import gray_member_id, gray_ratio_of, split_gray
from stagedconsumer.testing import CallLog, RecordingListener, StagePlan, assert_staged

# -- the split, allocation and selection (pure) ---------------------------------------


def test_split_takes_the_last_ceil_n_ratio_queues_of_each_topic() -> None:
    queues = [MessageQueue("a", i) for i in range(8)] + [MessageQueue("b", i) for i in range(16)]
    split = split_gray(queues, 0.1)
    assert split.gray == (MessageQueue("a", 7), MessageQueue("b", 14), MessageQueue("b", 15))
    assert len(split.normal) == 7 + 14
    assert split_gray([MessageQueue("a", i) for i in range(10)], 0.3).gray == tuple(
        MessageQueue("a", i)
        for i in (7, 8, 9)  # 10 * 0.3 is 3.0000000000000004
    )
    retry = [MessageQueue("%RETRY%g", 0), MessageQueue("%RETRY%g", 1)]
    assert split_gray(retry, 0.9).gray == (retry[1],)  # whatever the ratio
    assert split_gray(retry[:1], 0.9).gray == ()


def test_member_ids_carry_the_gray_flag_and_ratio() -> None:
    member = gray_member_id("host@1@ab", 0.25)
    assert member == "host@1@ab@gray[0.25]"
    assert gray_ratio_of(member) == 0.25
    assert gray_ratio_of("host@1@ab") is None
    assert gray_ratio_of("x@gray[bogus]") == 0.1  # RIP-72's default when unparsable
    with pytest.raises(ConfigurationError):
        gray_member_id("x", 0)


def test_options_validate_gray_settings() -> None:
    options = ConsumerOptions(enable_gray_switch=True, gray_tag=True, gray_queue_ratio=0.5)
    assert (options.enable_gray_switch, options.gray_tag, options.gray_queue_ratio) == (
        True,
        True,
        0.5,
    )
    assert ConsumerOptions().gray_queue_ratio == 0.1
    for bad in (0, -0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(InvalidOptionError):
            ConsumerOptions(gray_queue_ratio=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="enable_gray_switch"):
        ConsumerOptions(gray_tag=True)
    with pytest.raises(InvalidOptionError):
        ConsumerOptions(enable_gray_switch=1)  # type: ignore[arg-type]


def _owners(
    strategy: AllocateMessageQueueByGray, queues: list[MessageQueue], members: list[str]
) -> dict[MessageQueue, list[str]]:
    owners: dict[MessageQueue, list[str]] = defaultdict(list)
    for member in members:
        for mq in strategy.allocate("g", member, queues, members):
            owners[mq].append(member)
    return owners


@given(
    counts=st.lists(st.integers(1, 24), min_size=1, max_size=3),
    retry=st.integers(0, 2),
    ratios=st.lists(st.sampled_from([0.05, 0.1, 0.25, 0.5, 0.75, 1.0]), max_size=4),
    normals=st.integers(0, 5),
)
def test_gray_allocation_owns_every_queue_once_and_gray_queues_only_by_gray_members(
    counts: list[int], retry: int, ratios: list[float], normals: int
) -> None:
    queues = [MessageQueue(f"t{t}", i) for t, n in enumerate(counts) for i in range(n)]
    queues += [MessageQueue("%RETRY%g", i) for i in range(retry)]
    queues.sort()
    members = sorted(
        [gray_member_id(f"gray{i}", r) for i, r in enumerate(ratios)]
        + [f"normal{i}" for i in range(normals)]
    )
    if not members:
        return
    strategy = AllocateMessageQueueByGray()
    owners = _owners(strategy, queues, members)
    assert sorted(owners) == queues
    assert all(len(who) == 1 for who in owners.values()), "a queue owned twice"
    if ratios and normals:
        gray = set(split_gray(queues, max(ratios)).gray)
        for mq, (who,) in owners.items():
            assert (gray_ratio_of(who) is not None) == (mq in gray), (mq, who)
        for topic, n in enumerate(counts):  # the rule itself: last ceil(n * ratio)
            wanted = min(n, math.ceil(n * max(ratios) - 1e-9))
            assert [mq.queue_id for mq in sorted(gray) if mq.topic == f"t{topic}"] == list(
                range(n - wanted, n)
            )


def test_no_gray_member_means_everyone_shares_every_queue() -> None:
    queues = [MessageQueue("t", i) for i in range(8)]
    owners = _owners(AllocateMessageQueueByGray(), queues, ["a", "b"])
    assert {who for (who,) in owners.values()} == {"a", "b"}
    assert owners[MessageQueue("t", 7)] == ["b"]  # the gray queue is not stranded
    only_gray = [gray_member_id("a", 0.1)]
    assert _owners(AllocateMessageQueueByGray(), queues, only_gray).keys() == set(queues)


def test_disagreeing_ratios_take_the_largest_and_are_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queues = [MessageQueue("t", i) for i in range(8)]
    members = sorted([gray_member_id("g1", 0.1), gray_member_id("g2", 0.25), "n"])
    strategy = AllocateMessageQueueByGray()
    owners = _owners(strategy, queues, members)
    gray = sorted(mq.queue_id for mq, (who,) in owners.items() if who != "n")
    assert gray == [6, 7]  # ceil(8 * 0.25)
    assert strategy.statistics().ratio_disagreements == 3  # one per member's view
    assert strategy.statistics().last_ratios == (0.1, 0.25)
    assert sum("disagree" in r.message for r in caplog.records) == 1  # logged once


def test_selector_sends_gray_traffic_to_gray_queues_by_key_hash() -> None:
    queues = [MessageQueue("t", i) for i in range(8)]
    selector = SelectMessageQueueByGray(0.25, gray_property="lane", gray_value="canary")
    gray_q = {MessageQueue("t", 6), MessageQueue("t", 7)}

    def pick(keys: Sequence[str] = (), arg: object = None, lane: str | None = None) -> MessageQueue:
        props = {"lane": lane} if lane is not None else {}
        return selector.select(queues, OutgoingMessage.of(b"x", keys=keys, properties=props), arg)

    assert {pick(arg=True) for _ in range(10)} == gray_q  # round-robin within gray
    assert {pick(lane="canary") for _ in range(10)} == gray_q
    assert {pick(lane="blue") for _ in range(30)} == set(queues) - gray_q
    for key in ("order-1", "order-2", "order-3", "order-4"):
        assert len({pick([key], arg=True) for _ in range(5)}) == 1  # per-key order holds
        assert pick([key], arg=True) in gray_q
        assert pick([key]) not in gray_q
    with pytest.raises(ConfigurationError):
        SelectMessageQueueByGray(0)
    one = [MessageQueue("t", 0)]
    assert selector.select(one, OutgoingMessage.of(b"x"), None) == one[0]  # nothing stranded


# -- groups on the embedded broker ----------------------------------------------------

Log = list[tuple[str, str, int, int, int]]
"""(event, consumer, queue id, offset, stage index) in the order they happened."""


class StagedLog(MessageListenerStagedConcurrently):
    def __init__(self, name: str, log: Log, stages: Sequence[int]) -> None:
        self.name = name
        self.log = log
        self.stages = stages

    def get_stage_definitions(self) -> Sequence[int]:
        return self.stages

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        for m in msgs:
            self.log.append(("start", self.name, m.queue_id, m.queue_offset, context.stage_index))
        await anyio.sleep(0.001)
        for m in msgs:
            self.log.append(("end", self.name, m.queue_id, m.queue_offset, context.stage_index))


async def _until(predicate: object, timeout: float = 10.0) -> None:
    assert callable(predicate)
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_two_consumers_of_a_group_share_the_queues_and_hand_over_on_leave() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 8)
    store = MemoryOffsetStore()
    stages = [2, 3, 4]
    log: Log = []
    calls = CallLog()  # both members' handler calls, for the kit's staged check
    sent: set[tuple[int, int]] = set()
    sent_messages: list[Message] = []

    def send(n: int, start: int) -> None:
        for i in range(start, start + n):
            m = broker.send("t", f"m{i}".encode(), keys=[f"k{i % 16}"])
            sent.add((m.queue_id, m.queue_offset))
            sent_messages.append(m)

    def handled_by() -> dict[tuple[int, int], list[str]]:
        who: dict[tuple[int, int], list[str]] = defaultdict(list)
        for event, name, queue, offset, _ in log:
            if event == "end":
                who[queue, offset].append(name)
        return who

    a = PushConsumer(
        "g", broker, RecordingListener(StagedLog("a", log, stages), calls), offset_store=store
    )
    b = PushConsumer(
        "g", broker, RecordingListener(StagedLog("b", log, stages), calls), offset_store=store
    )
    a.subscribe("t")
    b.subscribe("t")
    send(80, 0)
    async with a:
        async with b:
            await _until(
                lambda: len(a.assigned_queues) == len(b.assigned_queues) == 4
            )  # shared, not each consuming everything
            assert set(a.assigned_queues).isdisjoint(b.assigned_queues)
            send(80, 80)
            await _until(lambda: handled_by().keys() == sent)
            during = handled_by()
            assert {who[-1] for who in during.values()} == {"a", "b"}
            b_queues = set(b.assigned_queues)
        # b left: a takes its queues over where b committed
        await _until(lambda: len(a.assigned_queues) == 8)
        send(80, 160)
        await _until(lambda: handled_by().keys() == sent)
    who = handled_by()
    assert all(len(names) == 1 for names in who.values()), "handled twice on a graceful hand-over"
    assert {who[q, o][0] for q, o in sent if o >= 20 and MessageQueue("t", q) in b_queues} >= {"a"}
    # Every message in its stage, and no stage of a queue started before the earlier
    # ones finished, on whichever member.
    assert_staged(calls, StagePlan.from_definitions({"default": stages}, sent_messages))


class ConcurrentLog(MessageListenerConcurrently):
    def __init__(self, name: str, log: list[tuple[str, Message]], fail_keys: bool) -> None:
        self.name = name
        self.log = log
        self.fail_keys = fail_keys

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        for m in msgs:
            self.log.append((self.name, m))
        if self.fail_keys and any(m.keys and m.keys[0].startswith("fail") for m in msgs):
            context.delay_level_when_next_consume = 1  # retried after 1 s
            raise RuntimeError("fails every time")


GRAY = ConsumerOptions(enable_gray_switch=True, gray_tag=True, gray_queue_ratio=0.25)
NORMAL = ConsumerOptions(enable_gray_switch=True, gray_queue_ratio=0.25)


@pytest.mark.slow
@pytest.mark.anyio
async def test_gray_traffic_and_its_retries_reach_only_the_gray_member() -> None:
    broker = MemoryBroker()
    queues = broker.create_topic("t", 8)
    log: list[tuple[str, Message]] = []
    gray = PushConsumer(
        "g",
        broker,
        ConcurrentLog("gray", log, fail_keys=True),
        options=attrs.evolve(GRAY, max_reconsume_times=2),
    )
    normal = PushConsumer(
        "g",
        broker,
        ConcurrentLog("normal", log, fail_keys=True),
        options=attrs.evolve(NORMAL, max_reconsume_times=2),
    )
    gray.subscribe("t")
    normal.subscribe("t")
    selector = SelectMessageQueueByGray(0.25)
    gray_queues = set(split_gray(queues, 0.25).gray)
    async with gray, normal:
        await _until(lambda: len(gray.assigned_queues) + len(normal.assigned_queues) == 8 + 2)
        assert "@gray[0.25]" in gray.client_id
        for i in range(40):
            is_gray = i % 2 == 0
            key = f"{'fail' if i % 5 == 0 else 'ok'}-{i}"  # 4 gray, 4 normal
            outgoing = OutgoingMessage.of(f"{i}".encode(), keys=[key])
            mq = selector.select(queues, outgoing, is_gray)
            assert (mq in gray_queues) == is_gray
            broker.send("t", outgoing.body, keys=[key], queue_id=mq.queue_id)
        # 8 failing messages, each tried 3 times (first + 2 retries), then the DLQ
        await _until(lambda: len(broker.messages("%DLQ%g")) == 8)
    by_body: dict[bytes, set[str]] = defaultdict(set)
    for name, m in log:
        by_body[m.body].add(name)
    for i in range(40):
        assert by_body[str(i).encode()] == {"gray" if i % 2 == 0 else "normal"}, i
    retried = [(name, m) for name, m in log if m.reconsume_times > 0]
    assert len(retried) == 8 * 2
    for name, m in retried:
        assert name == ("gray" if int(m.body) % 2 == 0 else "normal")
        assert (m.properties.get("GRAY") == "true") == (int(m.body) % 2 == 0)
    dlq = {int(m.body): m.properties.get("GRAY") for m in broker.messages("%DLQ%g")}
    assert dlq == {i: ("true" if i % 2 == 0 else None) for i in range(0, 40, 5)}
    gray_retry, normal_retry = broker.messages("%RETRY%g", 1), broker.messages("%RETRY%g", 0)
    assert sorted(int(m.body) for m in gray_retry) == sorted([0, 10, 20, 30] * 2)
    assert sorted(int(m.body) for m in normal_retry) == sorted([5, 15, 25, 35] * 2)


@pytest.mark.anyio
async def test_a_member_with_the_switch_off_leaves_no_queue_without_an_owner(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An old member (default options) next to a gray one: with the default
    # allocation it splits as the gray member does, so every queue has an owner.
    broker = MemoryBroker()
    broker.create_topic("t", 8)
    log: list[tuple[str, Message]] = []
    old = PushConsumer("g", broker, ConcurrentLog("old", log, fail_keys=False))
    gray = PushConsumer("g", broker, ConcurrentLog("gray", log, fail_keys=False), options=GRAY)
    old.subscribe("t")
    gray.subscribe("t")

    def owned(consumer: PushConsumer) -> set[int]:
        return {mq.queue_id for mq in consumer.assigned_queues if mq.topic == "t"}

    async with old, gray:
        # the gray side of 8 queues at 0.25 is 6 and 7; before, the old member
        # allocated 0..3 to itself, and nobody 4 and 5
        await _until(lambda: owned(gray) == {6, 7} and owned(old) == set(range(6)))
        for i in range(80):
            broker.send("t", b"%d" % i, queue_id=i % 8)
        await _until(lambda: len(log) == 80)
    assert {m.queue_id for name, m in log if name == "gray"} == {6, 7}
    assert {m.queue_id for name, m in log if name == "old"} == set(range(6))

    # A member with an allocation of its own that ignores gray members says so.
    class Mine(AllocateMessageQueueAveragely):
        pass

    caplog.clear()
    broker = MemoryBroker(group_options=GroupOptions(allocate_strategy=Mine()))
    broker.create_topic("t", 8)
    custom = PushConsumer("g", broker, ConcurrentLog("custom", log, fail_keys=False))
    gray = PushConsumer("g", broker, ConcurrentLog("gray", log, fail_keys=False), options=GRAY)
    custom.subscribe("t")
    gray.subscribe("t")
    async with custom, gray:
        await _until(lambda: any("allocates with Mine" in r.getMessage() for r in caplog.records))
    warned = [r.getMessage() for r in caplog.records if "allocates with Mine" in r.getMessage()]
    assert len(warned) == 1
    assert "Turn enable_gray_switch on on every member" in warned[0]


# -- the demo ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_gray_demo_checks_pass_and_can_fail() -> None:
    from stagedconsumer._cli._demo_gray import Call, _stage_order_kept, run_gray_demo

    def call(event: str, offset: int) -> Call:
        return Call(
            event=event, consumer="n", queue_id=0, offset=offset, gray=False, attempt=0, phase=1
        )

    # stages (2, 3): offset 2 may start only once offsets 0 and 1 ended
    early = [call("start", 0), call("start", 1), call("end", 0), call("start", 2)]
    assert not _stage_order_kept(early)
    assert _stage_order_kept([*early[:3], call("end", 1), call("start", 2)])

    result = await run_gray_demo(orders=6, events=3)
    assert result.ok, result.checks
    assert len(result.checks) == 8
    assert result.handled["both running"] == {
        "gray <- gray traffic": 9,
        "normal <- normal traffic": 9,
    }
    assert result.handled["gray stopped"] == {
        "normal <- gray traffic": 9,
        "normal <- normal traffic": 9,
    }


def test_gray_demo_command_prints_its_checks() -> None:
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "stagedconsumer", "demo", "gray", "--orders", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "100"},
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[ok] nothing lost: all 32 messages handled" in result.stdout
    assert "FAILED" not in result.stdout
    assert result.stderr == ""


# -- the case matrix of the RIP-72 discussion --------------------------------------------


class Lanes(MessageListenerConcurrently):
    def __init__(self, name: str, log: list[tuple[str, Message]]) -> None:
        self.name = name
        self.log = log

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.log.extend((self.name, m) for m in msgs)


@pytest.mark.anyio
@pytest.mark.parametrize("producers", ["all-gray", "mixed", "all-normal"])
@pytest.mark.parametrize("consumers", ["all-gray", "mixed", "all-normal"])
async def test_case_matrix_who_consumes_what_nothing_stranded_nothing_lost(
    producers: str, consumers: str
) -> None:
    broker = MemoryBroker()
    queues = broker.create_topic("t", 8)
    store = MemoryOffsetStore()
    log: list[tuple[str, Message]] = []
    tags = {"all-gray": [True, True], "mixed": [True, False], "all-normal": [False, False]}
    members = []
    for i, gray in enumerate(tags[consumers]):
        name = f"{'gray' if gray else 'normal'}{i}"
        options = GRAY if gray else NORMAL
        member = PushConsumer("g", broker, Lanes(name, log), offset_store=store, options=options)
        member.subscribe("t")
        members.append(member)
    selector = SelectMessageQueueByGray(0.25)
    async with members[0], members[1]:
        await _until(lambda: sum(len(m.assigned_queues) for m in members) == 8 + 2)
        for i in range(40):
            gray = {"all-gray": True, "all-normal": False, "mixed": i % 2 == 0}[producers]
            outgoing = OutgoingMessage.of(str(i).encode(), keys=[f"k{i}"])
            mq = selector.select(queues, outgoing, gray)
            broker.send("t", outgoing.body, keys=[f"k{i}"], queue_id=mq.queue_id)
        await _until(lambda: len(log) >= 40)
        await anyio.sleep(0.05)  # a duplicate would show up by now
    bodies = sorted(int(m.body) for _, m in log)
    assert bodies == list(range(40)), "lost or handled twice"
    gray_queues = set(split_gray(queues, 0.25).gray)
    for name, m in log:
        on_gray_queue = MessageQueue("t", m.queue_id) in gray_queues
        if consumers == "mixed":  # isolation while both kinds are alive
            assert name.startswith("gray") == on_gray_queue, (name, m.queue_id)
        else:  # one kind only: it consumes every queue, nothing stranded
            assert name.startswith("gray" if consumers == "all-gray" else "normal")


@pytest.mark.anyio
async def test_a_gray_member_with_a_larger_ratio_widens_the_gray_side_while_it_lives() -> None:
    """Gray members that disagree on the ratio: the largest wins (its gray queues
    include those of every smaller one), the queues move when that member joins and
    again when it leaves, and nothing is lost or handled twice across the moves."""
    broker = MemoryBroker()
    broker.create_topic("t", 8)
    store = MemoryOffsetStore()
    log: list[tuple[str, Message]] = []
    wide = ConsumerOptions(enable_gray_switch=True, gray_tag=True, gray_queue_ratio=0.5)
    normal = PushConsumer("g", broker, Lanes("normal", log), offset_store=store, options=NORMAL)
    narrow = PushConsumer("g", broker, Lanes("narrow", log), offset_store=store, options=GRAY)
    widening = PushConsumer("g", broker, Lanes("wide", log), offset_store=store, options=wide)
    for member in (normal, narrow, widening):
        member.subscribe("t")

    def topic_queues(member: PushConsumer) -> set[int]:
        return {mq.queue_id for mq in member.assigned_queues if mq.topic == "t"}

    sent = 0

    def send_to_every_queue() -> None:
        nonlocal sent
        for q in range(8):
            broker.send("t", str(sent).encode(), queue_id=q)
            sent += 1

    async with normal, narrow:
        await _until(lambda: topic_queues(narrow) == {6, 7} and len(topic_queues(normal)) == 6)
        send_to_every_queue()
        await _until(lambda: len(log) == sent)
        async with widening:  # ratio 0.5: queues 4 to 7 are gray now
            await _until(
                lambda: (
                    topic_queues(narrow) | topic_queues(widening) == {4, 5, 6, 7}
                    and topic_queues(normal) == {0, 1, 2, 3}
                )
            )
            send_to_every_queue()
            await _until(lambda: len(log) == sent)
        await _until(lambda: topic_queues(narrow) == {6, 7} and len(topic_queues(normal)) == 6)
        send_to_every_queue()
        await _until(lambda: len(log) == sent)
    assert sorted(int(m.body) for _, m in log) == list(range(sent)), "lost or handled twice"
    for name, m in log:
        rnd = int(m.body) // 8
        gray_side = {6, 7} if rnd != 1 else {4, 5, 6, 7}
        assert (name != "normal") == (m.queue_id in gray_side), (rnd, name, m.queue_id)
