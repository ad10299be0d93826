"""A PostgreSQL server of a test's own: ``initdb`` in a temporary directory, on a free
port of 127.0.0.1, so a test can crash and restart it without touching the shared
service (as ``tests/redis/_server.py`` starts redis-servers of their own).

The binaries come from ``STAGEDCONSUMER_TEST_PG_BIN`` or the newest
``/usr/lib/postgresql/*/bin`` (or ``initdb`` on ``PATH``). PostgreSQL refuses to run
as root: run as root, the server runs as the ``postgres`` user (``runuser``).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from benchmarks._ports import free_port

__all__ = ("PostgresServer", "postgres_binaries")


def postgres_binaries() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl``, or ``None`` when there is none."""
    configured = os.environ.get("STAGEDCONSUMER_TEST_PG_BIN")
    if configured:
        return Path(configured)
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else None


class PostgresServer:
    """``start()``, ``crash()`` (``pg_ctl stop -m immediate``: no shutdown checkpoint,
    connections cut, as a killed server), ``restart()`` and ``stop()``; ``url`` is a
    SQLAlchemy URL for database ``postgres`` as user ``postgres`` (trust auth)."""

    def __init__(self, binaries: Path) -> None:
        self.binaries = binaries
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="stagedconsumer-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self._as: list[str] = []
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self._as, str(self.binaries / tool), *args],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode:
            log = self.log.read_text() if self.log.exists() else ""
            raise AssertionError(f"{tool} {' '.join(args)} failed:\n{done.stderr}\n{log}")

    def start(self) -> None:
        if not self.data.exists():
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-N")
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir}"
            " -c fsync=off -c full_page_writes=off -c max_connections=100"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        engine = sa.create_engine(self.url, connect_args={"connect_timeout": 2})
        try:
            while True:
                try:
                    with engine.connect() as conn:
                        conn.execute(sa.text("SELECT 1"))
                    return
                except sa.exc.OperationalError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        finally:
            engine.dispose()

    def crash(self) -> None:
        """Stop at once, as a crash: open transactions are lost, clients cut off."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def restart(self, down: float = 0.0) -> None:
        """:meth:`crash`, ``down`` seconds down, then :meth:`start` (crash recovery)."""
        self.crash()
        time.sleep(down)
        self.start()

    def stop(self) -> None:
        """Stop (immediately) and delete the data directory."""
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)
