"""Importing :mod:`offsetstore` must not import SQLAlchemy (about half a second).

Each check runs in a fresh interpreter: in the test process SQLAlchemy is long imported.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_importing_offsetstore_does_not_import_sqlalchemy() -> None:
    _run(
        "import sys, offsetstore\n"
        "from offsetstore import MemoryOffsetStore, StageOffsetStore, OffsetStoreError\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'sqlalchemy')\n"
        "assert not loaded, loaded\n"
        "assert 'offsetstore._sql' not in sys.modules\n"
    )


def test_sql_offset_store_still_resolves_on_first_use() -> None:
    _run(
        "import sys, offsetstore\n"
        "from offsetstore import SqlOffsetStore\n"
        "from offsetstore._sql import SqlOffsetStore as Defined\n"
        "assert SqlOffsetStore is Defined is offsetstore.SqlOffsetStore\n"
        "assert 'sqlalchemy' in sys.modules\n"
        "assert 'SqlOffsetStore' in dir(offsetstore)\n"
    )


def test_unknown_attribute_is_still_an_attribute_error() -> None:
    import offsetstore

    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        offsetstore.NoSuchThing  # noqa: B018
