"""Old vs new CPU time per message: one benchmark of this tree against a base commit.

    python -m benchmarks.compare --base ebeec9a --repeat 5 -- overhead --messages 100000 --repeat 1
    python -m benchmarks.compare --base ebeec9a --repeat 3 \\
        -- redis_e2e --messages 50000 --latency-messages 0 --repeat 1

Everything after ``--`` is a benchmark module of this directory and its options. The
program runs ``python -m benchmarks.MODULE OPTIONS --json FILE`` ``--repeat`` times per
side, alternating old, new, new, old, ..., each run in its own process, and prints per
row of the benchmark (its ``mode`` or ``system``) the median and the range of CPU µs
per message over every sample (each run, and each repeat the run kept under ``runs``
or ``drains``), old and new, and the ratio of the medians new/old. With the 1-minute
load average before the first run and after the last, and the command to reproduce.

One driver, two packages. Both sides run *this* tree's ``benchmarks/`` package, copied
once into a temporary directory that is the working directory and the first entry of
``PYTHONPATH`` of every run; the second entry is the package under test: the base
commit's ``git worktree`` for old, this tree for new. The editable install's path comes
after ``PYTHONPATH`` on ``sys.path``, and before measuring, each side's
``stagedconsumer.__file__`` is checked to lie in its tree. So an option the old tree's
copy of a benchmark lacks is no obstacle, and a change of the driver cannot pass for a
change of the package; the driver must still import against the old package
(``benchmarks.redis_e2e`` falls back to the old module layout for that).

Rows that do not run stagedconsumer (``overhead``'s asyncio baseline, ``redis_e2e``'s
redis-py loop and FastStream) are the same code on both sides: their ratio is the
machine's drift between old and new runs.

The new side is the working tree as it is, uncommitted changes included (the footer
says when there are some). ``--worktree PATH`` keeps the base commit's worktree there
for the next run (created, reused, or moved to the base commit if it has no local
changes); without it a temporary one is made and removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
NAME_KEYS = ("mode", "system")
"""The key naming a row in a benchmark's JSON (``overhead``: mode; ``redis_e2e``: system)."""
RUN_KEYS = ("runs", "drains")
"""The key under which a row keeps its individual repeats, when it has them."""
PACKAGE_PATHS = ("stagedconsumer", "offsetstore")

# -- statistics and the table (pure) ----------------------------------------------------------


def row_name(row: Mapping[str, Any]) -> str:
    for key in NAME_KEYS:
        if key in row:
            return str(row[key])
    raise ValueError(f"a benchmark row names neither of {NAME_KEYS}: {sorted(row)}")


def cpu_samples(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """One run's JSON rows -> CPU µs per message samples by row name: every repeat the
    row kept (under ``runs`` or ``drains``), else the row's own ``cpu_us``."""
    out: dict[str, list[float]] = {}
    for row in rows:
        repeats = next((row[key] for key in RUN_KEYS if key in row), None)
        values = [row["cpu_us"]] if repeats is None else [r["cpu_us"] for r in repeats]
        out.setdefault(row_name(row), []).extend(float(v) for v in values)
    return out


def pool(results: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, list[float]]:
    """The samples of several runs of one side, by row name, in the order rows first appear."""
    out: dict[str, list[float]] = {}
    for rows in results:
        for name, values in cpu_samples(rows).items():
            out.setdefault(name, []).extend(values)
    return out


@attrs.frozen(kw_only=True)
class Summary:
    """Median and range of one row's samples on one side."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        if not samples:
            raise ValueError("no samples")
        return cls(
            median=statistics.median(samples),
            low=min(samples),
            high=max(samples),
            count=len(samples),
        )


@attrs.frozen(kw_only=True)
class Comparison:
    """One row of the table; ``old`` or ``new`` is None when only the other side had it."""

    name: str
    old: Summary | None
    new: Summary | None

    @property
    def ratio(self) -> float | None:
        """new / old of the medians."""
        if self.old is None or self.new is None:
            return None
        return self.new.median / self.old.median


def compare(
    old: Sequence[Sequence[Mapping[str, Any]]], new: Sequence[Sequence[Mapping[str, Any]]]
) -> list[Comparison]:
    """Match old and new rows by name; rows in the new side's order, old-only ones last."""
    old_samples, new_samples = pool(old), pool(new)
    names = list(new_samples) + [name for name in old_samples if name not in new_samples]
    return [
        Comparison(
            name=name,
            old=Summary.of(old_samples[name]) if name in old_samples else None,
            new=Summary.of(new_samples[name]) if name in new_samples else None,
        )
        for name in names
    ]


def _median(summary: Summary | None) -> str:
    return "" if summary is None else f"{summary.median:.2f}"


def _range(summary: Summary | None) -> str:
    return "" if summary is None else f"{summary.low:.2f} to {summary.high:.2f}"


def _ratio(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.3f} ({100 * (ratio - 1):+.1f} %)"


def _count(row: Comparison) -> str:
    counts = [s.count for s in (row.old, row.new) if s is not None]
    return str(counts[0]) if len(set(counts)) == 1 else "/".join(map(str, counts))


def render(rows: Sequence[Comparison], *, title: str) -> Table:
    table = Table(title=title)
    table.add_column("row")
    for column in ("old median", "old range", "new median", "new range", "new/old", "n"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row.name,
            _median(row.old),
            _range(row.old),
            _median(row.new),
            _range(row.new),
            _ratio(row.ratio),
            _count(row),
        )
    return table


def split_argv(argv: Sequence[str]) -> tuple[list[str], str, list[str]]:
    """``[own options] -- MODULE [its options]`` -> (own options, module, its options)."""
    if "--" not in argv:
        raise ValueError("name the benchmark after --, e.g. -- overhead --messages 100000")
    at = list(argv).index("--")
    own, bench = list(argv[:at]), list(argv[at + 1 :])
    if not bench:
        raise ValueError("no benchmark module after --")
    if any(arg == "--json" or arg.startswith("--json=") for arg in bench[1:]):
        raise ValueError("leave --json out of the benchmark's options: compare passes its own")
    return own, bench[0], bench[1:]


# -- running ------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Side:
    """One package under test: ``tree`` holds its ``stagedconsumer/``."""

    label: str
    tree: Path
    describe: str


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def prepare_worktree(commit: str, path: Path) -> None:
    """A ``git worktree`` of ``commit`` at ``path``: made, reused, or moved to ``commit``
    when it has no local changes to tracked files."""
    if not path.exists() or not any(path.iterdir()):
        git(REPO, "worktree", "add", "--detach", "--quiet", str(path), commit)
        return
    top: Path | None = None
    with contextlib.suppress(subprocess.CalledProcessError):
        top = Path(git(path, "rev-parse", "--show-toplevel")).resolve()
    if top != path.resolve():
        raise SystemExit(f"{path} exists and is not the top of a git work tree")
    if git(path, "rev-parse", "HEAD") == commit:
        return
    if git(path, "status", "--porcelain", "--untracked-files=no"):
        raise SystemExit(f"{path} is not at {commit[:10]} and has local changes: left alone")
    git(path, "checkout", "--detach", "--quiet", commit)


def stage_driver(into: Path) -> Path:
    """Copy this tree's ``benchmarks/`` package into ``into``; returns the directory to
    put first on ``sys.path``."""
    shutil.copytree(
        REPO / "benchmarks", into / "benchmarks", ignore=shutil.ignore_patterns("__pycache__")
    )
    return into


def environment(driver: Path, side: Side) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(driver), str(side.tree)])}


_CHECK = (
    "import importlib, json, sys, stagedconsumer;"
    " m = importlib.import_module(sys.argv[1]);"
    " print(json.dumps([stagedconsumer.__file__, m.__file__]))"
)


def check_side(driver: Path, side: Side, module: str) -> None:
    """Import the package and the benchmark as a run will, and check where they come from."""
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, f"benchmarks.{module}"],
        cwd=driver,
        env=environment(driver, side),
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(
            f"{side.label}: this tree's benchmarks.{module} does not import against"
            f" {side.tree}:\n{done.stderr}"
        )
    package, script = (Path(p).resolve() for p in json.loads(done.stdout))
    if not package.is_relative_to(side.tree.resolve()):
        raise SystemExit(f"{side.label}: stagedconsumer comes from {package}, not {side.tree}")
    if not script.is_relative_to(driver.resolve()):
        raise SystemExit(f"{side.label}: benchmarks.{module} comes from {script}, not {driver}")
    print(f"{side.label}: stagedconsumer from {package.parent}, driver {script}", file=sys.stderr)


def run_once(
    driver: Path, side: Side, module: str, args: Sequence[str], out: Path
) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", f"benchmarks.{module}", *args, "--json", str(out)]
    done = subprocess.run(
        command, cwd=driver, env=environment(driver, side), capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(
            f"{side.label}: {shlex.join(command)} failed ({done.returncode}):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    return rows


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def describe_new() -> str:
    head = git(REPO, "log", "-1", "--format=%h")
    dirty = git(REPO, "status", "--porcelain", "--untracked-files=no", "--", *PACKAGE_PATHS)
    return f"{head} (working tree{', with uncommitted changes' if dirty else ''})"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        usage="python -m benchmarks.compare [options] -- MODULE [MODULE OPTIONS]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base", required=True, help="the old commit (any git revision)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per side (default 5)")
    parser.add_argument(
        "--worktree", type=Path, help="keep the base commit's git worktree here (reused)"
    )
    parser.add_argument("--json", type=Path, help="also write the comparison as JSON here")
    if "--" not in argv and any(arg in ("-h", "--help") for arg in argv):
        parser.parse_args(argv)  # prints the help and exits
    try:
        own, module, bench_args = split_argv(argv)
    except ValueError as exc:
        parser.error(str(exc))
    args = parser.parse_args(own)
    if (
        module in ("compare", "__init__", "__main__")
        or not (REPO / "benchmarks" / f"{module}.py").is_file()
    ):
        parser.error(f"no benchmark module benchmarks/{module}.py")
    try:
        commit = git(REPO, "rev-parse", "--verify", f"{args.base}^{{commit}}")
    except subprocess.CalledProcessError:
        parser.error(f"not a commit: {args.base}")

    console = Console(width=max(Console().width, 120))
    with tempfile.TemporaryDirectory(prefix="stagedconsumer-compare-") as tmp_name:
        tmp = Path(tmp_name)
        worktree = args.worktree.absolute() if args.worktree else tmp / "base"
        prepare_worktree(commit, worktree)
        try:
            old = Side(
                label="old",
                tree=worktree,
                describe=_shorten(git(worktree, "log", "-1", "--format=%h %s"), 80),
            )
            new = Side(label="new", tree=REPO, describe=describe_new())
            driver = stage_driver(tmp / "driver")
            for side in (old, new):
                check_side(driver, side, module)
            results: dict[str, list[list[dict[str, Any]]]] = {"old": [], "new": []}
            loads: list[float] = []
            load_before = os.getloadavg()[0]
            for i in range(args.repeat):
                # Interleaved, in ABBA order (old new, new old, ...): a busy spell hits
                # both sides, and a steady drift of the machine cancels out.
                for side in (old, new) if i % 2 == 0 else (new, old):
                    out = tmp / f"{side.label}-{i}.json"
                    rows = run_once(driver, side, module, bench_args, out)
                    results[side.label].append(rows)
                    loads.append(os.getloadavg()[0])
                    summary = ", ".join(
                        f"{name} {statistics.median(values):.2f}"
                        for name, values in cpu_samples(rows).items()
                    )
                    print(
                        f"{side.label} {i + 1}/{args.repeat}: {summary} (CPU µs/msg);"
                        f" load {loads[-1]:.2f}",
                        file=sys.stderr,
                    )
            load_after = os.getloadavg()[0]
        finally:
            if args.worktree is None:
                git(REPO, "worktree", "remove", "--force", str(worktree))

    comparisons = compare(results["old"], results["new"])
    console.print(
        render(
            comparisons,
            title=f"CPU µs per message, benchmarks.{module}: old {commit[:10]} vs new"
            f" {new.describe.split()[0]}, {args.repeat} runs per side, interleaved",
        )
    )
    reproduce = shlex.join(["python", "-m", "benchmarks.compare", *argv])
    console.print(
        f"old: {old.describe}\nnew: {new.describe}\n"
        f"driver: this tree's benchmarks/ for both sides; options: {shlex.join(bench_args)}\n"
        f"python {platform.python_version()}, {os.cpu_count()} CPUs (shared); 1-minute load"
        f" average {load_before:.2f} before, {load_after:.2f} after (after each run:"
        f" {min(loads):.2f} to {max(loads):.2f})\n"
        f"reproduce: {reproduce}",
        soft_wrap=True,
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": reproduce,
                    "module": module,
                    "args": bench_args,
                    "base": commit,
                    "old": old.describe,
                    "new": new.describe,
                    "load_before": load_before,
                    "load_after": load_after,
                    "loads": loads,
                    "rows": [{**attrs.asdict(row), "ratio": row.ratio} for row in comparisons],
                    "results": results,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
