"""Backends use only the public face of the SDK (`umt_sdk`, `umt_sdk.backend`, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKEND_PACKAGES = ["umt_backend_memory", "umt_backend_pg"]


def _is_sdk(module: str) -> bool:
    return module == "umt_sdk" or module.startswith("umt_sdk.")


def _is_private_sdk(module: str) -> bool:
    return _is_sdk(module) and any(part.startswith("_") for part in module.split(".")[1:])


def private_sdk_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every import of a private part of umt_sdk in `source`, as `file:line: what`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [
                f"{filename}:{node.lineno}: import {alias.name}"
                for alias in node.names
                if _is_private_sdk(alias.name)
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _is_private_sdk(node.module):
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
            elif _is_sdk(node.module):
                found += [
                    f"{filename}:{node.lineno}: from {node.module} import {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                ]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and _is_private_sdk(node.args[0].value)
        ):
            found.append(f"{filename}:{node.lineno}: dynamic import of {node.args[0].value}")
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
