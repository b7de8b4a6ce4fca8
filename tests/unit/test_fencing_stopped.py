"""`with_attempt_token` in an execution that was stopped while its `fn` ran: the result is
not recorded, so the next attempt is told an earlier one began (on the memory backend, whose
ledger would accept it: the crashed lease has not lapsed and no newer attempt has begun)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

from umt_backend_memory import MemoryBackend, MemoryStore
from umt_sdk import AttemptInfo, Registry, TaskContext, connect, task, with_attempt_token
from umt_sdk.testing import FakeClock, simulate_crash

LEASE = timedelta(seconds=5)
STORE = MemoryStore()
CRASHED: list[Any] = []
"""The worker `act` crashes on its first call."""
RESUMED: list[bool] = []
"""`info.resumed` of each call of `act`."""


async def act(info: AttemptInfo) -> str:
    RESUMED.append(info.resumed)
    if len(RESUMED) == 1:
        # The process vanishes while the effect is in flight; `act` returns before the
        # cancel of its execution reaches it.
        simulate_crash(CRASHED[0])
    return "done"


async def fenced_op() -> str:
    return await with_attempt_token(STORE, "op:1", act)


@task("tests.fenced_stopped", version=1)
async def fenced(ctx: TaskContext[None]) -> str:
    return await ctx.step.run("op", fenced_op)


async def test_a_fenced_op_whose_execution_stopped_records_no_result() -> None:
    RESUMED.clear()
    CRASHED.clear()
    clock = FakeClock()
    engine = await connect("memory://", registry=Registry([fenced]), clock=clock)
    try:
        backend = engine.backend
        assert isinstance(backend, MemoryBackend)
        handle = await engine.enqueue(fenced, None)
        crashed = engine.worker(lease=LEASE, poll_interval=timedelta(milliseconds=20))
        CRASHED.append(crashed)
        await crashed.start()
        deadline = time.monotonic() + 5
        while not (RESUMED and crashed.crashed and not crashed.running_runs):
            assert time.monotonic() < deadline, "the crash did not happen"
            await asyncio.sleep(0.005)
        await crashed.stop()
        assert backend.ledger_entries() == {"op:1": None}, "begun, no result recorded"
        clock.advance(LEASE * 2)
        async with engine.worker(lease=LEASE, poll_interval=timedelta(milliseconds=20)):
            assert await handle.result(timeout=5) == "done"
        assert RESUMED == [False, True], "the second attempt calls act, told one began"
        assert backend.ledger_entries() == {"op:1": '"done"'}
    finally:
        await engine.close()
