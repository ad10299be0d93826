"""One shared local SparkSession for the replay tests (2 cores, 2 shuffle partitions)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    pytest.importorskip("pyspark")
    from benchmarks.replay.spark import get_session, ship_code

    session = get_session(
        "local[2]", app_name="stagedconsumer-tests", shuffle_partitions=2, driver_memory="1g"
    )
    ship_code(session)
    yield session
    session.stop()
