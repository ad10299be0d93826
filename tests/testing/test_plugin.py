"""The pytest plugin: loaded through its entry point, in a pytest run of its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TEST_FILE = """
from collections.abc import Sequence

import anyio

from stagedconsumer import MemoryBroker, Message, MessageListenerStagedConcurrently
from stagedconsumer.testing import MessageSpec, run_virtual


class Racing(MessageListenerStagedConcurrently):
    def __init__(self):
        self.order = []

    def get_stage_definitions(self) -> Sequence[int]:
        return []

    async def consume_message(self, msgs, context) -> None:
        await anyio.lowlevel.checkpoint()
        self.order.append(msgs[0].queue_offset)


def test_broker(memory_broker, stagedconsumer_seed):
    assert isinstance(memory_broker, MemoryBroker)
    memory_broker.create_topic("t", 1)
    print("SEED", stagedconsumer_seed)


def test_order():
    listener = Racing()
    run_virtual(listener, [MessageSpec(topic="t", queue_id=0) for _ in range(12)])
    print("ORDER", listener.order)
"""


def run_pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_example.py").write_text(TEST_FILE)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def lines(out: str, prefix: str) -> list[str]:
    return re.findall(prefix + r" [^\n]*", out)


def test_the_plugin_is_registered_through_its_entry_point() -> None:
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="pytest11") if e.name == "stagedconsumer"]
    assert entry.value == "_stagedconsumer_pytestplugin"


@pytest.mark.slow
def test_the_seed_option_fixes_the_interleaving_and_is_reported(tmp_path: Path) -> None:
    first = run_pytest(tmp_path, "--stagedconsumer-seed=7")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "stagedconsumer: --stagedconsumer-seed=7" in first.stdout
    assert "SEED 7" in first.stdout
    assert len(lines(first.stdout, "ORDER")) == 1
    again = run_pytest(tmp_path, "--stagedconsumer-seed=7")
    assert lines(again.stdout, "ORDER") == lines(first.stdout, "ORDER")
    orders = {
        tuple(lines(run_pytest(tmp_path, f"--stagedconsumer-seed={seed}").stdout, "ORDER"))
        for seed in range(1, 4)
    }
    assert len(orders) > 1, "every seed gave the same interleaving"


@pytest.mark.slow
def test_without_the_option_the_seed_is_none(tmp_path: Path) -> None:
    result = run_pytest(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SEED None" in result.stdout
    assert "stagedconsumer: --stagedconsumer-seed" not in result.stdout


PROFILE_TEST = """
from hypothesis import Phase, settings


def test_profile():
    print("PROFILE", settings.get_current_profile_name(), settings.default.deadline,
          Phase.explain in settings.default.phases, settings.default.max_examples)
"""


@pytest.mark.slow
def test_the_hypothesis_profile_loads_from_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "test_profile.py").write_text(PROFILE_TEST)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-s",
            "-p",
            "no:cacheprovider",
            "--hypothesis-profile=stagedconsumer",
            "test_profile.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines(result.stdout, "PROFILE") == ["PROFILE stagedconsumer None False 100"]


def test_a_bad_seed_is_a_usage_error(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, "--stagedconsumer-seed=abc")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--stagedconsumer-seed" in result.stderr


def test_the_plugin_imports_no_stagedconsumer_module_when_loaded() -> None:
    # pytest imports entry-point plugins before coverage starts: the plugin must not
    # import the package it would then hide from coverage.
    code = (
        "import sys, _stagedconsumer_pytestplugin\n"
        "print(sorted(m for m in sys.modules if m.startswith(('stagedconsumer', 'hypothesis',"
        " 'trio'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
