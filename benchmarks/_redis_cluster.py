"""A Redis Cluster of one's own on 127.0.0.1, for tests and benchmarks.

``RedisClusterServers(directory).start()`` starts ``masters * (1 + replicas)``
``redis-server --cluster-enabled yes`` processes on free ports (each with its own
cluster bus port, ``cluster-port``), joins them with ``redis-cli --cluster create``,
and waits for ``cluster_state:ok`` and the replicas' first sync; ``stop()`` kills
them all. Needs ``redis-server`` and ``redis-cli`` (7.0 or later) on ``PATH``.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from benchmarks._ports import free_ports

__all__ = ("ClusterNode", "RedisClusterServers", "wait_for_pong")


def wait_for_pong(port: int, log: Path, timeout: float = 10) -> None:
    """Until the redis-server on ``port`` of 127.0.0.1 answers ``PING``; an
    ``AssertionError`` with its log (``log``) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("redis-server did not start:\n" + log.read_text())


class ClusterNode:
    """One ``redis-server`` of the cluster (``proc`` is ``None`` once it was killed)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        """Kill the process (no clean shutdown) if it runs."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class RedisClusterServers:
    """A Redis Cluster of one's own: ``masters`` masters with ``replicas`` replicas
    each (three and one by default), every node a ``redis-server --cluster-enabled
    yes`` on a free port of 127.0.0.1 without persistence, in its own directory
    under ``directory``.

    ``cluster-node-timeout`` is 1 s, so a master that dies is failed over by its
    replica within a few seconds (the default is 15 s).
    """

    NODE_TIMEOUT_MS = 1000

    def __init__(self, directory: Path, masters: int = 3, replicas: int = 1) -> None:
        self.dir = directory
        count = masters * (1 + replicas)
        self.nodes = [ClusterNode(directory / f"node{i}") for i in range(count)]
        self.replicas = replicas
        # Each node's cluster bus gets a free port of its own (``cluster-port``): the
        # default, port + 10000, may be taken or out of range.
        ports = free_ports(2 * len(self.nodes))
        for node, port in zip(self.nodes, ports[: len(self.nodes)], strict=True):
            node.port = port
        self.bus_ports = ports[len(self.nodes) :]

    @property
    def url(self) -> str:
        """A URL of one node (any node gives the client the whole cluster)."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def cli(self, port: int, *args: str, timeout: float = 10) -> str:
        done = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return done.stdout + done.stderr

    def start(self) -> None:
        for node, bus_port in zip(self.nodes, self.bus_ports, strict=True):
            node.dir.mkdir(parents=True, exist_ok=True)
            node.proc = subprocess.Popen(
                [
                    "redis-server",
                    "--port", str(node.port),
                    "--bind", "127.0.0.1",
                    "--dir", str(node.dir),
                    "--cluster-enabled", "yes",
                    "--cluster-port", str(bus_port),
                    "--cluster-config-file", str(node.dir / "nodes.conf"),
                    "--cluster-node-timeout", str(self.NODE_TIMEOUT_MS),
                    "--cluster-replica-validity-factor", "0",
                    "--repl-diskless-sync-delay", "0",
                    "--appendonly", "no",
                    "--save", "",
                    "--logfile", str(node.dir / "redis.log"),
                ],
            )  # fmt: skip
        for node in self.nodes:
            wait_for_pong(node.port, node.dir / "redis.log")
        created = subprocess.run(
            [
                "redis-cli", "--cluster", "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-replicas", str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if created.returncode != 0:
            raise AssertionError(
                f"redis-cli --cluster create failed:\n{created.stdout}{created.stderr}"
            )
        self.wait_ok()

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node reports ``cluster_state:ok`` and agrees on the masters."""
        deadline = time.monotonic() + timeout
        while True:
            live = [node for node in self.nodes if node.proc is not None]
            states = [self.cli(node.port, "cluster", "info") for node in live]
            if all("cluster_state:ok" in state for state in states):
                masters = [self.masters_seen_by(node.port) for node in live]
                if all(m == masters[0] for m in masters) and self._replicas_synced(live):
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster not ok after {timeout} s: {states}")
            time.sleep(0.1)

    def _replicas_synced(self, live: list[ClusterNode]) -> bool:
        """Every live replica finished its sync with its master (a replica that takes
        over before that would come up empty)."""
        for node in live:
            info = self.cli(node.port, "info", "replication")
            if "role:slave" in info and "master_link_status:up" not in info:
                return False
            if "role:slave" in info and "master_sync_in_progress:1" in info:
                return False
        return True

    def masters_seen_by(self, port: int) -> list[int]:
        """The ports of the masters (that are not failed) in ``port``'s view."""
        out = self.cli(port, "cluster", "nodes")
        ports = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) < 3 or "master" not in parts[2] or "fail" in parts[2]:
                continue
            if len(parts) < 9:  # a master without slots
                continue
            ports.append(int(parts[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(ports)

    def masters(self) -> list[ClusterNode]:
        live = next(node for node in self.nodes if node.proc is not None)
        ports = set(self.masters_seen_by(live.port))
        return [node for node in self.nodes if node.port in ports]

    def master_of(self, key: str) -> ClusterNode:
        """The node that serves ``key``'s slot now (``CLUSTER KEYSLOT``, ``CLUSTER NODES``)."""
        return self.master_of_slot(self.keyslot(key))

    def keyslot(self, key: str) -> int:
        """``key``'s hash slot, as the cluster computes it (``CLUSTER KEYSLOT``)."""
        live = next(node for node in self.nodes if node.proc is not None)
        return int(self.cli(live.port, "cluster", "keyslot", key).strip())

    def master_of_slot(self, slot: int) -> ClusterNode:
        live = next(node for node in self.nodes if node.proc is not None)
        for line in self.cli(live.port, "cluster", "nodes").splitlines():
            parts = line.split()
            if len(parts) < 9 or "master" not in parts[2] or "fail" in parts[2]:
                continue
            for span in parts[8:]:
                if span.startswith("["):
                    continue
                lo, _, hi = span.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
                    return next(node for node in self.nodes if node.port == port)
        raise AssertionError(f"no master serves slot {slot}")

    def stop(self) -> None:
        """Kill every node (the test's data is thrown away)."""
        for node in self.nodes:
            node.kill()
