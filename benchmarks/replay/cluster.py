"""A Spark standalone cluster on this machine: one master, one worker, loopback only.

Started from the launcher that the ``pyspark`` package ships
(``$SPARK_HOME/bin/spark-class``, ``SPARK_HOME`` being the installed package's
directory), exactly as the instructions of docs/how-to/replay-benchmarks.md do by hand::

    $SPARK_HOME/bin/spark-class org.apache.spark.deploy.master.Master \\
        --host 127.0.0.1 --port PORT --webui-port UI_PORT
    $SPARK_HOME/bin/spark-class org.apache.spark.deploy.worker.Worker \\
        spark://127.0.0.1:PORT --host 127.0.0.1 --webui-port UI_PORT2 --cores N --memory M

Used by the cluster test (``tests/benchmarks/test_cluster.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import attrs

from benchmarks._ports import free_ports

__all__ = ("Cluster", "spark_home", "standalone_cluster")


def spark_home() -> Path:
    """The installed ``pyspark`` package's directory (it holds ``bin/spark-class``)."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


@attrs.frozen
class Cluster:
    master_url: str
    """``spark://127.0.0.1:PORT``: pass it as ``--master``."""
    ui_url: str
    """The master's web UI (``/json`` lists the workers)."""
    master: subprocess.Popen[bytes]
    worker: subprocess.Popen[bytes]
    logs: Path

    def alive_workers(self) -> int:
        with urllib.request.urlopen(f"{self.ui_url}/json", timeout=5) as answer:
            state = json.load(answer)
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def standalone_cluster(
    *, cores: int = 1, memory: str = "1g", timeout: float = 120.0
) -> Iterator[Cluster]:
    """Start a master and one worker on 127.0.0.1, wait until the worker is
    registered, yield the cluster, and stop both processes."""
    home = spark_home()
    launcher = home / "bin" / "spark-class"
    logs = Path(tempfile.mkdtemp(prefix="spark-standalone-"))
    env = dict(
        os.environ,
        SPARK_HOME=str(home),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_WORKER_DIR=str(logs / "work"),
    )
    port, ui, worker_ui = free_ports(3)
    master_url = f"spark://127.0.0.1:{port}"
    master_command = [
        str(launcher), "org.apache.spark.deploy.master.Master",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--webui-port", str(ui),
    ]  # fmt: skip
    worker_command = [
        str(launcher), "org.apache.spark.deploy.worker.Worker", master_url,
        "--host", "127.0.0.1",
        "--webui-port", str(worker_ui),
        "--cores", str(cores),
        "--memory", memory,
    ]  # fmt: skip
    with (logs / "master.log").open("wb") as out:
        master = subprocess.Popen(
            master_command,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    worker: subprocess.Popen[bytes] | None = None
    try:
        with (logs / "worker.log").open("wb") as out:
            worker = subprocess.Popen(
                worker_command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        cluster = Cluster(master_url, f"http://127.0.0.1:{ui}", master, worker, logs)
        deadline = time.monotonic() + timeout
        while True:
            for process, name in ((master, "master"), (worker, "worker")):
                if process.poll() is not None:
                    raise RuntimeError(
                        f"the Spark {name} exited ({process.returncode}); see {logs}/{name}.log"
                    )
            with contextlib.suppress(OSError, ValueError):
                if cluster.alive_workers() >= 1:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Spark worker registered in {timeout:.0f} s; see {logs}")
            time.sleep(0.5)
        yield cluster
    finally:
        if worker is not None:
            _stop(worker)
        _stop(master)
