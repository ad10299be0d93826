"""The layering of the packages (``architecture.md``), checked on the source with ``ast``.

::

    _cli ──> _runtime ──> _sources (ABCs)  ──> _core ──> value modules
                  │   └──> _observability (ABCs/Protocols)
                  └─────────────────────────────────────> offsetstore (public names)

Imports under ``if TYPE_CHECKING:`` count like any other: a cycle there is still a
cycle for a reader.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("stagedconsumer", "offsetstore")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }


MODULES = _modules()


def _resolve(module: str, level: int, name: str | None) -> str:
    """The absolute module named by a (possibly relative) import in ``module``."""
    if level == 0:
        return name or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _imports(module: str) -> Iterator[str]:
    """Every module ``module`` imports (for ``from x import y``: ``x.y`` when that is
    a module of ours, else ``x``)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield sub if sub in MODULES else target


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


GRAPH = {module: sorted({i for i in _imports(module) if _ours(i)}) for module in MODULES}
EXTERNAL = {module: sorted({i for i in _imports(module) if not _ours(i)}) for module in MODULES}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_sees_the_imports() -> None:
    # Guards the checks below against an import walker that finds nothing.
    assert "stagedconsumer._core" in GRAPH["stagedconsumer._runtime._workers"]
    assert "stagedconsumer._core._effects" in GRAPH["stagedconsumer._core._dispatcher"]
    assert "anyio" in EXTERNAL["stagedconsumer._runtime._workers"]


def test_no_import_cycle() -> None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in GRAPH.get(module, []):
            if target not in GRAPH:
                continue
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _in(m, "stagedconsumer._core")))
def test_core_is_sans_io(module: str) -> None:
    forbidden = {"anyio", "trio", "asyncio", "sniffio", "time", "logging", "threading", "socket"}
    used = {name.split(".")[0] for name in EXTERNAL[module]}
    assert not used & forbidden, f"{module} imports {sorted(used & forbidden)}"
    for target in GRAPH[module]:
        for shell in ("_runtime", "_sources", "_observability", "_cli", "_listeners", "_options"):
            assert not _in(target, f"stagedconsumer.{shell}"), f"{module} imports {target}"


# What each layer may import of the others (beside _core, value modules, offsetstore).
ALLOWED = {
    "stagedconsumer._runtime": {
        "stagedconsumer._sources._source",
        "stagedconsumer._sources._group",
        "stagedconsumer._sources._gray",
        "stagedconsumer._sources._selectors",
        "stagedconsumer._sources._pop",
        "stagedconsumer._sources._pop_backends",
        "stagedconsumer._observability._hooks",
        "stagedconsumer._observability._send_hooks",
        "stagedconsumer._observability._view",
    },
    "stagedconsumer._sources": {"stagedconsumer._observability._traceparent"},
    "stagedconsumer._observability": {"stagedconsumer._sources._source"},
}
LAYERS = ("stagedconsumer._runtime", "stagedconsumer._sources", "stagedconsumer._observability")


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layers_import_only_the_interfaces_of_the_others(layer: str) -> None:
    for module in (m for m in MODULES if _in(m, layer)):
        for target in GRAPH[module]:
            if _in(target, "stagedconsumer._cli"):
                pytest.fail(f"{module} imports the CLI ({target})")
            other = next((lay for lay in LAYERS if _in(target, lay)), None)
            if other is None or other == layer:
                continue
            assert target in ALLOWED[layer], f"{module} imports {target}"


def test_offsetstore_knows_nothing_of_stagedconsumer() -> None:
    for module in (m for m in MODULES if _in(m, "offsetstore")):
        assert not [t for t in GRAPH[module] if _in(t, "stagedconsumer")], module


def test_no_module_imports_its_own_package() -> None:
    # A package __init__ imports its modules: importing it back from one is a cycle.
    for module in MODULES:
        for package in PACKAGES:
            if module != package and _in(module, package):
                assert package not in GRAPH[module], f"{module} imports {package}"


def test_import_stagedconsumer_loads_no_optional_or_heavy_dependency() -> None:
    code = (
        "import sys, stagedconsumer\n"
        "heavy = [m for m in ('sqlalchemy', 'redis', 'opentelemetry', 'pyspark', 'rich')\n"
        "         if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    )
    assert out.stdout.strip() == ""
