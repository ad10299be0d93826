"""benchmarks.compare's pure parts: samples from both benchmarks' JSON, statistics, table."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from benchmarks.compare import Comparison, Summary, compare, cpu_samples, render, split_argv


def overhead_rows(concurrent: list[float], staged: list[float]) -> list[dict[str, Any]]:
    """``benchmarks.overhead --json``: best-of values, every repeat under ``runs``."""
    return [
        {
            "mode": mode,
            "cpu_us": min(values),
            "runs": [{"cpu_us": v, "rate": 1.0, "seconds": 1.0, "load": 0.5} for v in values],
        }
        for mode, values in (("concurrent", concurrent), ("staged [100]*k", staged))
    ]


def redis_rows(cpu: float) -> list[dict[str, Any]]:
    """``benchmarks.redis_e2e --json``: medians, every drain under ``drains``."""
    return [
        {"system": "stagedconsumer orderly", "cpu_us": cpu, "drains": [{"cpu_us": cpu}]},
        {"system": "floor: XRANGE only", "cpu_us": 1.0},
    ]


def test_samples_are_every_repeat_a_row_kept_else_its_value() -> None:
    assert cpu_samples(overhead_rows([3.0, 2.0], [4.0])) == {
        "concurrent": [3.0, 2.0],
        "staged [100]*k": [4.0],
    }
    assert cpu_samples(redis_rows(7.0)) == {
        "stagedconsumer orderly": [7.0],
        "floor: XRANGE only": [1.0],
    }


def test_a_row_without_a_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="names neither"):
        cpu_samples([{"cpu_us": 1.0}])


def test_median_range_and_ratio_over_all_runs_of_a_side() -> None:
    old = [
        overhead_rows([10.0], [20.0]),
        overhead_rows([12.0], [22.0]),
        overhead_rows([11.0], [21.0]),
    ]
    new = [overhead_rows([11.0, 13.0], [20.0]), overhead_rows([12.0, 14.0], [20.0])]
    rows = {row.name: row for row in compare(old, new)}
    concurrent = rows["concurrent"]
    assert concurrent.old == Summary(median=11.0, low=10.0, high=12.0, count=3)
    assert concurrent.new == Summary(median=12.5, low=11.0, high=14.0, count=4)
    assert concurrent.ratio == pytest.approx(12.5 / 11.0)
    assert rows["staged [100]*k"].ratio == pytest.approx(20.0 / 21.0)


def test_rows_on_one_side_only_have_no_ratio_and_come_last() -> None:
    old = [[{"mode": "gone", "cpu_us": 1.0}, {"mode": "kept", "cpu_us": 2.0}]]
    new = [[{"mode": "kept", "cpu_us": 3.0}, {"mode": "added", "cpu_us": 4.0}]]
    rows = compare(old, new)
    assert [row.name for row in rows] == ["kept", "added", "gone"]
    assert rows[1].old is None
    assert rows[1].ratio is None
    assert rows[2].new is None


def test_summary_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no samples"):
        Summary.of([])


def test_table_shows_medians_ranges_ratio_and_count() -> None:
    row = Comparison(
        name="concurrent",
        old=Summary(median=10.0, low=9.5, high=10.5, count=3),
        new=Summary(median=10.5, low=10.0, high=11.0, count=3),
    )
    console = Console(width=200, record=True)
    console.print(render([row], title="t"))
    text = console.export_text()
    line = next(line for line in text.splitlines() if "concurrent" in line)
    cells = [cell.strip() for cell in line.split("│")[1:-1]]
    assert cells == [
        "concurrent",
        "10.00",
        "9.50 to 10.50",
        "10.50",
        "10.00 to 11.00",
        "1.050 (+5.0 %)",
        "3",
    ]


def test_argv_splits_at_the_double_dash() -> None:
    assert split_argv(["--base", "abc", "--", "overhead", "--messages", "10"]) == (
        ["--base", "abc"],
        "overhead",
        ["--messages", "10"],
    )
    with pytest.raises(ValueError, match="after --"):
        split_argv(["--base", "abc", "overhead"])
    with pytest.raises(ValueError, match="no benchmark"):
        split_argv(["--base", "abc", "--"])
    with pytest.raises(ValueError, match="--json"):
        split_argv(["--", "overhead", "--json", "x.json"])
