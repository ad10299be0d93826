"""Queue allocation strategies (pure) and group options."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagedconsumer import (
    AllocateMessageQueueAveragely,
    AllocateMessageQueueByConsistentHash,
    AllocateMessageQueueStrategy,
    ConfigurationError,
    GroupOptions,
    MessageQueue,
)

QUEUES = [MessageQueue("t", i) for i in range(8)]
STRATEGIES = [AllocateMessageQueueAveragely(), AllocateMessageQueueByConsistentHash()]


def test_averagely_matches_rocketmq_blocks() -> None:
    strategy = AllocateMessageQueueAveragely()
    members = ["a", "b", "c"]
    got = [[mq.queue_id for mq in strategy.allocate("g", m, QUEUES, members)] for m in members]
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert strategy.allocate("g", "z", QUEUES, members) == []
    many = [str(i) for i in range(10)]
    sizes = [len(strategy.allocate("g", m, QUEUES, many)) for m in many]
    assert sizes == [1] * 8 + [0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@given(
    n_queues=st.integers(0, 40),
    members=st.lists(
        st.text("abcdef", min_size=1, max_size=4), min_size=1, max_size=9, unique=True
    ),
)
def test_every_queue_goes_to_exactly_one_member(
    strategy: AllocateMessageQueueStrategy, n_queues: int, members: list[str]
) -> None:
    queues = [MessageQueue("t", i) for i in range(n_queues)]
    members = sorted(members)
    owned = [mq for m in members for mq in strategy.allocate("g", m, queues, members)]
    assert sorted(owned) == queues


def test_consistent_hash_moves_few_queues_when_a_member_leaves() -> None:
    strategy = AllocateMessageQueueByConsistentHash(virtual_nodes=50)
    queues = [MessageQueue("t", i) for i in range(64)]
    before_members = ["a", "b", "c", "d"]
    after_members = ["a", "b", "c"]
    before = {
        mq: m for m in before_members for mq in strategy.allocate("g", m, queues, before_members)
    }
    after = {
        mq: m for m in after_members for mq in strategy.allocate("g", m, queues, after_members)
    }
    moved = [mq for mq in queues if before[mq] != after[mq]]
    assert all(before[mq] == "d" for mq in moved)  # only the leaver's queues move


def test_group_options_validation() -> None:
    options = GroupOptions(lock_ttl=6, lock_renew_interval=1, rebalance_interval=2)
    assert options.local_lock_ttl == 3
    assert options.effective_member_ttl == 6
    assert options.tick == 1
    with pytest.raises(ConfigurationError, match="lock_ttl / 2"):
        GroupOptions(lock_ttl=10, lock_renew_interval=5)
    with pytest.raises(ConfigurationError):
        GroupOptions(lock_ttl=-1)
    with pytest.raises(ConfigurationError):
        GroupOptions(allocate_strategy="averagely")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        AllocateMessageQueueByConsistentHash(0)
