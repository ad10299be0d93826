"""Tests of :mod:`offsetstore`.

``offsetstore`` imports ``stagedconsumer._core`` (for ``StageKey``), and
``stagedconsumer`` imports ``offsetstore``: importing ``offsetstore`` first in a fresh
process fails on that cycle, so this package imports ``stagedconsumer`` first.
"""

import stagedconsumer  # noqa: F401
