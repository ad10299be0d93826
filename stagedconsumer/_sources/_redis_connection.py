"""RedisConnection: the redis-py client a RedisBroker and its RedisCoordinator share.

Every Redis call of the broker and the coordinator goes through :meth:`~RedisConnection.call`
(one attempt) or :meth:`~RedisConnection.call_retrying` (retried on connection loss),
so both report failures the same way and count them in one place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import attrs
import sniffio

from .._core import Backoff
from .._exceptions import ConfigurationError, SourceClosedError, SourceError

try:
    import redis.asyncio as aioredis
    import redis.exceptions as redis_exc
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("RedisBroker needs redis-py: pip install 'stagedconsumer[redis]'") from exc

__all__ = ("RedisConnection", "RedisConnectionStatistics")

logger = logging.getLogger("stagedconsumer.redis")

_T = TypeVar("_T")

_RETRY_BASE = 0.05
"""First wait of :meth:`RedisConnection.call_retrying` (seconds); doubles per failure."""
_RETRY_CAP = 2.0
"""Longest wait of :meth:`RedisConnection.call_retrying` (seconds)."""

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    redis_exc.ConnectionError,
    redis_exc.TimeoutError,
    redis_exc.BusyLoadingError,
    redis_exc.TryAgainError,
    redis_exc.ReadOnlyError,
    OSError,
)
"""Failures of the connection, not of the request: trying again later can succeed."""


@attrs.frozen(kw_only=True)
class RedisConnectionStatistics:
    """A snapshot of a :class:`RedisConnection`."""

    connection_errors: int
    """Calls that failed on the connection (each retried or reported)."""
    closed: bool


class RedisConnection:
    """One redis-py asyncio client, its failure accounting and its call wrappers.

    Made by a :class:`~stagedconsumer.RedisBroker` and shared with its
    :class:`~._redis_coordinator.RedisCoordinator`, so producer, source and group
    coordination use one connection pool and one ``connection_errors`` count.

    - :meth:`call` makes one attempt: connection trouble becomes
      ``SourceError(retriable=True)``, any other Redis error
      ``SourceError(retriable=False)``, and a closed connection
      :class:`~stagedconsumer.SourceClosedError`.
    - :meth:`call_retrying` retries connection trouble with exponential backoff
      (0.05 s, doubling, up to 2 s between attempts; :class:`~stagedconsumer._core.Backoff`)
      until a deadline.
    - Each connection error runs the callbacks of :attr:`on_connection_error` (the
      broker drops what it read ahead: Redis may have restarted without its data).

    Runs on asyncio only (redis-py's asyncio client): the first call checks it.
    """

    def __init__(self, client: aioredis.Redis, *, url: str) -> None:
        self.client = client
        """The redis-py asyncio client."""
        self.url = url
        """Where it connects (for error messages)."""
        self.connection_errors = 0
        """Calls that failed on the connection (each retried or reported)."""
        self.on_connection_error: list[Callable[[], None]] = []
        """Called, in order, after every call that failed on the connection."""
        self._closed = False
        self._on_asyncio = False

    @classmethod
    def from_url(
        cls, url: str, *, socket_timeout: float, connect_timeout: float = 5.0
    ) -> RedisConnection:
        """A client for ``url`` that never retries on its own (:meth:`call_retrying`
        does, with the project's backoff) and returns raw bytes.

        A malformed URL raises :class:`~stagedconsumer.ConfigurationError`.
        """
        try:
            client = aioredis.Redis.from_url(
                url,
                decode_responses=False,
                socket_timeout=socket_timeout,
                socket_connect_timeout=min(socket_timeout, connect_timeout),
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
        except ValueError as exc:
            raise ConfigurationError(f"malformed Redis URL {url!r}: {exc}") from exc
        return cls(client, url=url)

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> RedisConnectionStatistics:
        return RedisConnectionStatistics(
            connection_errors=self.connection_errors, closed=self._closed
        )

    async def aclose(self) -> None:
        """Close the client's connection pool (idempotent); later calls raise
        :class:`~stagedconsumer.SourceClosedError`."""
        if self._closed:
            return
        self._closed = True
        await self.client.aclose()

    async def ping(self, connect_timeout: float) -> None:
        """``PING`` the server once, within ``connect_timeout`` seconds: entering a
        broker fails fast when Redis is not there.

        Raises ``SourceError(retriable=True)`` naming the URL when no reply came in
        time or the connection was refused, ``SourceError(retriable=False)`` when
        Redis answered with an error (a wrong password, for example).
        """
        try:
            with anyio.fail_after(connect_timeout):
                await self.call("PING", self.client.ping)
        except TimeoutError as exc:
            raise SourceError(
                f"Redis at {self.url} did not answer PING within {connect_timeout:g} s"
                " (connect_timeout)"
            ) from exc
        except SourceError as exc:
            raise SourceError(
                f"cannot connect to Redis at {self.url}: {exc.__cause__ or exc}",
                retriable=exc.retriable,
            ) from exc

    def check_open(self) -> None:
        if self._closed:
            raise SourceClosedError("the RedisBroker is closed")

    async def call(self, what: str, fn: Callable[[], Awaitable[_T]]) -> _T:
        """One Redis call; connection trouble becomes ``SourceError(retriable=True)``.

        ``what`` describes the call for the error message.
        """
        self.check_open()
        if not self._on_asyncio:
            library = sniffio.current_async_library()
            if library != "asyncio":
                raise ConfigurationError(
                    f"RedisBroker runs on asyncio only (redis-py's asyncio client), not {library}"
                )
            self._on_asyncio = True
        try:
            return await fn()
        except _CONNECTION_ERRORS as exc:
            self.connection_errors += 1
            for callback in self.on_connection_error:
                callback()
            raise SourceError(f"{what}: Redis at {self.url} unreachable: {exc}") from exc
        except redis_exc.RedisError as exc:
            raise SourceError(f"{what}: Redis error: {exc}", retriable=False) from exc

    async def call_retrying(self, what: str, fn: Callable[[], Awaitable[_T]], timeout: float) -> _T:
        """:meth:`call`, retried on connection loss with exponential backoff while the
        next attempt would start within ``timeout`` seconds of the first."""
        deadline = time.monotonic() + timeout
        backoff = Backoff(_RETRY_BASE, _RETRY_CAP)
        while True:
            try:
                return await self.call(what, fn)
            except SourceError as exc:
                delay = backoff.failed()
                if not exc.retriable or time.monotonic() + delay > deadline:
                    raise
                logger.warning("%s failed (%s); retrying in %.2f s", what, exc, delay)
                await anyio.sleep(delay)
