"""The report's charts (no Spark: the frames are built here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from benchmarks.replay.report import MODE_COLOURS, write_charts


def chart_colours(
    modes: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, dict[str, str]]:
    """Per chart file, the colour of each mode's bars or line."""
    summary = pd.DataFrame({"mode": modes, "throughput": 10.0, "makespan": 2.0, "bound": 1.0})
    quantiles = pd.DataFrame({"mode": modes, "latency_q": [[0.0, 1.0, 2.0]] * len(modes)})
    seen: dict[str, dict[str, str]] = {}
    save = Figure.savefig

    def savefig(fig: Figure, path: Any, **kwargs: Any) -> None:
        (ax,) = fig.axes
        if ax.get_lines():
            colours = {str(line.get_label()): to_hex(line.get_color()) for line in ax.get_lines()}
        else:
            ticks = [t.get_text() for t in ax.get_xticklabels()]
            bars = ax.patches[: len(ticks)]  # the first (or only) series
            colours = {m: to_hex(b.get_facecolor()) for m, b in zip(ticks, bars, strict=True)}
        seen[Path(path).name] = colours
        save(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    write_charts(summary, quantiles, tmp_path)
    return seen


@pytest.mark.slow
def test_each_mode_has_one_colour_in_every_chart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the throughput chart used to colour by position and the latency chart by
    # matplotlib's cycle, so a mode changed colour between charts and between runs
    for modes in (["staged", "orderly", "concurrent"], ["concurrent", "staged"], ["staged"]):
        charts = chart_colours(modes, tmp_path, monkeypatch)
        assert set(charts) == {"throughput.png", "makespan_vs_bound.png", "latency.png"}
        for colours in charts.values():
            assert colours == {m: MODE_COLOURS[m] for m in modes}
    assert len(set(MODE_COLOURS.values())) == 3
