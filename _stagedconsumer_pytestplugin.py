"""The pytest plugin of stagedconsumer.testing (entry point ``pytest11``).

pytest loads it in every environment where stagedconsumer is installed, before
coverage starts (pytest-cov) and whether or not the ``testing`` extra is: so, like
hypothesis's own plugin module, it lives outside the package and imports
stagedconsumer only inside its hooks and fixtures.

- ``--stagedconsumer-seed N``: seeds trio's scheduler in every :func:`run_virtual`
  call that passes no ``seed`` (one interleaving per seed; the seed is shown in
  the report header so a failing run can be repeated). Without it, the scheduler is
  left alone: inside ``@given`` hypothesis seeds it per example.
- ``--hypothesis-profile stagedconsumer`` works: the profile is registered by
  ``stagedconsumer.testing`` (``HYPOTHESIS_PROFILE``), imported here first when the
  option names it.
- ``memory_broker``: a fresh :class:`~stagedconsumer.MemoryBroker` per test.
- ``stagedconsumer_seed``: the seed given on the command line, or ``None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from stagedconsumer import MemoryBroker

__all__ = ("memory_broker", "stagedconsumer_seed")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stagedconsumer", "stagedconsumer.testing")
    group.addoption(
        "--stagedconsumer-seed",
        action="store",
        type=int,
        default=None,
        metavar="N",
        help="seed trio's scheduler in stagedconsumer.testing.run_virtual (one"
        " interleaving per seed); default: leave it to hypothesis",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # tryfirst: the profile must exist before hypothesis's plugin loads the one
    # named by --hypothesis-profile (importing stagedconsumer.testing registers it)
    if config.getoption("--hypothesis-profile", None) == "stagedconsumer":
        import stagedconsumer.testing  # noqa: F401
    seed = config.getoption("stagedconsumer_seed", None)
    if seed is not None:
        from stagedconsumer.testing._virtual import set_default_seed

        set_default_seed(seed)


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.getoption("stagedconsumer_seed", None) is not None:
        from stagedconsumer.testing._virtual import set_default_seed

        set_default_seed(None)


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("stagedconsumer_seed", None)
    return None if seed is None else f"stagedconsumer: --stagedconsumer-seed={seed}"


@pytest.fixture
def memory_broker() -> MemoryBroker:
    """A fresh embedded broker (create your topics on it)."""
    from stagedconsumer import MemoryBroker

    return MemoryBroker()


@pytest.fixture
def stagedconsumer_seed(request: pytest.FixtureRequest) -> int | None:
    """The ``--stagedconsumer-seed`` given, or ``None``."""
    seed: int | None = request.config.getoption("stagedconsumer_seed", None)
    return seed
