"""A redis-server of a test's own, on a free port of 127.0.0.1, in a temporary directory;
and a Redis Cluster of its own (``RedisClusterServers``, shared with the benchmarks)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import anyio
import anyio.abc

from benchmarks._ports import free_ports
from benchmarks._redis_cluster import ClusterNode, RedisClusterServers, wait_for_pong

__all__ = ("HangingProxy", "RedisClusterServers", "RedisServer")


class RedisServer(ClusterNode):
    """A standalone ``redis-server`` with an append-only file (``url``, ``kill`` as a
    cluster node's).

    ``options`` are more ``redis-server`` arguments (``--tls-port``, ``--aclfile``);
    with ``password`` the ``default`` user needs it (``--requirepass``, unless an
    ``--aclfile`` sets it), and :meth:`start` and :meth:`stop` use it."""

    def __init__(self, directory: Path, *options: str, password: str | None = None) -> None:
        super().__init__(directory)
        (self.port,) = free_ports(1)
        self.options = options
        self.password = password
        # an ACL file sets the default user's password itself
        self._requirepass = password is not None and "--aclfile" not in options

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.dir),
                "--appendonly", "yes",
                "--appendfsync", "always",
                "--save", "",
                "--logfile", str(self.dir / "redis.log"),
                *(("--requirepass", self.password) if self._requirepass else ()),
                *self.options,
            ],
        )  # fmt: skip
        if self.password is None:
            wait_for_pong(self.port, self.dir / "redis.log")
        else:
            _wait_for_pong_with(self.port, self.password, self.dir / "redis.log")

    def stop(self) -> None:
        """Shut down cleanly (the AOF is complete: appendfsync always)."""
        if self.proc is None:
            return
        auth = ("--no-auth-warning", "-a", self.password) if self.password is not None else ()
        subprocess.run(
            ["redis-cli", "-p", str(self.port), *auth, "shutdown"],
            check=False,
            capture_output=True,
        )
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def _wait_for_pong_with(port: int, password: str, log: Path, timeout: float = 10) -> None:
    """:func:`wait_for_pong` for a server whose ``default`` user needs ``password``."""
    deadline = time.monotonic() + timeout
    command = f"AUTH {password}\r\nPING\r\n".encode()
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2) as s:
                s.sendall(command)
                reply = b""
                while b"\r\n" not in reply.partition(b"\r\n")[2]:
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    reply += chunk
                if reply.endswith(b"+PONG\r\n"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("redis-server did not start:\n" + log.read_text())


class HangingProxy:
    """A TCP proxy on a free port of 127.0.0.1 in front of a Redis server that, once
    :meth:`hang` was called, stops forwarding: a server that no longer answers."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.port = 0
        self.hung = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def hang(self) -> None:
        self.hung = True

    async def _pump(self, source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream) -> None:
        async for chunk in source:
            if self.hung:
                await anyio.sleep_forever()
            await sink.send(chunk)

    async def handle(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            if self.hung:
                await anyio.sleep_forever()
            upstream = await anyio.connect_tcp(*self.upstream)
            async with upstream, anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, upstream)
                await self._pump(upstream, client)
                tg.cancel_scope.cancel()
