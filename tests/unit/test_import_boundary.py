"""Backends use only the public face of the SDK (`umt_sdk`, `umt_sdk.backend`, ...)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKEND_PACKAGES = ["umt_backend_memory", "umt_backend_pg"]


def _is_sdk(module: str) -> bool:
    return module == "umt_sdk" or module.startswith("umt_sdk.")


def _is_private_sdk(module: str) -> bool:
    return _is_sdk(module) and any(part.startswith("_") for part in module.split(".")[1:])


def imported_names(source: str, filename: str = "<source>") -> list[tuple[int, str, str]]:
    """(line, module, how) of every import in `source`, function-local and dynamic ones too
    (`importlib.import_module("x")`). For `from m import a, b`: (m, "from") and (m.a, "name")
    for each name; for `import m`: (m, "import"); relative imports are left out."""
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "import") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, "from"))
            found += [(node.lineno, f"{node.module}.{a.name}", "name") for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value, "dynamic"))
    return found


def _described(filename: str, line: int, module: str, how: str) -> str:
    if how == "name":
        base, _, name = module.rpartition(".")
        return f"{filename}:{line}: from {base} import {name}"
    if how == "from":
        return f"{filename}:{line}: from {module} import ..."
    if how == "dynamic":
        return f"{filename}:{line}: dynamic import of {module}"
    return f"{filename}:{line}: import {module}"


def private_sdk_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every import of a private part of umt_sdk in `source`, as `file:line: what`."""
    found: list[str] = []
    for line, module, how in imported_names(source, filename):
        private = _is_private_sdk(module)
        if how == "name":  # `from umt_sdk[.public] import _private`
            base, _, name = module.rpartition(".")
            private = _is_sdk(base) and not _is_private_sdk(base) and name.startswith("_")
        if private:
            found.append(_described(filename, line, module, how))
    return found


def _backend_files() -> list[Path]:
    return sorted(
        path
        for package in BACKEND_PACKAGES
        if (ROOT / package).is_dir()
        for path in (ROOT / package).rglob("*.py")
    )


def test_the_memory_backend_is_scanned() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _backend_files()}
    assert "umt_backend_memory/_backend.py" in names
    assert "umt_backend_memory/plugin.py" in names


@pytest.mark.parametrize("path", _backend_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_backend_imports_only_public_sdk_names(path: Path) -> None:
    relative = path.relative_to(ROOT).as_posix()
    assert private_sdk_imports(path.read_text(encoding="utf-8"), relative) == []


@pytest.mark.parametrize(
    "source",
    [
        "import umt_sdk._serde",
        "import umt_sdk._spi as spi",
        "from umt_sdk._task import Registry",
        "from umt_sdk import _serde",
        "from umt_sdk.backend import _private",
        "from umt_sdk.testing._helpers import simulate_crash",
        "def f():\n    from umt_sdk._engine import connect",
        "import importlib\nimportlib.import_module('umt_sdk._execution')",
    ],
)
def test_the_checker_catches_private_imports(source: str) -> None:
    assert len(private_sdk_imports(source)) == 1


@pytest.mark.parametrize(
    "source",
    [
        "import umt_sdk",
        "import umt_sdk.backend",
        "from umt_sdk import task, step",
        "from umt_sdk.backend import Backend, hookimpl",
        "from umt_sdk.exceptions import FencingError",
        "from umt_sdk.testing import FakeClock",
        "from . import _store",
        "from ._store import MemoryStore",
        "from umt_backend_memory._store import MemoryStore",
        "import umt_sdk_extra._x",
    ],
)
def test_the_checker_allows_public_imports(source: str) -> None:
    assert private_sdk_imports(source) == []


# -- the other direction: the SDK never imports a backend or a driver ----------------------------

_BELOW_THE_SDK = ("umt_backend_", "psycopg")
"""Module prefixes the SDK may not import: backends come to it through plugins, and drivers
belong to the backends (`umt_backend_pg` brings psycopg; the SDK runs without it)."""


def _is_below(module: str) -> bool:
    return module.startswith(_BELOW_THE_SDK)


def upward_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every import in `source` of a backend package or a database driver, as `file:line: what`
    (function-local and dynamic imports included)."""
    return [
        _described(filename, line, module, how)
        for line, module, how in imported_names(source, filename)
        if how != "name" and _is_below(module)
    ]


def _sdk_files() -> list[Path]:
    return sorted((ROOT / "umt_sdk").rglob("*.py"))


def test_the_cli_is_scanned() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _sdk_files()}
    assert {"umt_sdk/cli/_app.py", "umt_sdk/cli/_commands.py", "umt_sdk/_engine.py"} <= names


@pytest.mark.parametrize("path", _sdk_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_sdk_imports_no_backend_and_no_driver(path: Path) -> None:
    relative = path.relative_to(ROOT).as_posix()
    assert upward_imports(path.read_text(encoding="utf-8"), relative) == []


@pytest.mark.parametrize(
    "source",
    [
        "import psycopg",
        "from psycopg.rows import dict_row",
        "import psycopg_pool",
        "from umt_backend_pg import _embedded",
        "def f():\n    from umt_backend_pg import migrate",
        "import importlib\nimportlib.import_module('umt_backend_memory._store')",
    ],
)
def test_the_checker_catches_upward_imports(source: str) -> None:
    assert len(upward_imports(source)) == 1


@pytest.mark.parametrize(
    "source",
    ["import umt_sdk.cli", "from umt_sdk._plugins import PluginHost", "import click"],
)
def test_the_checker_allows_the_sdk_its_own_imports(source: str) -> None:
    assert upward_imports(source) == []


def test_the_sdk_and_its_cli_import_without_any_backend_or_driver() -> None:
    """In a fresh interpreter where psycopg and the backends cannot be imported, the SDK and
    the `umt` group with its own commands still load (backends add theirs on first use)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith(('psycopg', 'umt_backend_')):\n"
        "            raise ImportError(f'blocked: {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import umt_sdk, umt_sdk.backend, umt_sdk.testing\n"
        "from umt_sdk.cli import cli\n"
        "print(sorted(cli.commands))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('psycopg', 'umt_backend_'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    commands, loaded = done.stdout.strip().splitlines()
    assert "worker" in commands, commands
    assert "enqueue" in commands, commands
    assert loaded == "[]", f"imported below the SDK: {loaded}"


# -- inside the SDK: no circle ------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sdk_import_graph() -> dict[str, set[str]]:
    """module -> the umt_sdk modules it imports anywhere in its text (function-local and
    TYPE_CHECKING imports included: a circle dodged by either is still a circle)."""
    modules = {_module_name(p): p for p in _sdk_files()}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                    ).strip(".")
                # `from umt_sdk import _serde` imports the submodule, not the package's face.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _a_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_sdk_modules_import_each_other_without_a_circle() -> None:
    graph = sdk_import_graph()
    assert "umt_sdk._context" in graph["umt_sdk._task"], "the graph is read"
    circle = _a_circle(graph)
    assert circle is None, " -> ".join(circle or [])


def test_the_circle_finder_finds_one() -> None:
    assert _a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_circle({"a": {"b"}, "b": set()}) is None


def test_the_sdk_and_its_cli_import_without_the_dashboard_extra() -> None:
    """Without Starlette and Jinja2, `umt_sdk` and the `umt` group load (and list
    `dashboard`), and importing `umt_sdk.dashboard` says which extra to install."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('starlette', 'jinja2', 'uvicorn'):\n"
        "            raise ImportError(f'blocked: {name}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import umt_sdk\n"
        "from umt_sdk.cli import cli\n"
        "print('dashboard' in cli.commands)\n"
        "try:\n"
        "    import umt_sdk.dashboard\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    listed, message = done.stdout.strip().splitlines()
    assert listed == "True"
    assert "pip install 'umt-tasks[dashboard]'" in message
