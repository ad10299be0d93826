"""Transactor: what ``context.transact(fn)`` of a handler call does in a consumer.

The handler's effects and its messages' finished marks are written in one
transaction of the offset store (see :meth:`offsetstore.StageOffsetStore.transact`),
checked against the queue's fence in a consumer group. Once it committed, the
process queue holds the messages' offsets in ``transacted``: the worker settles a
call whose messages are all there as a success, whatever it returned or raised
(:meth:`Transactor.settled_as_finished`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from offsetstore import AlreadyFinishedError, StageOffsetStore, StoreFencedError

from .._core import Batch, ProcessQueue
from .._message import Message, MessageQueue
from ._state import ConsumerState

if TYPE_CHECKING:
    from ._services import ConsumeService

__all__ = ("Transactor",)

logger = logging.getLogger("stagedconsumer")

_T = TypeVar("_T")
_PRUNE_AT = 1024
"""Offsets kept in a queue's ``transacted`` before those below its committed offset
(finished, so never asked about again) are dropped."""


class Transactor:
    """Runs handler transactions for one consumer."""

    def __init__(
        self,
        *,
        state: ConsumerState,
        store: StageOffsetStore,
        fence_of: Callable[[MessageQueue], int | None] | None,
        service: ConsumeService | None = None,
    ) -> None:
        self.runs: Sequence[Any] = () if service is None else service.active_runs
        self.retry_copies: bool = service is not None and (
            service.retry_queues and not service.options.retry_in_place
        )
        """Whether failed messages go to the retry queue as copies (concurrent mode
        without ``retry_in_place``): said once, at the first transaction."""
        self.state = state
        self.store = store
        self.fence_of = fence_of

    def messages_of(self, context: object, batch: Batch) -> Sequence[Message]:
        """The messages of the handler call of ``context`` (on ``batch``): a run's call
        has one message of the run's batch, any other call the whole batch."""
        messages: list[Message] = batch.messages
        for run in self.runs:
            if run.context is context and run.batch is batch:
                done: int = run.done
                return messages[done : done + 1]
        return messages

    async def transact(
        self, pq: ProcessQueue, messages: Sequence[Message], fn: Callable[[Any], _T]
    ) -> _T:
        mq = pq.message_queue
        fence: int | None = None
        if self.fence_of is not None:
            fence = self.fence_of(mq)
            if fence is None:
                raise StoreFencedError(
                    f"group {self.state.group!r}: this member no longer holds {mq}: its"
                    " transaction was not committed (the queue's next owner handles the"
                    " messages)",
                    queues=(mq,),
                )
        offsets = [message.queue_offset for message in messages]
        try:
            result = await self.store.transact(self.state.group, mq, offsets, fn, fence=fence)
        except AlreadyFinishedError as exc:
            self._mark(pq, exc.offsets)
            raise
        self._mark(pq, offsets)
        self.state.transactions += 1
        if self.retry_copies:
            self.retry_copies = False
            logger.warning(
                "group %s: a concurrent listener commits effects with transact() while"
                " its failed messages go to the retry queue %%RETRY%%%s as copies: after a"
                " crash, a message and its copy can both commit their effect. Set"
                " ConsumerOptions(retry_in_place=True) for effects exactly once",
                self.state.group,
                self.state.group,
            )
        return result

    @staticmethod
    def _mark(pq: ProcessQueue, offsets: Any) -> None:
        transacted = pq.transacted
        if transacted is None:
            transacted = pq.transacted = set()
        elif len(transacted) >= _PRUNE_AT:
            committed = pq.committed_offset
            pq.transacted = transacted = {o for o in transacted if o >= committed}
        transacted.update(offsets)

    @staticmethod
    def settled_as_finished(batch: Batch) -> bool:
        """Whether every message of ``batch`` has its finished mark committed: the
        failed call is then settled as a success (its effects are committed)."""
        transacted = batch.process_queue.transacted
        if not transacted:
            return False
        return all(m.queue_offset in transacted for m in batch.messages)
