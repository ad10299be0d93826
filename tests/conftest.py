"""Shared test configuration.

- async tests run on both anyio backends (asyncio and trio);
- hypothesis profiles: ``dev`` (default), ``ci`` (when ``CI`` is set: more examples,
  no deadline, derandomized so a red CI run is reproducible);
- ``service_url`` fixtures for PostgreSQL, MariaDB and Redis live next to the tests
  that use them; with ``CI`` set they fail instead of skipping when a service is down.
"""

from __future__ import annotations

import os
import resource

import pytest
from hypothesis import HealthCheck, settings

IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")

settings.register_profile(
    "dev",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=120,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if IN_CI else "dev"))


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


def require_service(name: str, reachable: bool, detail: str) -> None:
    """Skip when a service is down locally; fail in CI, where it must be up."""
    if reachable:
        return
    message = f"{name} is not reachable ({detail})"
    if IN_CI:
        pytest.fail(message + "; CI must run it (.ci/run starts it)")
    pytest.skip(message)


UNMARKED_SLOW_SECONDS = 3.0
"""A test not marked ``slow`` that takes longer is named in the run's summary."""

_unmarked_slow: list[tuple[float, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.duration > UNMARKED_SLOW_SECONDS and "slow" not in report.keywords:
        _unmarked_slow.append((report.duration, f"{report.when} {report.nodeid}"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The CPU time of the run beside its wall time (what is left is waiting: sleeps,
    timeouts, services, or other programs sharing the machine), and the tests that
    the fast tier (``-m "not slow"``) should leave out."""
    if _unmarked_slow:
        terminalreporter.write_line(
            f"{len(_unmarked_slow)} test phase(s) not marked slow took over "
            f"{UNMARKED_SLOW_SECONDS:g} s (mark them @pytest.mark.slow if an idle "
            "machine agrees):"
        )
        for seconds, what in sorted(_unmarked_slow, reverse=True)[:10]:
            terminalreporter.write_line(f"  {seconds:6.1f} s  {what}")
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    terminalreporter.write_line(
        f"CPU time: {own.ru_utime + own.ru_stime:.0f} s in the test process, "
        f"{children.ru_utime + children.ru_stime:.0f} s in the processes it started"
    )
