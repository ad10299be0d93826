"""``MessageSource.trace_writer``: the optional synchronous trace path of a source, and
that message trace reaches sources only through that ABC."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import stagedconsumer
from stagedconsumer import MemoryBroker, Message, MessageSource


def test_a_source_has_no_trace_writer_by_default() -> None:
    assert MessageSource.trace_writer(MemoryBroker()) is None


def test_the_embedded_broker_writes_trace_through_send_trace() -> None:
    broker = MemoryBroker()
    assert broker.trace_writer() == broker.send_trace


def test_a_broker_whose_send_was_changed_has_its_trace_sent_through_it() -> None:
    class Changed(MemoryBroker):
        def send(self, topic: str, body: bytes, **kwargs: Any) -> Message:
            return super().send(topic, body, **kwargs)

    assert Changed().trace_writer() is None


def test_message_trace_imports_no_concrete_source() -> None:
    package = Path(stagedconsumer.__file__).parent / "_observability"
    modules = sorted(package.glob("_trace*.py"))
    assert modules
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and "_sources" in node.module:
                assert node.module == "_sources._source", (path.name, node.module)
