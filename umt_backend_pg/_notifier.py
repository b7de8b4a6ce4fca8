"""Notifications of this process's writes, coalesced: work (enqueues) and endings.

A transaction that has called NOTIFY takes one lock for the whole server at commit and holds it
through its WAL flush, so notifying transactions commit one at a time and share no flush:
sixteen connections enqueueing at once, each insert notifying in its own statement, spent 90%
of their time waiting on that lock and enqueued half as fast as without the NOTIFY
(`python -m bench.notify_lock`). So an enqueue commits its run without a NOTIFY (a durable
commit like any other, which Postgres flushes in groups) and returns; the notification follows
in the background: one statement at a time per process and channel, naming every pair enqueued
since the last one, committed without waiting for the flush (a notification lost in a crash,
or with a process that exits without closing its engine, costs a poll interval; it carries
nothing durable). Closing the backend waits for the notifications asked for. An enqueue in the
caller's transaction (`enqueue(conn=...)`) still notifies in that transaction, since only its
commit makes the run visible. The endings of runs (for `result()` waiters, see `_wakeups`) are
sent the same way, naming run ids.

A failed notification never fails the write it follows: what was written is stored, and whoever
waits for it finds it at their next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from psycopg_pool import AsyncConnectionPool

__all__ = ["Notifier"]

_log = logging.getLogger("umt.pg")

PAYLOAD_LIMIT = 7_000
"""Characters of names a notification carries at most (Postgres takes under 8,000 bytes)."""


class Notifier:
    """Sends `channel` notifications naming what was written (pairs, run ids), one transaction
    at a time, coalesced. `what` says in a warning what a lost notification delays."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        queries: Mapping[str, str],
        channel: str,
        *,
        what: str = "idle workers of new runs",
    ) -> None:
        self._pool = pool
        self._q = queries
        self._channel = channel
        self._what = what
        self._names: set[str] = set()
        self._sender: asyncio.Task[None] | None = None

    def notify(self, name: str) -> None:
        """Have a notification naming `name` sent soon, after everything committed so far."""
        self._names.add(name)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_all(), name="umt-notifier")

    async def flush(self) -> None:
        """Return once every notification asked for so far was sent (or failed)."""
        while self._sender is not None and not self._sender.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._sender)

    async def close(self) -> None:
        await self.flush()

    async def _send_all(self) -> None:
        while self._names:
            names = sorted(self._names)
            self._names = set()
            try:
                await self._send(names)
            except Exception as exc:  # any failure: the writes are stored; say it and go on
                _log.warning(
                    "umt: could not notify %s (%s); they find them at their next poll",
                    self._what,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                )

    async def _send(self, names: list[str]) -> None:
        payloads: list[str] = []
        for name in names:
            if payloads and len(payloads[-1]) + 1 + len(name) <= PAYLOAD_LIMIT:
                payloads[-1] += "," + name
            else:
                payloads.append(name)
        async with self._pool.connection() as conn:  # autocommit: one statement, one commit
            await conn.execute(
                self._q["notify_coalesced"], {"channel": self._channel, "payloads": payloads}
            )
