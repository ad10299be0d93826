"""The documentation site: it builds strictly (no broken link, anchor or reference),
every Python example of it and of the README runs as written, what the pages show
of the demo is what the demo prints, and every public name is in the reference."""

from __future__ import annotations

import importlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from tests._docs import DOCS, ROOT, markdown_files, page, python_blocks

SKIP = re.compile(r"^# docs: skip \((.+)\)$", re.M)
PUBLIC_MODULES = (
    "stagedconsumer",
    "stagedconsumer.testing",
    "stagedconsumer.blocking",
    "stagedconsumer.otel",
    "offsetstore",
)


def _examples() -> list[Any]:  # pytest.param values
    params = []
    for path in markdown_files():
        for number, (heading, code) in enumerate(python_blocks(path), start=1):
            name = f"{path.relative_to(ROOT)}#{number}"
            marks = [pytest.mark.skip(reason=m.group(1))] if (m := SKIP.search(code)) else []
            params.append(pytest.param(heading, code, id=name, marks=marks))
    return params


def _mkdocs(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)},
    )


# -- the site builds ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_site_builds_strictly_and_needs_nothing_online(tmp_path: Path) -> None:
    result = _mkdocs("build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr[-5000:]
    assert "WARNING" not in result.stderr, result.stderr[-5000:]
    html = {p: p.read_text(encoding="utf-8") for p in (tmp_path / "site").rglob("*.html")}
    # the reference was generated from the code, and every command's help is in it
    consumer = html[tmp_path / "site" / "reference" / "api" / "consumer" / "index.html"]
    assert 'id="stagedconsumer.PushConsumer.seek"' in consumer
    cli = html[tmp_path / "site" / "reference" / "cli" / "index.html"]
    assert "usage: stagedconsumer offsets reset" in cli
    # no fonts, scripts or styles from a CDN: the site reads offline
    for path, text in html.items():
        found = re.search(r"(?:src|href)=\"https?://(fonts\.googleapis|unpkg|cdn)[^\"]*\"", text)
        assert found is None, f"{path}: {found.group(0)}"


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The checks of mkdocs.yml (strict, validation) turn a link to a missing page or
    to a missing heading into a failed build."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(
        "# Home\n\n[1](no-such-page.md), [2](other.md#no-such-heading)\n"
    )
    (docs / "other.md").write_text("# Other\n\n## A heading\n")
    small = {
        "site_name": "check",
        "docs_dir": str(docs),
        "strict": config["strict"],
        "validation": config["validation"],
        "markdown_extensions": config["markdown_extensions"],
        "theme": {"name": "mkdocs"},  # the checks are independent of the theme
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(small))
    result = _mkdocs("build", "--site-dir", str(tmp_path / "site"), cwd=tmp_path)
    assert result.returncode != 0
    assert "no-such-page.md" in result.stderr
    assert "no-such-heading" in result.stderr
    # and the same site with the links fixed builds: the failure was the links
    (docs / "index.md").write_text("# Home\n\n[1](other.md), [2](other.md#a-heading)\n")
    fixed = _mkdocs("build", "--site-dir", str(tmp_path / "site"), cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr


def test_every_public_name_is_in_the_reference() -> None:
    directives = {
        match.group(1)
        for path in (DOCS / "reference").rglob("*.md")
        for match in re.finditer(r"^::: ([\w.]+)$", path.read_text(), re.M)
    }
    missing = [
        f"{module}.{name}"
        for module in PUBLIC_MODULES
        for name in importlib.import_module(module).__all__
        if f"{module}.{name}" not in directives
    ]
    assert missing == []
    # and nothing else: a name the reference renders is public
    public = {f"{m}.{n}" for m in PUBLIC_MODULES for n in importlib.import_module(m).__all__}
    assert directives - public == set()


def _griffe_objects() -> dict[str, Any]:
    """Every public name of the five modules as the reference sees it (griffe, static)."""
    import griffe

    loader = griffe.GriffeLoader(search_paths=[str(ROOT)])
    roots = {name: loader.load(name) for name in ("stagedconsumer", "offsetstore")}
    loader.resolve_aliases(implicit=False, external=None)
    found = {}
    for module in PUBLIC_MODULES:
        top, _, sub = module.partition(".")
        static = roots[top][sub] if sub else roots[top]
        for name in importlib.import_module(module).__all__:
            obj = static[name]
            found[f"{module}.{name}"] = obj.final_target if obj.is_alias else obj
    return found


@pytest.mark.slow
def test_every_public_name_has_a_docstring() -> None:
    undocumented = [name for name, obj in _griffe_objects().items() if not obj.docstring]
    assert undocumented == []


FULLY_DOCUMENTED = (
    "stagedconsumer.PushConsumer",
    "stagedconsumer.Producer",
    "stagedconsumer.Message",
    "stagedconsumer.MessageQueue",
    "stagedconsumer.SendResult",
    "stagedconsumer.SendStatus",
    "stagedconsumer.ConsumeConcurrentlyContext",
    "stagedconsumer.ConsumeOrderlyContext",
    "stagedconsumer.ConsumeStagedConcurrentlyContext",
    "stagedconsumer.ConsumeConcurrentlyStatus",
    "stagedconsumer.ConsumeOrderlyStatus",
    "stagedconsumer.ConsumerOptions",
    "stagedconsumer.ConsumerStatistics",
    "stagedconsumer.ProcessQueueStatistics",
    "stagedconsumer.PullResult",
    "stagedconsumer.ConsumeMessageContext",
    "stagedconsumer.testing.HandlerCall",
    "stagedconsumer.testing.MessageSpec",
    "stagedconsumer.SourceError",
    "offsetstore.StageKey",
    "offsetstore.QueueProgress",
    "offsetstore.OffsetStoreError",
    "offsetstore.StoreFencedError",
)


@pytest.mark.slow
def test_the_classes_users_touch_most_document_every_member() -> None:
    objects = _griffe_objects()
    undocumented = [
        f"{name}.{member}"
        for name in FULLY_DOCUMENTED
        for member, obj in objects[name].members.items()
        if not member.startswith("_") and not (obj.final_target if obj.is_alias else obj).docstring
    ]
    assert undocumented == []


def test_every_page_is_in_the_navigation() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r"([\w/-]+\.md)$", config, re.M))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages - listed == set()


# -- the examples run -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("heading", "code"), _examples())
def test_example_runs(heading: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, f"{heading}: {result.stderr}"


def test_a_skipped_example_says_why() -> None:
    for path in markdown_files():
        for heading, code in python_blocks(path):
            if "docs: skip" in code or "readme: skip" in code:
                assert SKIP.search(code), f"{path.name}, {heading}: '# docs: skip (reason)'"


def test_the_tutorial_shows_what_its_first_example_prints(tmp_path: Path) -> None:
    text = page("tutorial.md")
    section = text[text.index("## A staged consumer on the embedded broker") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    shown = re.search(r"```text\n(.*?)```", section, re.S)
    assert code is not None
    assert shown is not None
    script = tmp_path / "rewards.py"
    script.write_text(code.group(1))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    lines = [line for line in shown.group(1).splitlines() if line != "..."]
    # the lines shown are printed, in that order (the elided ones in between)
    positions = [printed.index(line) for line in lines]
    assert positions == sorted(positions)
    assert lines[0] == printed[0]
    assert lines[-1] == printed[-1]


def _wall_time_free(text: str) -> list[str]:
    """Lines without trailing spaces, the wall time (the one varying number) masked."""
    return [
        re.sub(r"\d+\.\d\d s of wall time", "N s of wall time", line.rstrip())
        for line in text.strip().splitlines()
    ]


@pytest.mark.parametrize("command", ["demo --virtual", "demo --keys 10 --virtual"])
def test_the_demo_output_shown_is_what_the_command_prints(command: str) -> None:
    pytest.importorskip("trio")
    text = page("tutorial.md")
    block = re.search(rf"```text\n\$ stagedconsumer {command}\n(.*?)```", text, re.S)
    assert block is not None
    result = subprocess.run(
        [sys.executable, "-m", "stagedconsumer", *command.split()],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert _wall_time_free(block.group(1)) == _wall_time_free(result.stdout)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.postgres
def test_the_consumer_group_members_keep_running_and_split_the_queues(
    tmp_path: Path,
) -> None:
    """Two members started with --keep-running (the tutorial's group over Redis) share
    the 8 queues 4/4, print their queues when they change, and end quietly on Ctrl-C."""
    code = next(code for _, code in python_blocks(DOCS / "tutorial.md") if "--keep-running" in code)
    # A namespace and group of this run's own: another run of the suite on this
    # machine would otherwise join the group and take a share of the queues.
    unique = f"readme-{uuid.uuid4().hex[:8]}"
    for fixed in ('namespace="shop"', 'PushConsumer("rewards"'):
        assert fixed in code, fixed
    code = code.replace('namespace="shop"', f'namespace="{unique}"')
    code = code.replace('PushConsumer("rewards"', f'PushConsumer("{unique}"')
    script = tmp_path / "rewards.py"
    script.write_text(code)

    files = []

    def start(name: str) -> tuple[subprocess.Popen[str], Path]:
        log = tmp_path / f"{name}.log"
        files.append(log.open("w"))
        process = subprocess.Popen(
            [sys.executable, "-u", str(script), "--keep-running"],
            stdout=files[-1],
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        return process, log

    def queues(log: Path) -> set[str] | None:
        lines = [line for line in log.read_text().splitlines() if line.startswith("this member's")]
        if not lines:
            return None
        listed = lines[-1].partition(": ")[2]
        return set() if listed == "none" else set(listed.split(", "))

    members = [start("a"), start("b")]
    try:
        deadline = time.monotonic() + 90
        while True:
            seen = [queues(log) for _, log in members]
            if all(s is not None and len(s) == 4 for s in seen):
                break
            assert time.monotonic() < deadline, f"no 4/4 split: {seen}"
            assert all(p.poll() is None for p, _ in members), "a member exited"
            time.sleep(0.5)
        a, b = seen
        assert a is not None
        assert b is not None
        assert a | b == {f"orders#{q}" for q in range(8)}
        for process, _ in members:
            process.send_signal(signal.SIGINT)
        for process, log in members:
            assert process.wait(timeout=60) == 0, log.read_text()[-2000:]
            out = log.read_text()
            assert "stopped: progress committed" in out
            assert "Traceback" not in out
    finally:
        for process, _ in members:
            if process.poll() is None:
                process.kill()
                process.wait()
        for file in files:
            file.close()
        client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
        for key in client.scan_iter(f"{unique}:*"):
            client.delete(key)
        client.close()


# -- tables ---------------------------------------------------------------------------------


def test_every_table_ends_before_the_next_block() -> None:
    for path in markdown_files():
        lines = path.read_text().splitlines()
        for number, (line, following) in enumerate(itertools.pairwise(lines), start=1):
            if line.startswith("|"):
                assert following.startswith("|") or not following.strip(), (
                    f"{path.relative_to(ROOT)}:{number + 1}: a table runs into {following!r}"
                )


def test_the_memory_table_has_the_columns_the_command_prints() -> None:
    from benchmarks.memory import COLUMNS

    header = next(
        line
        for line in page("performance.md").splitlines()
        if line.startswith("| `python -m benchmarks.memory`")
    )
    cells = [cell.strip() for cell in header.strip("|").split("|")]
    assert cells[1:] == list(COLUMNS[1:])


@pytest.mark.parametrize("name", ["ConsumerOptions", "ProducerOptions", "GroupOptions"])
def test_the_options_tables_list_every_option(name: str) -> None:
    import attrs

    import stagedconsumer

    text = page("reference/options.md")
    start = text.index(f"## `{name}`")
    table = text[start : text.index("\n## ", start + 1)]
    listed = re.findall(r"^\| `(\w+)` \|", table, re.M)
    fields = [f.name for f in attrs.fields(getattr(stagedconsumer, name))]
    assert sorted(listed) == sorted(fields)
