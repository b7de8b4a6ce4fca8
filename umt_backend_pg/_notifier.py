"""The work notifications of this process's enqueues, coalesced.

A transaction that has called NOTIFY takes one lock for the whole server at commit and holds it
through its WAL flush, so notifying transactions commit one at a time and share no flush:
sixteen connections enqueueing at once, each insert notifying in its own statement, spent 90%
of their time waiting on that lock and enqueued half as fast as without the NOTIFY
(`python -m bench.notify_lock`). So an enqueue commits its run without a NOTIFY (a durable
commit like any other, which Postgres flushes in groups), and then waits for a notification
sent after that commit: one transaction at a time per process, naming every pair enqueued since
the last one, committed without waiting for the flush (a notification lost in a crash costs a
poll interval; it carries nothing durable). An enqueue in the caller's transaction
(`enqueue(conn=...)`) still notifies in that transaction, since only its commit makes the run
visible.

A failed notification never fails the enqueue: the run is stored, and idle workers find it at
their next poll.
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
"""Characters of pair names a notification carries at most (Postgres takes under 8,000 bytes)."""


class Notifier:
    """Sends `channel` notifications naming pairs, one transaction at a time, coalesced."""

    def __init__(
        self, pool: AsyncConnectionPool[Any], queries: Mapping[str, str], channel: str
    ) -> None:
        self._pool = pool
        self._q = queries
        self._channel = channel
        self._pairs: set[str] = set()
        self._waiters: list[asyncio.Future[None]] = []
        self._sender: asyncio.Task[None] | None = None

    async def notify(self, pair: str) -> None:
        """Return once a notification naming `pair` was sent after this call (or failed)."""
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pairs.add(pair)
        self._waiters.append(sent)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_all(), name="umt-notifier")
        # The sender outlives a canceled caller: the others waiting on it still need it.
        await asyncio.shield(sent)

    async def close(self) -> None:
        if self._sender is not None:
            with contextlib.suppress(BaseException):
                await self._sender

    async def _send_all(self) -> None:
        while self._waiters:
            pairs, waiters = sorted(self._pairs), self._waiters
            self._pairs, self._waiters = set(), []
            try:
                await self._send(pairs)
            except Exception as exc:
                _log.warning(
                    "umt: could not notify idle workers of new runs (%s); they find them at "
                    "their next poll",
                    str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                )
            finally:
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)

    async def _send(self, pairs: list[str]) -> None:
        payloads: list[str] = []
        for pair in pairs:
            if payloads and len(payloads[-1]) + 1 + len(pair) <= PAYLOAD_LIMIT:
                payloads[-1] += "," + pair
            else:
                payloads.append(pair)
        async with self._pool.connection() as conn:  # autocommit: one statement, one commit
            await conn.execute(
                self._q["notify_enqueued"], {"channel": self._channel, "payloads": payloads}
            )
