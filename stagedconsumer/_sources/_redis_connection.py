"""RedisConnection: the Redis client a RedisBroker and its RedisCoordinator share.

Every Redis call of the broker and the coordinator goes through :meth:`~RedisConnection.call`
(one attempt) or :meth:`~RedisConnection.call_retrying` (retried on connection loss),
so both report failures the same way and count them in one place. The commands
themselves go through :meth:`RedisConnection.execute` (raw replies: bytes, ints,
lists) and :class:`RedisScript` (``EVALSHA``, ``EVAL`` when the server lost it).

Two clients behind one interface, picked by the event loop the broker is entered on:

- **asyncio: redis-py** (``redis.asyncio``, replies parsed by hiredis);
- **trio: coredis** (built on anyio; its RESP parser compiled with mypyc).

redis-py's asyncio client does not run on trio. coredis runs on both, but its call
path costs more CPU: ``python -m benchmarks.redis_e2e`` measures both in the same
run (the ``XRANGE`` floor and the consumer), which is why asyncio keeps redis-py.

With ``cluster=True`` the same two libraries' cluster clients are used
(``redis.asyncio.cluster.RedisCluster``, ``coredis.RedisCluster``): they route each
command to the master of its key's slot and follow ``MOVED``/``ASK`` redirections
and fail-overs. Every command and script of the broker touches one slot (see
``_redis_scripts``); the only command that needs every master is ``SCAN``
(:meth:`RedisConnection.scan_keys`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import socket
import ssl
import time
import urllib.parse
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import anyio
import attrs
import sniffio

from .._core import Backoff
from .._exceptions import (
    ConfigurationError,
    SourceClosedError,
    SourceError,
    SourcePermissionError,
)
from ._redis_acl import describe_script_refusal, is_refusal
from ._redis_url import redact_url

try:
    import redis.asyncio as aioredis
    import redis.exceptions as redis_exc
    from redis.asyncio.cluster import RedisCluster as RedisPyCluster
    from redis.asyncio.connection import SSLConnection
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("RedisBroker needs redis-py: pip install 'stagedconsumer[redis]'") from exc

__all__ = ("PermissionRefused", "RedisConnection", "RedisConnectionStatistics", "RedisScript")

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
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    # a cluster without a reachable node, a slot without a master (mid fail-over)
    redis_exc.RedisClusterException,
    redis_exc.ClusterError,
)
"""Failures of the connection, not of the request: trying again later can succeed."""
_REQUEST_ERRORS: tuple[type[BaseException], ...] = (redis_exc.ClusterCrossSlotError,)
"""Errors of the request, checked before :data:`_CONNECTION_ERRORS` (some are
subclasses of cluster errors there): trying again cannot help."""
_CROSS_SLOT = "must map to the same key slot"
"""redis-py's cluster client refuses a command whose keys are in several slots with a
``RedisClusterException`` saying this (a request error too)."""
_REDIS_ERRORS: tuple[type[BaseException], ...] = (redis_exc.RedisError,)
_AUTH_ERRORS: tuple[type[BaseException], ...] = (
    redis_exc.AuthenticationError,
    redis_exc.AuthenticationWrongNumberOfArgsError,
)
"""A wrong password or user name, or none where one is needed (``WRONGPASS``,
``NOAUTH``): checked before :data:`_CONNECTION_ERRORS` (redis-py's are subclasses of
its ``ConnectionError``); waiting cannot help."""
_PERMISSION_ERRORS: tuple[type[BaseException], ...] = (redis_exc.NoPermissionError,)
"""``NOPERM``: the user may not run the command or touch the key."""
_CLOSED_WRITER_FILES = (
    os.path.join("redis", "asyncio", "connection.py"),
    os.path.join("asyncio", "streams.py"),
    os.path.join("asyncio", "selector_events.py"),
)
"""Where a write on a connection that was closed meanwhile fails with a bare
``AttributeError`` or ``TypeError`` (see :func:`_closed_writer`)."""
_NO_SCRIPT: tuple[type[BaseException], ...] = (redis_exc.NoScriptError,)

try:  # coredis: the client on trio (an optional part of the redis extra)
    import coredis
    import coredis.exceptions as coredis_exc
    from coredis.response._callbacks import NoopCallback
    from coredis.retry import NoRetryPolicy
    from coredis.typing import Key as CoredisKey
except ImportError:  # pragma: no cover - exercised only without coredis
    coredis = None  # type: ignore[assignment]
else:
    _CONNECTION_ERRORS += (
        coredis_exc.ConnectionError,
        coredis_exc.BusyLoadingError,
        coredis_exc.TryAgainError,
        coredis_exc.ReadOnlyError,
        coredis_exc.ClusterDownError,
        coredis_exc.RedisClusterError,  # no layout yet, a slot without a master
    )
    _REQUEST_ERRORS += (coredis_exc.ClusterCrossSlotError,)
    _REDIS_ERRORS += (coredis_exc.RedisError,)
    _AUTH_ERRORS += (coredis_exc.AuthenticationError,)
    _PERMISSION_ERRORS += (coredis_exc.AuthorizationError,)
    _NO_SCRIPT += (coredis_exc.NoScriptError,)

Execute = Callable[..., Awaitable[Any]]
"""``execute(command, *args, keys=(0,))``: one Redis command, its raw reply."""


class _TLSConnection(SSLConnection):
    """redis-py's TLS connection with a context given whole (``tls_context``), not
    made from its ``ssl_*`` options."""

    def __init__(self, *, tls_context: ssl.SSLContext, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ssl_context.context = tls_context


def _use_tls_context(client: Any, context: ssl.SSLContext, *, cluster: bool) -> None:
    """Make redis-py's ``client`` (not connected yet) open its connections with TLS
    and ``context``."""
    if cluster:
        kwargs = client.nodes_manager.connection_kwargs
        kwargs["connection_class"] = _TLSConnection
        kwargs["tls_context"] = context
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_class = _TLSConnection
            node.connection_kwargs["tls_context"] = context
    else:
        pool = client.connection_pool
        pool.connection_class = _TLSConnection
        pool.connection_kwargs["tls_context"] = context


def _secrets(url: str) -> tuple[str, ...]:
    """The password of ``url`` (user info or ``password=`` query), raw and
    percent-decoded: what :meth:`RedisConnection.scrub` masks."""
    found: set[str] = set()
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password:
            found.add(parts.password)
        for name, value in urllib.parse.parse_qsl(parts.query):
            if name.lower() in ("password", "ssl_password") and value:
                found.add(value)
    except ValueError:
        pass
    found |= {urllib.parse.unquote(secret) for secret in found}
    # longest first: a password that contains another is masked whole
    return tuple(sorted((s for s in found if s), key=len, reverse=True))


_UNKNOWN_HOST = frozenset(
    code
    for code in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None))
    if code is not None
)
"""``getaddrinfo`` errors that say the name does not exist (``EAI_AGAIN``, a
resolver not answering yet, is retried)."""


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the members of exception groups among
    them (each once)."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def _permanent_reason(exc: BaseException) -> str | None:
    """Why connecting failed for good, when it did: a TLS handshake that failed (its
    reason), an unknown host name, refused credentials; ``None`` for what may pass
    (refused, reset, timed out)."""
    for cause in _causes(exc):
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"TLS: certificate verify failed: {cause.verify_message or cause}"
        if isinstance(cause, ssl.SSLError):
            return f"TLS: {cause.reason or cause}"
        if isinstance(cause, socket.gaierror) and cause.errno in _UNKNOWN_HOST:
            return f"unknown host: {cause.strerror or cause}"
        if isinstance(cause, _AUTH_ERRORS):
            return "authentication failed"
    return None


def _os_reason(exc: BaseException) -> str | None:
    """The operating system's words for a failed connection (``Connection refused``),
    which coredis leaves out of its own message."""
    for cause in _causes(exc):
        if isinstance(cause, OSError) and cause.strerror:
            return str(cause.strerror)
    return None


def _closed_writer(exc: AttributeError | TypeError) -> bool:
    """Whether ``exc`` is redis-py's asyncio connection writing on a connection that
    was closed while the write waited its turn (its writer already ``None``, or the
    transport's write callback gone): redis-py lets that race out as a bare
    ``AttributeError`` or ``TypeError`` instead of its ``ConnectionError`` (seen in a
    Redis Cluster fail-over, when the client drops a node's connections while a
    command is on its way). Recognised by where it was raised and by what was torn
    down (an attribute already ``None``: "'NoneType' object ..."), so that the same
    errors from anywhere else, or of another kind there (a bug), still propagate."""
    tb = exc.__traceback__
    if tb is None or "'NoneType' object" not in str(exc):
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.endswith(_CLOSED_WRITER_FILES)


@attrs.frozen(kw_only=True)
class RedisConnectionStatistics:
    """A snapshot of a :class:`RedisConnection`."""

    connection_errors: int
    """Calls that failed on the connection (each retried or reported)."""
    closed: bool


class PermissionRefused(Exception):
    """Redis refused a command or a key to the connection's user (``NOPERM``, or a
    script's call refused): trying again cannot help."""


class RedisScript:
    """A Lua script run with ``EVALSHA``, or ``EVAL`` when the server does not have it
    (first use, or after a restart or ``SCRIPT FLUSH``)."""

    def __init__(self, connection: RedisConnection, lua: str) -> None:
        self._connection = connection
        self.lua = lua
        self.sha = hashlib.sha1(lua.encode()).hexdigest()

    async def __call__(self, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        """The script's raw reply (Lua errors raise the client's ``ResponseError``)."""
        execute = self._connection.execute
        positions = tuple(range(2, 2 + len(keys)))
        try:
            try:
                return await execute("EVALSHA", self.sha, len(keys), *keys, *args, keys=positions)
            except _NO_SCRIPT:
                return await execute("EVAL", self.lua, len(keys), *keys, *args, keys=positions)
        except _REDIS_ERRORS as exc:
            if not is_refusal(exc) or isinstance(exc, _CONNECTION_ERRORS):
                raise
            detail = await describe_script_refusal(execute, self.lua, keys, exc)
            raise PermissionRefused(self._connection.scrub(detail)) from exc


class RedisConnection:
    r"""One Redis client (redis-py on asyncio, coredis on trio), its failure accounting
    and its call wrappers.

    Made by a :class:`~stagedconsumer.RedisBroker` and shared with its
    :class:`~._redis_coordinator.RedisCoordinator`, so producer, source and group
    coordination use one connection pool and one ``connection_errors`` count.

    - :meth:`execute` sends one command and returns the raw reply (bytes, ints,
      lists; no client-side conversion); :class:`RedisScript` runs a Lua script.
    - :meth:`call` makes one attempt: connection trouble becomes
      ``SourceError(retriable=True)``, any other Redis error
      ``SourceError(retriable=False)``, and a closed connection
      :class:`~stagedconsumer.SourceClosedError`.
    - :meth:`call_retrying` retries connection trouble with exponential backoff
      (0.05 s, doubling, up to 2 s between attempts; :class:`~stagedconsumer._core.Backoff`)
      until a deadline.
    - Each connection error runs the callbacks of :attr:`on_connection_error` (the
      broker drops what it read ahead: Redis may have restarted without its data).

    :meth:`open` (entering the broker) picks the client for the running event loop
    and ``PING``\ s the server. On asyncio a connection used without :meth:`open`
    picks redis-py at its first call; on trio it must be opened (coredis keeps its
    connection pool in a task group that lives from :meth:`open` to :meth:`aclose`).
    """

    def __init__(
        self,
        url: str,
        *,
        socket_timeout: float,
        connect_timeout: float,
        cluster: bool = False,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._url = url
        self.url = redact_url(url)
        """Where it connects, its password masked (``***``): for messages; with
        ``cluster``, any node."""
        self._secrets = _secrets(url)
        self.tls = tls
        """The TLS context both clients use (``None``: plain TCP)."""
        self.cluster = cluster
        """A Redis Cluster (the clients' cluster variants), not a single server."""
        self.connection_errors = 0
        """Calls that failed on the connection (each retried or reported)."""
        self.on_connection_error: list[Callable[[], None]] = []
        """Called, in order, after every call that failed on the connection."""
        self.library: str | None = None
        """The client in use: ``"redis-py"`` or ``"coredis"`` (``None`` before the
        first call)."""
        self._socket_timeout = socket_timeout
        self._connect_timeout = connect_timeout
        self._closed = False
        self._stack: contextlib.AsyncExitStack | None = None
        factory: Any = RedisPyCluster if cluster else aioredis.Redis
        tls_options: dict[str, Any] = {"ssl": True} if cluster and tls is not None else {}
        try:  # redis-py makes no connection here: this only checks the URL
            self._redispy = factory.from_url(
                url,
                decode_responses=False,
                socket_timeout=socket_timeout,
                socket_connect_timeout=min(socket_timeout, connect_timeout),
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
                **tls_options,
            )
        except (ValueError, redis_exc.RedisClusterException) as exc:
            raise ConfigurationError(
                f"malformed Redis URL {self.url!r}: {self.scrub(exc)}"
            ) from None
        if tls is not None:
            _use_tls_context(self._redispy, tls, cluster=cluster)
        # Raw replies for every command: the broker reads them positionally. The
        # cluster client parses its own COMMAND and CLUSTER replies with these.
        callbacks = self._redispy.response_callbacks
        for name in list(callbacks):
            if not (cluster and name.startswith(("COMMAND", "CLUSTER"))):
                del callbacks[name]
        self.client: Any = self._redispy
        """The client in use (redis-py's ``redis.asyncio.Redis`` or
        ``coredis.Redis``; their ``RedisCluster`` with ``cluster``), for tools and
        tests."""
        self.execute: Execute = self._execute_first
        """``await execute(command, *args, keys=(0,))``: one command, its raw reply;
        ``keys`` are the positions of ``args`` that are keys."""

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> RedisConnectionStatistics:
        return RedisConnectionStatistics(
            connection_errors=self.connection_errors, closed=self._closed
        )

    # -- the two clients -------------------------------------------------------------------

    async def open(self, connect_timeout: float) -> None:
        """Pick the client for the running event loop and ``PING`` the server, trying
        again while it is not reachable yet, for up to ``connect_timeout`` seconds.

        A refused or reset connection (Redis starting, restarting, or its port not
        open yet) is retried with exponential backoff (0.05 s, doubling, up to 2 s;
        one WARNING per failed attempt) while the next attempt would start within
        ``connect_timeout`` of the first. What waiting cannot fix fails at once,
        ``SourceError(retriable=False)``: an unknown host, refused credentials, a
        TLS handshake that failed (its reason in the message). A malformed URL was
        refused when the connection was made (:class:`ConfigurationError`).
        """
        self.check_open()
        deadline = time.monotonic() + connect_timeout
        backoff = Backoff(_RETRY_BASE, _RETRY_CAP)
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._open_once(deadline, connect_timeout)
            except SourceError as exc:
                delay = backoff.failed()
                if not exc.retriable or time.monotonic() + delay >= deadline:
                    if attempt > 1:
                        raise SourceError(
                            f"{exc} (attempt {attempt} within connect_timeout"
                            f" {connect_timeout:g} s)",
                            retriable=exc.retriable,
                        ) from exc.__cause__
                    raise
                logger.warning(
                    "Redis not reachable yet (attempt %d: %s); retrying in %.2f s"
                    " (up to connect_timeout %g s)",
                    attempt,
                    exc,
                    delay,
                    connect_timeout,
                )
                await anyio.sleep(delay)
            else:
                if attempt > 1:
                    logger.info("connected to Redis at %s (attempt %d)", self.url, attempt)
                return

    async def _open_once(self, deadline: float, connect_timeout: float) -> None:
        """One attempt of :meth:`open`: the client (once) and a ``PING``."""
        if self.library is None:
            library = sniffio.current_async_library()
            if library == "asyncio":
                self._use_redispy()
            elif library == "trio":
                # coredis's cluster client reads the cluster's layout on entering
                await self._connecting(self._use_coredis)
            else:  # pragma: no cover - anyio runs on these two
                raise ConfigurationError(f"RedisBroker runs on asyncio and trio, not {library}")
        await self.ping(max(deadline - time.monotonic(), 0.0), connect_timeout)

    def _use_redispy(self) -> None:
        client = self._redispy

        async def execute(*args: Any, keys: Sequence[int] = (0,)) -> Any:
            return await client.execute_command(*args)

        self.execute = execute
        self.library = "redis-py"

    async def _use_coredis(self) -> None:
        if coredis is None:
            raise ConfigurationError(
                "RedisBroker on trio needs coredis: pip install 'stagedconsumer[redis]'"
            )
        factory: Any = coredis.RedisCluster if self.cluster else coredis.Redis
        try:
            with warnings.catch_warnings():
                # coredis's own RedisCluster.from_url passes its startup node as a
                # dict, which its pool then warns about (coredis 6.x)
                warnings.filterwarnings(
                    "ignore", "Use coredis.connection.TCPLocation", DeprecationWarning
                )
                options: dict[str, Any] = {"reinitialize_steps": 1} if self.cluster else {}
                if self.tls is not None:
                    options["ssl_context"] = self.tls
                client = factory.from_url(
                    self._url,
                    decode_responses=False,
                    stream_timeout=self._socket_timeout,
                    connect_timeout=min(self._socket_timeout, self._connect_timeout),
                    retry_policy=NoRetryPolicy(),
                    verify_version=False,
                    **options,
                )
        except ValueError as exc:
            raise ConfigurationError(
                f"malformed Redis URL {self.url!r}: {self.scrub(exc)}"
            ) from None
        stack = contextlib.AsyncExitStack()
        self._stack = stack
        await stack.enter_async_context(client)
        create = client.create_request
        noop: NoopCallback[Any] = NoopCallback()

        if self.cluster:
            report = client.on_retry_error

            async def execute(name: str, *args: Any, keys: Sequence[int] = (0,)) -> Any:
                # coredis routes a command by the arguments wrapped in Key
                if keys:
                    listed = list(args)
                    for position in keys:
                        listed[position] = CoredisKey(listed[position])
                    args = tuple(listed)
                try:
                    return await create(name.encode(), *args, callback=noop)
                except _CONNECTION_ERRORS as exc:
                    # A failed connection to a node is not reported to coredis's
                    # layout monitor (its retry policy's hook does that, and we retry
                    # ourselves): report it, so that the layout is read again and a
                    # replica that took over is found.
                    await report(exc)
                    raise

        else:

            async def execute(name: str, *args: Any, keys: Sequence[int] = (0,)) -> Any:
                return await create(name.encode(), *args, callback=noop)

        self.client = client
        self.execute = execute
        self.library = "coredis"

    async def _execute_first(self, *args: Any, keys: Sequence[int] = (0,)) -> Any:
        """The first call without :meth:`open`: redis-py on asyncio; trio needs :meth:`open`."""
        library = sniffio.current_async_library()
        if library != "asyncio":
            raise ConfigurationError(
                f"on {library}, enter the RedisBroker before using it"
                " (async with RedisBroker(...) as broker)"
            )
        self._use_redispy()
        return await self.execute(*args, keys=keys)

    async def aclose(self) -> None:
        """Close the client's connection pool (idempotent); later calls raise
        :class:`~stagedconsumer.SourceClosedError`."""
        if self._closed:
            return
        self._closed = True
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.aclose()
        elif self.library == "redis-py":
            await self._redispy.aclose()

    async def scan_keys(self, match: str) -> list[bytes]:
        """Every key matching the pattern ``match`` (``SCAN``), on a cluster from every
        master. One attempt: connection trouble raises the client's error."""
        self.check_open()
        if self.library is None:
            await self.execute("PING", keys=())  # picks the client
        found: list[bytes] = []
        async with contextlib.AsyncExitStack() as stack:
            nodes: list[Execute]
            if not self.cluster:
                nodes = [functools.partial(self.execute, keys=())]
            elif self.library == "redis-py":
                nodes = [node.execute_command for node in self._redispy.get_primaries()]
            else:
                noop: NoopCallback[Any] = NoopCallback()
                nodes = []
                for primary in self.client.primaries:
                    node = await stack.enter_async_context(primary)

                    async def execute(name: str, *args: Any, node: Any = node) -> Any:
                        return await node.create_request(name.encode(), *args, callback=noop)

                    nodes.append(execute)
            for execute_on_node in nodes:
                cursor: Any = b"0"
                while True:
                    cursor, keys = await execute_on_node(
                        "SCAN", cursor, "MATCH", match, "COUNT", 1000
                    )
                    found.extend(keys)
                    if int(cursor) == 0:
                        break
        return list(dict.fromkeys(found))

    async def _connecting(self, step: Callable[[], Awaitable[None]]) -> None:
        """``step`` (entering the client: a cluster client reads the cluster's layout
        there), its failures reported as :meth:`ping` reports them.

        Not under a ``connect_timeout`` cancel scope: the client starts its
        connection pool's task group there, which must outlive the step; its own
        ``connect_timeout`` bounds each connection attempt.
        """
        try:
            await self.call("connecting", step)
        except SourceError as exc:
            raise self._connect_error(exc) from exc

    async def ping(self, timeout: float, connect_timeout: float | None = None) -> None:
        """``PING`` the server once, within ``timeout`` seconds.

        Raises ``SourceError(retriable=True)`` naming the URL when no reply came in
        time or the connection was refused or reset, ``SourceError(retriable=False)``
        when waiting cannot help: Redis refused the credentials (or answered with
        another error), the host name is unknown, the TLS handshake failed.
        """
        try:
            with anyio.fail_after(timeout):
                await self.call("PING", lambda: self.execute("PING", keys=()))
        except TimeoutError as exc:
            raise SourceError(
                f"Redis at {self.url} did not answer PING within"
                f" {connect_timeout if connect_timeout is not None else timeout:g} s"
                " (connect_timeout)"
            ) from exc
        except SourceError as exc:
            raise self._connect_error(exc) from exc

    def _connect_error(self, exc: SourceError) -> SourceError:
        """``exc`` (a failed connection or ``PING``) as entering the broker reports
        it: naming the URL, and not retriable when waiting cannot help."""
        cause = exc.__cause__ or exc
        permanent = _permanent_reason(cause)
        reason = permanent if permanent is not None else _os_reason(cause)
        text = f"cannot connect to Redis at {self.url}: {self.scrub(cause)}"
        if reason is not None and reason not in text:
            text += f" ({self.scrub(reason)})"
        if isinstance(exc, SourcePermissionError):  # the user may not even PING
            return SourcePermissionError(text)
        return SourceError(text, retriable=exc.retriable and permanent is None)

    def scrub(self, error: object) -> str:
        """``str(error)`` with the URL's password masked, should a client's message
        ever quote it."""
        text = str(error)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def check_open(self) -> None:
        if self._closed:
            raise SourceClosedError("the RedisBroker is closed")

    async def call(self, what: str, fn: Callable[[], Awaitable[_T]]) -> _T:
        """One Redis call; connection trouble becomes ``SourceError(retriable=True)``.

        ``what`` describes the call for the error message.
        """
        self.check_open()
        try:
            return await fn()
        except _AUTH_ERRORS as exc:
            raise SourceError(
                f"{what}: Redis refused the credentials: {self.scrub(exc)}", retriable=False
            ) from exc
        except PermissionRefused as exc:
            raise SourcePermissionError(f"{what}: Redis refused: {exc}") from exc
        except _PERMISSION_ERRORS as exc:
            raise SourcePermissionError(f"{what}: Redis refused: {self.scrub(exc)}") from exc
        except _REQUEST_ERRORS as exc:
            raise SourceError(f"{what}: Redis error: {self.scrub(exc)}", retriable=False) from exc
        except _CONNECTION_ERRORS as exc:
            if _CROSS_SLOT in str(exc):  # redis-py's own check, a RedisClusterException
                raise SourceError(
                    f"{what}: Redis error: {self.scrub(exc)}", retriable=False
                ) from exc
            raise self._lost(what, self.scrub(exc)) from exc
        except _REDIS_ERRORS as exc:
            raise SourceError(f"{what}: Redis error: {self.scrub(exc)}", retriable=False) from exc
        except (AttributeError, TypeError) as exc:
            if not _closed_writer(exc):
                raise
            detail = (
                f"the connection closed during a write ({type(exc).__name__}: {self.scrub(exc)})"
            )
            raise self._lost(what, detail) from exc

    def _lost(self, what: str, detail: str) -> SourceError:
        """Count a connection failure, tell the callbacks, and describe it."""
        self.connection_errors += 1
        for callback in self.on_connection_error:
            callback()
        return SourceError(f"{what}: Redis at {self.url} unreachable: {detail}")

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
