"""Which pop backend serves a source (see :mod:`._pop`): the embedded broker's, or
Redis's, or the one a source of another kind provides (``source.pop_backend(settings)``)."""

from __future__ import annotations

from .._exceptions import ConfigurationError
from ._memory import MemoryBroker
from ._pop import PopBackend, PopSettings
from ._source import MessageSource

__all__ = ("pop_backend",)


def pop_backend(source: MessageSource, settings: PopSettings) -> PopBackend:
    """The pop backend of ``source`` for one group (shared state per source)."""
    if isinstance(source, MemoryBroker):
        from ._memory_pop import memory_pop_backend

        return memory_pop_backend(source, settings)
    make = getattr(source, "pop_backend", None)
    if make is not None:
        backend: PopBackend = make(settings)
        return backend
    try:
        from ._redis_broker import RedisBroker
    except ImportError:  # redis-py is optional
        pass
    else:
        if isinstance(source, RedisBroker):
            from ._redis_pop import RedisPopBackend

            return RedisPopBackend(source, settings)
    raise ConfigurationError(
        f"{type(source).__name__} does not support pop consumption (SimpleConsumer):"
        " use MemoryBroker or RedisBroker"
    )
