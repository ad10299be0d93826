"""The consumer builds listener contexts without the attrs ``__init__`` (a hot path);
these constructors must give exactly what the public ``__init__`` gives."""

from __future__ import annotations

import attrs
import pytest

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumeStagedConcurrentlyContext,
    MessageQueue,
)
from stagedconsumer._listeners import (
    _concurrently_context,
    _orderly_context,
    _staged_context,
)

MQ = MessageQueue("t", 3)


class _Queue:
    message_queue = MQ


class _Batch:  # what the constructors read of a stagedconsumer._core.Batch
    process_queue = _Queue()
    stage_index = 2
    strategy_id = "default"
    group_id = "g"


@pytest.mark.parametrize(
    ("fast", "public"),
    [
        (_concurrently_context(_Batch(), 0), ConsumeConcurrentlyContext(message_queue=MQ)),
        (
            _orderly_context(_Batch(), 250),
            ConsumeOrderlyContext(message_queue=MQ, suspend_current_queue_time_millis=250),
        ),
        (
            _staged_context(_Batch(), 40),
            ConsumeStagedConcurrentlyContext(
                message_queue=MQ,
                stage_index=2,
                strategy_id="default",
                group_id="g",
                suspend_current_queue_time_millis=40,
            ),
        ),
    ],
    ids=["concurrently", "orderly", "staged"],
)
def test_fast_constructor_matches_the_attrs_init(fast: object, public: object) -> None:
    assert type(fast) is type(public)
    # asdict reads every field: an unset slot raises AttributeError.
    assert attrs.asdict(fast) == attrs.asdict(public)  # type: ignore[arg-type]
    fields = [f.name for f in attrs.fields(type(public))]  # type: ignore[arg-type]
    assert set(attrs.asdict(fast)) == set(fields)  # type: ignore[arg-type]
