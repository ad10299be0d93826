"""The blocking API, for code that is not async.

:class:`BlockingProducer` sends and returns a :class:`~stagedconsumer.SendResult`;
:class:`BlockingConsumer` runs a :class:`~stagedconsumer.PushConsumer` for the length
of a ``with`` block; :class:`BlockingSimpleConsumer` receives and acks with a
:class:`~stagedconsumer.SimpleConsumer`. They run their async object on an event
loop in another thread through an anyio :class:`~anyio.from_thread.BlockingPortal`,
and wait for it::

    from anyio.from_thread import start_blocking_portal
    from stagedconsumer.blocking import BlockingConsumer, BlockingProducer

    with start_blocking_portal() as portal:  # one event loop thread for both
        with BlockingConsumer(consumer, portal=portal) as running, \\
                BlockingProducer(broker, portal=portal) as producer:
            producer.send("orders", b"...", keys=["order-1"])
            running.wait_caught_up(timeout=60)

Rules:

- **One event loop per source.** A :class:`~stagedconsumer.MemoryBroker` (and a
  :class:`~stagedconsumer.RedisBroker`, whose connections belong to a loop) lives on
  one event loop: a producer and a consumer of the same broker must share a portal
  (``portal=``; or ``portal=running.portal``, the one a consumer started for itself).
  Starting an object on another portal than one already using its source raises
  :class:`~stagedconsumer.ConfigurationError`. Without ``portal=`` an object starts a
  portal of its own (``backend="asyncio"`` or ``"trio"``, ``backend_options``) and
  stops it when left, cancelling whatever else still runs there: leave the objects
  that borrowed it first (nested ``with`` blocks do).
- **The embedded broker from the calling thread.** Create topics and send a first
  backlog before anything starts; once an event loop uses the broker, send through a
  :class:`BlockingProducer` on its portal (or ``portal.call(broker.send, ...)``). A
  ``broker.send`` from another thread while a consumer waits on the queue raises
  :class:`~stagedconsumer.WrongThreadError`; other races are not detected. A
  ``RedisBroker``'s async methods go through the portal too
  (``portal.call(broker.create_topic, "orders", 8)``), and it is closed there
  (``portal.wrap_async_context_manager(broker)``).
- **Threads.** Blocking calls may come from any thread but the event loop's own,
  where they would wait for themselves and raise
  :class:`~stagedconsumer.WrongThreadError` (in an ``async def`` handler, await the
  async object: ``producer.producer.send``). Plain ``def`` handlers run in worker
  threads and may call a :class:`BlockingProducer`.
- **Errors** come out as themselves; a consumer stopped by a failure raises it when
  its block is left. **Ctrl-C** in a block stops it gracefully (in-flight handler
  calls drain up to ``shutdown_timeout``); a Ctrl-C while it drains stops at once.
"""

from ._runtime._blocking import BlockingConsumer as BlockingConsumer
from ._runtime._blocking import BlockingProducer as BlockingProducer
from ._runtime._blocking_simple import BlockingAckFuture as BlockingAckFuture
from ._runtime._blocking_simple import BlockingSimpleConsumer as BlockingSimpleConsumer

__all__ = (
    "BlockingAckFuture",
    "BlockingConsumer",
    "BlockingProducer",
    "BlockingSimpleConsumer",
)
