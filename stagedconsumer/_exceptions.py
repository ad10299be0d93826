"""Exceptions raised by :mod:`stagedconsumer`.

The tree::

    StagedConsumerError
    ├── ConfigurationError (also ValueError)       bad input, raised at construction
    │   ├── InvalidStageDefinitionError            non-int, zero or negative stage sizes
    │   ├── InvalidOptionError                     unknown option or value out of range
    │   ├── ListenerTypeError (also TypeError)     listener of the wrong kind or shape
    │   ├── UnknownTopicError                      topic the source does not have
    │   └── InvalidMessageError                    a message that cannot be sent: body not
    │                                              bytes, keys/tags/properties not strings,
    │                                              over max_message_size
    ├── SourceError                                the message source failed
    │   │                                          (``retriable`` says whether to try again)
    │   ├── SourceClosedError                      the source was closed
    │   ├── SourcePermissionError                  the source refused a command or key to
    │   │                                          this client (Redis NOPERM): stops a consumer
    │   └── SendTimeoutError (also TimeoutError)   a send did not succeed within
    │                                              send_msg_timeout, retries included
    ├── HandlerError                               a listener call failed; raised only by
    │                                              ``consume_message_directly`` style helpers,
    │                                              never out of a running consumer
    ├── ConsumerStateError                         consumer method called in the wrong state
    ├── LeaseEndedError                            a queue's lease ended (or it was released)
    │                                              between taking a batch and starting its
    │                                              plain ``def`` handler: the batch went back
    │                                              uncalled; seen only by consume hooks
    ├── ProducerStateError                         producer method called in the wrong state
    └── WrongThreadError (also RuntimeError)       a call from a thread that must not make
                                                   it: the embedded broker's ``send`` from
                                                   outside the event loop it serves, a
                                                   blocking call from its own event loop

Handler failures are kept apart from source and store failures: a handler that
raises never stops the consumer (the batch is retried), while a source failure is
retried with backoff by the pull loop, unless the source refused this client a
permission (:class:`SourcePermissionError`), which waiting cannot fix. Offset store
failures use the tree of :mod:`offsetstore`.
"""

from __future__ import annotations

__all__ = (
    "ConfigurationError",
    "ConsumerStateError",
    "HandlerError",
    "InvalidMessageError",
    "InvalidOptionError",
    "InvalidStageDefinitionError",
    "LeaseEndedError",
    "ListenerTypeError",
    "ProducerStateError",
    "SourceClosedError",
    "SendTimeoutError",
    "SourceError",
    "SourcePermissionError",
    "StagedConsumerError",
    "UnknownTopicError",
    "WrongThreadError",
)


class StagedConsumerError(Exception):
    """Base class of every exception this package raises."""


class ConfigurationError(StagedConsumerError, ValueError):
    """Bad input, detected when the consumer, source or listener is set up."""


class InvalidStageDefinitionError(ConfigurationError):
    """Stage definitions that are not a sequence of positive ints."""


class InvalidOptionError(ConfigurationError):
    """An unknown option name, or an option value out of its allowed range."""


class ListenerTypeError(ConfigurationError, TypeError):
    """A listener of the wrong kind, or one whose ``consume_message`` or stage
    callback cannot be called the way the consumer calls it (see
    :class:`~stagedconsumer.MessageListener`)."""


class UnknownTopicError(ConfigurationError):
    """A topic that the message source does not have."""


class InvalidMessageError(ConfigurationError):
    """A message that cannot be sent (checked before anything is sent)."""


class SourceError(StagedConsumerError):
    """The message source failed.

    ``retriable`` is true when trying again later can succeed (a lost connection),
    false when it cannot (a malformed request).
    """

    def __init__(self, message: str, *, retriable: bool = True) -> None:
        super().__init__(message)
        self.retriable = retriable
        """Whether trying again later can succeed (a lost connection)."""


class SourceClosedError(SourceError):
    """The message source was closed."""

    def __init__(self, message: str = "the message source is closed") -> None:
        super().__init__(message, retriable=False)


class SourcePermissionError(SourceError):
    """The message source refused this client a command or a key: a Redis user whose
    ACL lacks a command the broker needs, or keys outside its pattern (``NOPERM``).

    Never retriable: entering a :class:`~stagedconsumer.RedisBroker` raises it when
    the user misses a permission, and a consumer that gets it later (its ACL was
    changed) stops as for a permanent offset store failure: it drains the handler
    calls in flight, commits, and raises it from ``async with``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=False)


class SendTimeoutError(SourceError, TimeoutError):
    """A send did not succeed within ``send_msg_timeout`` (its retries included).

    The message may still have been stored, by an attempt whose reply was lost
    (at-least-once); ``__cause__`` is the last failure, if any."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=True)


class HandlerError(StagedConsumerError):
    """A listener call raised; the original exception is ``__cause__``."""


class ConsumerStateError(StagedConsumerError):
    """A consumer method was called in a state that does not allow it."""


class LeaseEndedError(StagedConsumerError):
    """A batch's handler was not called: its queue's lease ended (or the queue was
    released) after the batch was taken and before the handler started.

    A plain ``def`` handler starts in a worker thread, a moment after its batch was
    taken on the event loop; the thread checks the lease again right before the call.
    When it ended, the batch goes back to its queue untouched (no attempt counted,
    nothing committed) and is delivered to whoever consumes the queue next. Never
    raised out of the consumer: consume hooks, which saw the call begin, see it as
    :attr:`ConsumeMessageContext.exception <stagedconsumer.ConsumeMessageContext.exception>`
    of a call that did not run (status ``EXCEPTION``, nothing settled).
    """


class ProducerStateError(StagedConsumerError):
    """A producer method was called in a state that does not allow it."""


class WrongThreadError(StagedConsumerError, RuntimeError):
    """A call from a thread that must not make it.

    Raised by :meth:`MemoryBroker.send <stagedconsumer.MemoryBroker.send>` called from
    another thread than the event loop that is waiting on the queue (go through that
    loop: ``portal.call(broker.send, ...)`` or a
    :class:`~stagedconsumer.blocking.BlockingProducer`), and by the blocking API
    (:mod:`stagedconsumer.blocking`) called from its own event loop's thread, where
    waiting for the loop would wait forever (``await`` the async object instead).
    """
