"""A connection that goes silent must not wedge a worker.

A dropped NAT or firewall entry leaves a worker's open connections looking alive: what it
sends is acknowledged, nothing ever comes back, and new connections pass. The test puts a proxy
of its own between a worker and Postgres (TCP in front of the server's unix socket) that can
hold every connection open at that moment that way. The worker must stop the execution whose
lease it can no longer renew (another worker takes the run over), and go on serving new runs
through new connections, instead of waiting forever on the held ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict

from umt_sdk import Engine, Registry, TaskContext, connect, task

pytestmark = pytest.mark.slow

LEASE = timedelta(seconds=2)
STARTED: dict[str, asyncio.Event] = {}


@task("silent.slow", version=1)
async def slow(ctx: TaskContext[str]) -> str:
    async def body() -> str:
        STARTED.setdefault(ctx.input, asyncio.Event()).set()
        await asyncio.sleep(4 * LEASE.total_seconds())
        return "slept"

    return await ctx.step.run("nap", body)


@task("silent.quick", version=1)
async def quick(ctx: TaskContext[str]) -> str:
    return await ctx.step.run("hello", lambda: f"hello {ctx.input}")


REGISTRY = Registry([slow, quick])


class SilentProxy:
    """TCP on 127.0.0.1 in front of a unix socket; `hold()` makes every connection open now
    keep reading (so the sender's data is acknowledged) and never forward again, either way."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.port = 0
        self._held_before = 0
        self._opened = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        self._held_before = self._opened

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._opened += 1
        number = self._opened
        up_reader, up_writer = await asyncio.open_unix_connection(self.socket_path)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    if number <= self._held_before:
                        continue  # taken and dropped: silence, the connection stays open
                    dst.write(data)
                    await dst.drain()
            dst.close()

        both = asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        task = asyncio.ensure_future(both)
        self._tasks.add(task)
        with contextlib.suppress(Exception, asyncio.CancelledError):  # not pytest's failures
            await task


@pytest.fixture
async def proxy(pg_url: str) -> AsyncIterator[SilentProxy]:
    info = conninfo_to_dict(pg_url)
    socket_path = f"{info['host']}/.s.PGSQL.{info.get('port') or 5432}"
    started = SilentProxy(socket_path)
    await started.start()
    try:
        yield started
    finally:
        await started.close()


async def _status(engine: Engine, run_id: Any) -> str:
    return (await engine.get(run_id)).status


async def test_a_silent_connection_does_not_wedge_the_worker(
    proxy: SilentProxy, pg_url: str, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    info = conninfo_to_dict(pg_url)
    through_proxy = (
        f"postgresql://{info.get('user') or 'postgres'}@127.0.0.1:{proxy.port}/"
        f"{info.get('dbname') or 'postgres'}"
    )
    direct = await connect(pg_url, registry=REGISTRY, schema=pg_schema, run_migrations=False)
    wedged = await connect(through_proxy, registry=REGISTRY, schema=pg_schema, run_migrations=False)
    try:
        first = await direct.enqueue(slow, "first")
        async with wedged.worker(lease=LEASE, poll_interval=timedelta(milliseconds=200)) as w:
            await asyncio.wait_for(STARTED.setdefault("first", asyncio.Event()).wait(), 30)
            proxy.hold()  # every connection the worker has open goes silent

            # It stops the execution it cannot renew; another worker takes the run over.
            async with direct.worker(lease=LEASE):
                assert await first.result(timeout=60) == "slept"
            run = await direct.get(first.run_id)
            assert run.executions[0].worker_id == w.worker_id
            assert run.executions[-1].worker_id != w.worker_id
            assert "expired before a heartbeat could renew it" in caplog.text

            # And it serves new runs through new connections.
            second = await direct.enqueue(quick, "again")
            deadline = time.monotonic() + 90
            while await _status(direct, second.run_id) != "completed":
                assert time.monotonic() < deadline, "the worker never served a new run"
                await asyncio.sleep(0.5)
            served = await direct.get(second.run_id)
            assert [e.worker_id for e in served.executions] == [w.worker_id]
    finally:
        await direct.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(wedged.close(), 30)
