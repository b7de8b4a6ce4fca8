from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from umt_backend_memory import MemoryStore, MemoryTransaction
from umt_sdk import Engine, Registry, connect
from umt_sdk.testing import BackendContract, FakeClock

pytestmark = pytest.mark.backend("memory")


class MemoryHarness:
    lease = timedelta(seconds=1)

    def __init__(self) -> None:
        self.clock = FakeClock(auto_advance=True)
        self.store = MemoryStore()

    async def connect(self, registry: Registry) -> Engine:
        engine = await connect("memory://", registry=registry, clock=self.clock)
        # The business table lives in the engine's own store: transactional steps write there.
        self.store = engine.backend.store  # type: ignore[attr-defined]  # a MemoryBackend
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


class TestMemoryBackend(BackendContract):
    @pytest.fixture
    def harness(self) -> MemoryHarness:
        return MemoryHarness()
