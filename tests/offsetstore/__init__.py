"""Tests of :mod:`offsetstore`: the shared store suite, the SQL store, the CLI."""
