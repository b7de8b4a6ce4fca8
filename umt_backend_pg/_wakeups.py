"""Wake-ups: the LISTEN connection, and the work, cancel, ending and stream hints it hands to
waiting workers, `result()` callers and stream followers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from umt_sdk.backend import TaskPair

__all__ = ["Wakeups"]

_log = logging.getLogger("umt.pg")

_LISTEN_CHECK = 10.0
"""Seconds without a notification after which the LISTEN connection is pinged."""
_KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5}
RUN_POLL = 0.05
"""Seconds between reads of a run's state by a `result()` waiter while nothing is listening."""
RUN_POLL_LISTENING = 1.0
"""... and while the LISTEN connection is up: a waiter is woken by the run's ending
notification; this read only covers a notification that was lost (its sender killed between
the ending's commit and the notification)."""
RECENT_ENDINGS = 4_096
"""Ended runs remembered with no waiter yet: a `result()` that read its run just before the
ending and starts waiting just after returns at once. Bounded: a flood of made-up ids only
costs a re-read each."""


class Wakeups:
    """The backend's LISTEN loop and wake-up generations (its own connection, not the pool's).

    A claim records the generation it saw per set of pairs (`claiming`); `wait_for_work`
    returns at once if a work hint came since, else waits for one (or the timeout). Cancel
    hints go to the listeners of `add_cancel_listener`. Ending hints wake `wait_for_run`;
    stream hints (and ending hints) wake `wait_for_stream`.
    `start()` begins listening; without it (`listen=False`), or while the LISTEN connection
    is down, `wait_for_work` only sleeps and `wait_for_run` polls every `RUN_POLL`.
    """

    def __init__(
        self,
        url: str,
        *,
        work_channel: str,
        cancel_channel: str,
        ended_channel: str,
        stream_channel: str,
        queries: Mapping[str, str],
        listen: bool,
    ) -> None:
        self.url = url
        self.work_channel = work_channel
        self.cancel_channel = cancel_channel
        self.ended_channel = ended_channel
        self.stream_channel = stream_channel
        self._q = queries
        self._listen = listen
        self._listener: asyncio.Task[None] | None = None
        self._work_waiters: list[tuple[frozenset[str], asyncio.Future[None]]] = []
        self._notified: dict[str, int] = {}
        self._seen: dict[frozenset[str], int] = {}
        self._wanted: frozenset[str] | None = None
        self._cancel_listeners: list[Callable[[UUID, str], None]] = []
        self._run_waiters: dict[UUID, list[asyncio.Future[None]]] = {}
        self._recent_endings: OrderedDict[UUID, None] = OrderedDict()
        self._stream_waiters: dict[UUID, list[asyncio.Future[None]]] = {}
        self._recent_streams: OrderedDict[UUID, None] = OrderedDict()
        self._listening = False
        self._closed = False

    def start(self) -> None:
        """Start the LISTEN loop (in a task of the running event loop)."""
        self._listener = asyncio.create_task(self._listen_loop(), name="umt-pg-listen")

    # Notifications are hints to look, never facts: any role that can connect to the database
    # can NOTIFY on our channels (no privilege is needed), and a payload can be anything up to
    # 8000 bytes. A work hint wakes a claim (which reads the runs table); a cancel hint makes
    # the worker heartbeat now (which reads the run's stored cancel state). Nothing a payload
    # says is acted on by itself, and a malformed one is dropped.

    async def _listen_loop(self) -> None:
        delay = 0.1
        lost_at: float | None = None
        while not self._closed:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, connect_timeout=10, **_KEEPALIVES
                ) as conn:
                    for channel in (
                        self.work_channel,
                        self.cancel_channel,
                        self.ended_channel,
                        self.stream_channel,
                    ):
                        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    self._listening = True
                    delay = 0.1
                    if lost_at is not None:
                        _log.warning(
                            "LISTEN connection back after %.1f s", time.monotonic() - lost_at
                        )
                        lost_at = None
                    self._wake_all()  # anything sent while we were away
                    while not self._closed:
                        async for note in conn.notifies(timeout=_LISTEN_CHECK):
                            self._on_note(note.channel, note.payload)
                        # Quiet for a while: make sure the connection is still there (a cut
                        # that sent no reset would otherwise leave us deaf for good).
                        await asyncio.wait_for(conn.execute(self._q["ping"]), _LISTEN_CHECK)
            except asyncio.CancelledError:
                self._listening = False
                raise
            except Exception as exc:  # the database went away: reconnect with backoff
                self._listening = False
                self._wake_runs()  # their waiters poll until it is back
                if self._closed:
                    return
                if lost_at is None:
                    lost_at = time.monotonic()
                    _log.warning(
                        "LISTEN connection lost (%s: %s); workers poll until it is back "
                        "(reconnecting with backoff up to 5 s)",
                        type(exc).__name__,
                        exc,
                    )
                else:
                    _log.debug("LISTEN reconnect failed (%s); again in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _on_note(self, channel: str, payload: str) -> None:
        try:
            if channel == self.work_channel:
                self._on_work(payload)
            elif channel == self.cancel_channel:
                self._on_cancel(payload)
            elif channel == self.ended_channel:
                self._on_ended(payload)
            elif channel == self.stream_channel:
                self._on_stream(payload)
        except Exception:  # a bad hint (or a listener's bug) must not cost us the LISTEN
            _log.exception("ignoring a notification on %s that could not be handled", channel)

    def _on_work(self, payload: str) -> None:
        # Only pairs some claim here asked for count: a payload full of made-up names must not
        # grow `_notified` without bound. An empty payload means "look, whatever the pair".
        wanted_pairs = self._wanted_pairs()
        named = payload.split(",") if payload else []
        pairs = {p for p in named if p in wanted_pairs}
        if named and not pairs:
            return  # about pairs nobody here serves
        for pair in pairs or {"*"}:
            self._notified[pair] = self._notified.get(pair, 0) + 1
        remaining = []
        for wanted, future in self._work_waiters:
            if not pairs or wanted & pairs:
                if not future.done():
                    future.set_result(None)
            else:
                remaining.append((wanted, future))
        self._work_waiters = remaining

    def _wanted_pairs(self) -> frozenset[str]:
        if self._wanted is None:
            self._wanted = frozenset().union(*self._seen, *(k for k, _ in self._work_waiters))
        return self._wanted

    def _wake_all(self) -> None:
        for _, future in self._work_waiters:
            if not future.done():
                future.set_result(None)
        self._work_waiters = []
        self._wake_runs()

    def _wake_runs(self) -> None:
        for waiters in (self._run_waiters, self._stream_waiters):
            for futures in waiters.values():
                for future in futures:
                    if not future.done():
                        future.set_result(None)

    def _on_ended(self, payload: str) -> None:
        """`<run id>,<run id>,...`: hints that these runs may have ended."""
        for run_id in _run_ids(payload):
            _wake_or_remember(run_id, self._run_waiters, self._recent_endings)
            _wake_or_remember(run_id, self._stream_waiters, self._recent_streams)

    def _on_stream(self, payload: str) -> None:
        """`<run id>,<run id>,...`: hints that these runs may have new stream entries."""
        for run_id in _run_ids(payload):
            _wake_or_remember(run_id, self._stream_waiters, self._recent_streams)

    async def wait_for_stream(self, run_id: UUID, *, timeout: float) -> None:
        """Return when the run may have a new stream entry or may have ended (its hint came,
        here or since the caller's last read), or after `timeout` seconds, or
        `RUN_POLL(_LISTENING)` seconds, whichever is first."""
        if not self._listening:
            await asyncio.sleep(min(timeout, RUN_POLL))
            return
        if run_id in self._recent_streams:
            del self._recent_streams[run_id]
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._stream_waiters.setdefault(run_id, []).append(future)
        try:
            await asyncio.wait_for(future, min(timeout, RUN_POLL_LISTENING))
        except TimeoutError:
            pass
        finally:
            waiting = [f for f in self._stream_waiters.get(run_id, []) if f is not future]
            if waiting:
                self._stream_waiters[run_id] = waiting
            else:
                self._stream_waiters.pop(run_id, None)

    async def wait_for_run(self, run_id: UUID, *, timeout: float) -> None:
        """Return when the run may have ended (its notification came, here or just before),
        or after `timeout` seconds, or `RUN_POLL(_LISTENING)` seconds, whichever is first."""
        if not self._listening:
            await asyncio.sleep(min(timeout, RUN_POLL))
            return
        if run_id in self._recent_endings:
            del self._recent_endings[run_id]
            return  # it ended (or someone says so) since the caller's read: read again
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._run_waiters.setdefault(run_id, []).append(future)
        try:
            await asyncio.wait_for(future, min(timeout, RUN_POLL_LISTENING))
        except TimeoutError:
            pass
        finally:
            waiting = [f for f in self._run_waiters.get(run_id, []) if f is not future]
            if waiting:
                self._run_waiters[run_id] = waiting
            else:
                self._run_waiters.pop(run_id, None)

    def _on_cancel(self, payload: str) -> None:
        """`<run id>:<reason>`: a hint that the run's cancel may have been requested."""
        run_id_text, _, reason = payload.partition(":")
        if len(run_id_text) != 36:  # the canonical text form; UUID() accepts more shapes
            return
        try:
            run_id = UUID(run_id_text)
        except ValueError:
            return
        for listener in list(self._cancel_listeners):
            try:
                listener(run_id, reason)
            except Exception:
                _log.exception("a cancel listener failed on run %s", run_id)

    def _generation(self, pairs: frozenset[str]) -> int:
        return sum(self._notified.get(p, 0) for p in pairs) + self._notified.get("*", 0)

    def claiming(self, pairs: Sequence[TaskPair]) -> None:
        """A claim of `pairs` is about to read the runs table: it sees every hint so far."""
        keys = frozenset(str(p) for p in pairs)
        if keys not in self._seen:
            self._wanted = None
        self._seen[keys] = self._generation(keys)

    async def wait_for_work(self, *, pairs: Sequence[TaskPair], timeout: float) -> None:
        if not self._listen or self._listener is None:
            await asyncio.sleep(timeout)
            return
        keys = frozenset(str(p) for p in pairs)
        if self._generation(keys) != self._seen.get(keys, -1):
            return  # a notification came since the last claim: claim again now
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not keys <= self._wanted_pairs():
            self._wanted = None
        self._work_waiters.append((keys, future))
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            pass
        finally:
            self._work_waiters = [(k, f) for k, f in self._work_waiters if f is not future]

    def add_cancel_listener(self, listener: Callable[[UUID, str], None]) -> Callable[[], None]:
        self._cancel_listeners.append(listener)

        def remove() -> None:
            if listener in self._cancel_listeners:
                self._cancel_listeners.remove(listener)

        return remove

    async def close(self) -> None:
        """Stop listening and wake every waiting worker."""
        self._closed = True
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
            self._listener = None
        self._wake_all()


def _run_ids(payload: str) -> list[UUID]:
    """The run ids a hint names (`<run id>,<run id>,...`); anything else is dropped."""
    found = []
    for text in payload.split(","):
        if len(text) != 36:  # the canonical text form; UUID() accepts more shapes
            continue
        try:
            found.append(UUID(text))
        except ValueError:
            continue
    return found


def _wake_or_remember(
    run_id: UUID,
    waiters: dict[UUID, list[asyncio.Future[None]]],
    recent: OrderedDict[UUID, None],
) -> None:
    """Wake the run's waiters; with none yet, remember the hint (bounded) for the next one."""
    futures = waiters.get(run_id)
    if futures:
        for future in futures:
            if not future.done():
                future.set_result(None)
        return
    recent[run_id] = None
    recent.move_to_end(run_id)
    if len(recent) > RECENT_ENDINGS:
        recent.popitem(last=False)
