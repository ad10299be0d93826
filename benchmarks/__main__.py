"""``python -m benchmarks``: the PySpark workload replay command (see benchmarks.replay)."""

from __future__ import annotations

import sys

_BENCH_EXTRA = frozenset({"pyspark", "pandas", "pyarrow", "yaml", "matplotlib", "faststream"})
"""Top-level modules of the ``bench`` extra's packages."""


def _run() -> int:
    try:
        from benchmarks.replay.cli import main
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in _BENCH_EXTRA:
            raise
        sys.stderr.write(
            f"error: python -m benchmarks needs the 'bench' extra ({exc.name} is not"
            " installed): pip install 'stagedconsumer[bench]'\n"
        )
        return 1
    return main()


if __name__ == "__main__":
    sys.exit(_run())
