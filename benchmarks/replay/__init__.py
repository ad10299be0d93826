"""PySpark workload replay: generate, replay, analyse, report."""
