"""Logging of ``stagedconsumer run``: configured once, through standard :mod:`logging`.

``text`` is one human line per record; ``json`` one JSON object per line, whose keys
are the record's standard fields (``time``, ``level``, ``logger``, ``message``,
``process``, ``worker``) and every field a log call passed in ``extra=`` (the run's own
records carry ``group``, ``client_id``, ``signal`` and the like), plus ``exception``
with the traceback of a record logged with one.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from typing import Any, Literal

__all__ = ("LOG_FORMATS", "JsonFormatter", "configure_logging")

LOG_FORMATS = ("text", "json")

WORKER_ENV = "STAGEDCONSUMER_RUN_WORKER"
"""The index of a worker process started by ``--workers`` (absent in a single process)."""

# The attributes every LogRecord has: whatever else a record carries came from ``extra=``.
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages are escaped)."""

    def __init__(self, worker: str | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        if self.worker is not None:
            entry["worker"] = int(self.worker)
        entry.update(
            (key, value)
            for key, value in record.__dict__.items()
            if key not in _STANDARD and not key.startswith("_")
        )
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure_logging(level: str, fmt: Literal["text", "json"]) -> None:
    """Point the root logger at standard error with ``fmt``, at ``level``.

    Replaces what was configured before (the command's default set-up), so records
    are written once; the library's loggers (``stagedconsumer.*``) are left as they
    are, propagating to the root.
    """
    worker = os.environ.get(WORKER_ENV)
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        prefix = f"[worker {worker}] " if worker is not None else ""
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s %(name)s: {prefix}%(message)s")
        )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
