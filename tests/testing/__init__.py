"""Tests of stagedconsumer.testing."""
