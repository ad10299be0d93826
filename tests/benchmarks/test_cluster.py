"""The replay on a real Spark standalone cluster (master + one worker on 127.0.0.1)
gives the results of the ``local[*]`` run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ROOT = Path(__file__).resolve().parents[2]

WORKLOAD = """\
name: cluster-check
topics: 2
partitionsPerTopic: 2
keyDistributor: KEY_ROUND_ROBIN
keyCount: 8
producerRate: 500
consumerPerSubscription: 2
messagesPerQueue: 40
seed: 3
handlerCost: {distribution: exponential, meanMs: 10}
failures: {probability: 0.1, maxFailures: 2, suspendMillis: 100}
stages:
  definitions: [5, 10]
  strategies: {vip: [3]}
  strategyWeights: {default: 2, vip: 1, none: 1}
  groupBy: key
consumer: {threads: 4, batchSize: 1}
"""

EVENT_KEY = ["mode", "qid", "offset", "attempt"]


def _events(path: Path) -> pd.DataFrame:
    frame = pd.read_parquet(path)
    return frame.sort_values(EVENT_KEY, kind="stable").reset_index(drop=True)


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_standalone_cluster_run_equals_the_local_run(spark: SparkSession, tmp_path: Path) -> None:
    from benchmarks.replay.cli import run_bench
    from benchmarks.replay.cluster import spark_home, standalone_cluster
    from benchmarks.replay.workload import load_workload

    workload = tmp_path / "cluster-check.yaml"
    workload.write_text(WORKLOAD, encoding="utf-8")
    local = run_bench(spark, load_workload(workload), tmp_path / "local", events=True)

    assert (spark_home() / "bin" / "spark-class").exists()
    with standalone_cluster(cores=1, memory="1g") as cluster:
        assert cluster.master_url.startswith("spark://127.0.0.1:")
        assert cluster.alive_workers() == 1
        # a second SparkContext cannot live in this process: the cluster run is the
        # command itself, as a user runs it
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks",
                "bench",
                str(workload),
                "--master",
                cluster.master_url,
                "--out",
                str(tmp_path / "cluster"),
                "--events",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=480,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        master, worker = cluster.master, cluster.worker
    assert master.poll() is not None  # both stopped
    assert worker.poll() is not None
    assert f"reproduce: python -m benchmarks bench {workload}" in done.stdout
    assert "engine core" in done.stdout
    report = (tmp_path / "cluster" / "report.md").read_text(encoding="utf-8")
    assert "spark://127.0.0.1:" in report

    # the same event log, call for call, and the same summary
    pd.testing.assert_frame_equal(
        _events(tmp_path / "cluster" / "events-virtual.parquet"),
        _events(tmp_path / "local" / "events-virtual.parquet"),
        check_exact=True,
    )
    cluster_summary = pd.read_parquet(tmp_path / "cluster" / "summary.parquet")
    local_summary = pd.read_parquet(tmp_path / "local" / "summary.parquet")
    key = ["mode"]
    pd.testing.assert_frame_equal(
        cluster_summary.sort_values(key).reset_index(drop=True),
        local_summary.sort_values(key).reset_index(drop=True),
        check_exact=True,
    )
    assert local.cross_checked == {"virtual": True}


def test_readme_starts_the_cluster_as_the_test_does() -> None:
    from benchmarks.replay import cluster

    text = (ROOT / "docs" / "how-to" / "replay-benchmarks.md").read_text(encoding="utf-8")
    section = text[text.index("**On a Spark standalone cluster.**") :]
    block = section[section.index("```bash") : section.index("```", section.index("```bash") + 7)]
    source = Path(cluster.__file__).read_text(encoding="utf-8")
    for needed in (
        "import pyspark, os; print(os.path.dirname(pyspark.__file__))",
        "$SPARK_HOME/bin/spark-class org.apache.spark.deploy.master.Master",
        "--host 127.0.0.1 --port 7077 --webui-port 8080",
        "$SPARK_HOME/bin/spark-class org.apache.spark.deploy.worker.Worker spark://127.0.0.1:7077",
        "--master spark://127.0.0.1:7077",
    ):
        assert needed in block.replace("\\\n    ", ""), needed
    for launched in (
        "org.apache.spark.deploy.master.Master",
        "org.apache.spark.deploy.worker.Worker",
        '"--host", "127.0.0.1"',
    ):
        assert launched in source
