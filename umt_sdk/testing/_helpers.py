from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, Protocol

from umt_sdk import _check as check
from umt_sdk._engine import Engine
from umt_sdk._task import Registry
from umt_sdk._worker import Worker

__all__ = ["BackendHarness", "freeze_heartbeats", "simulate_crash", "thaw_heartbeats"]


def simulate_crash(worker: Worker) -> None:
    """Make `worker` vanish like a SIGKILLed process: its executions stop at their next await
    and write nothing more; their leases are left to expire."""
    _check_worker(worker, "simulate_crash")
    worker._simulate_crash()


def freeze_heartbeats(worker: Worker) -> None:
    """Stop `worker`'s heartbeats (like SIGSTOP for its leases); its handlers keep going."""
    _check_worker(worker, "freeze_heartbeats")
    worker._pause_heartbeats(True)


def thaw_heartbeats(worker: Worker) -> None:
    """Start `worker`'s heartbeats again after `freeze_heartbeats`."""
    _check_worker(worker, "thaw_heartbeats")
    worker._pause_heartbeats(False)


def _check_worker(worker: object, call: str) -> None:
    if not isinstance(worker, Worker):
        check.refuse("worker", "a Worker, such as engine.worker(...)", worker, where=f"{call}()")


class BackendHarness(Protocol):
    """What the contract suite needs from a backend under test."""

    connect: Callable[[Registry], Awaitable[Engine]]
    """Open a fresh, isolated engine on the backend with this registry."""

    async def advance(self, delta: timedelta) -> None:
        """Let `delta` pass on the backend's clock (a FakeClock advance, or a real sleep)."""
        ...

    lease: timedelta
    """A short lease for tests of expiry (about 1 s on real time)."""

    async def business_connection(self) -> Any:
        """A business connection for `with_attempt_token` (a MemoryStore, a psycopg conn)."""
        ...

    async def business_release(self, conn: Any) -> None:
        """Give back a connection from `business_connection`."""
        ...

    async def business_insert(self, tx: Any, key: str, value: str) -> None:
        """Insert a row into the business table inside `tx` (unique on `key`)."""
        ...

    async def business_rows(self) -> dict[str, str]:
        """Every row of the business table. On a backend that implements `TransactionStore`,
        the table is in the engine's own store: a transactional step's `tx` is given to
        `business_insert` too, and its rows are read here."""
        ...
