"""Benchmark programs for stagedconsumer (not part of the installed package).

``python -m benchmarks bench WORKLOAD.yaml`` replays a workload in PySpark
(see :mod:`benchmarks.replay`); the other modules here are standalone scripts.
PySpark is imported only under this package.
"""
