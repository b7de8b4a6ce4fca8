"""The example third-party backend (examples/08_third_party_backend) passes the contract suite.

This is how a backend author tests a backend: subclass `umt_sdk.testing.BackendContract` and
give it a `harness` fixture (a `BackendHarness`: connect a fresh engine, let time pass, a short
lease, and business connections for `with_attempt_token`). The plugin is loaded from its file
and passed with `connect(..., plugins=[...])`, as an installed package would be found through
its `umt` entry point.
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
import uuid
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from umt_backend_memory import MemoryStore, MemoryTransaction
from umt_sdk import Engine, Registry, connect
from umt_sdk.testing import BackendContract, FakeClock

PACKAGE = Path(__file__).resolve().parents[2] / "examples" / "08_third_party_backend"


def _load_plugin() -> ModuleType:
    """Import umt_dict_backend.py from the example directory (it is not installed)."""
    spec = importlib.util.spec_from_file_location(
        "umt_dict_backend", PACKAGE / "umt_dict_backend.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = sys.modules.get("umt_dict_backend") or importlib.util.module_from_spec(spec)
    if "umt_dict_backend" not in sys.modules:
        sys.modules["umt_dict_backend"] = module
        spec.loader.exec_module(module)
    return module


plugin = _load_plugin()


class DictHarness:
    """The contract suite's view of `dict://`: a virtual clock and a fresh store per test."""

    lease = timedelta(seconds=1)

    def __init__(self) -> None:
        self.clock = FakeClock(auto_advance=True)
        self.store = MemoryStore()  # dict:// delegates to the memory backend's ledger
        self.url = f"dict://contract-{uuid.uuid4().hex[:8]}"

    async def connect(self, registry: Registry) -> Engine:
        engine = await connect(self.url, registry=registry, clock=self.clock, plugins=[plugin])
        # dict:// forwards transactional steps to the memory backend, whose own store they
        # write: the business table lives there.
        self.store = engine.backend.store  # type: ignore[attr-defined]  # the dict backend, typed as Backend
        return engine

    async def advance(self, delta: timedelta) -> None:
        self.clock.advance(delta)

    async def business_connection(self) -> Any:
        return self.store

    async def business_release(self, conn: Any) -> None:
        del conn

    async def business_insert(self, tx: Any, key: str, value: str) -> None:
        assert isinstance(tx, MemoryTransaction)
        tx.insert("receipts", key, value)

    async def business_rows(self) -> dict[str, str]:
        return self.store.rows("receipts")


class TestDictBackend(BackendContract):
    @pytest.fixture
    def harness(self) -> DictHarness:
        return DictHarness()


def test_the_package_declares_its_plugin_in_the_umt_group() -> None:
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["umt"] == {"dict": "umt_dict_backend"}
    assert plugin.umt_backend_schemes() == ["dict"]
    assert plugin.umt_open_backend(url="memory://", clock=None, options={}) is None


async def test_one_name_is_one_store_until_its_last_handle_closes() -> None:
    registry = Registry()
    url = f"dict://shared-{uuid.uuid4().hex[:8]}"
    first = await connect(url, registry=registry, plugins=[plugin])
    second = await connect(url, registry=registry, plugins=[plugin])
    assert first.backend._inner is second.backend._inner  # type: ignore[attr-defined]
    await first.close()
    await first.close()  # closing twice releases one handle only
    third = await connect(url, registry=registry, plugins=[plugin])
    assert third.backend._inner is second.backend._inner  # type: ignore[attr-defined]
    await second.close()
    await third.close()
    fresh = await connect(url, registry=registry, plugins=[plugin])
    assert fresh.backend._inner is not second.backend._inner  # type: ignore[attr-defined]
    await fresh.close()
    with pytest.raises(TypeError, match="no options"):
        await connect(url, registry=registry, plugins=[plugin], schema="x")
