"""``python -m benchmarks``: the PySpark workload replay command (see benchmarks.replay)."""

from __future__ import annotations

import sys

from benchmarks.replay.cli import main

if __name__ == "__main__":
    sys.exit(main())
