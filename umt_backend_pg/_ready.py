"""The claim's clocks: when to read the timers and from where, when to rotate the `ready` queue,
and when to sweep it.

Runs claimable at once are in `ready` and every claim reads it. Runs whose timer comes (a
sleep's end, a wait's timeout, an expired lease) are found through `runs_claim_timers`, an
index that also holds, under a snapshot someone keeps open, the dead running version of every
run claimed since, at every past time: so the claim reads the timers at most once per
`TIMERS_EVERY` (at once again while some are due still), and only from where the last read
says no due timer can be before (`timers_from` of claim_runs: the earliest one it left, or
`TIMERS_MARGIN` before it ran), with a full read at the first claim and every
`FULL_TIMERS_EVERY` (for a timer that a transaction open longer than the margin wrote into the
past). `rotate_ready` is offered every `ROTATE_EVERY` and `sweep_ready` runs every
`SWEEP_EVERY`; see migrations/0003_ready_queue.sql. `pay_group_releases` runs every
`RELEASES_EVERY` (migrations/0015_group_releases.sql).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from umt_sdk.backend import TaskPair

__all__ = ["ClaimClocks", "TimersRead"]

_log = logging.getLogger("umt.pg")

TIMERS_EVERY = 1.0
TIMERS_MARGIN = timedelta(seconds=5)
FULL_TIMERS_EVERY = 60.0
ROTATE_EVERY = 0.25
ROTATE_AFTER_FULL = 5.0
MAX_MOVED = 2_000
"""Claimable rows a rotation moves to the current slot at most (more: a backlog, left to the
claims; moving them holds the slot's lock, and every claim waits for it)."""
SWEEP_EVERY = 30.0
SWEEP_GRACE = timedelta(seconds=10)
SWEEP_PAGE = 5_000
SWEEP_PAGE_EVERY = 1.0
RELEASES_EVERY = 1.0
"""How often a worker pays the releases maps owe (a held member whose release was lost to a
lock another write held starts within about this long)."""
RELEASES_PAGE = 100
"""Groups paid per pass at most (more: the next pass, at once)."""


@dataclass(frozen=True)
class TimersRead:
    """Whether a claim reads the timers, and from when (None: all of them)."""

    read: bool
    after: datetime | None


@dataclass
class _Timers:
    read_at: float
    full_at: float
    after: datetime
    left: bool
    paused: frozenset[str] = frozenset()


class ClaimClocks:
    """Per backend: the timers state per set of pairs, the rotation and the sweep schedules."""

    def __init__(self) -> None:
        self._timers: dict[frozenset[TaskPair], _Timers] = {}
        self._rotate_at = float("-inf")
        self._sweep_at = time.monotonic() + SWEEP_EVERY
        self._swept_to: tuple[datetime, uuid.UUID] | None = None
        self._releases_at = float("-inf")
        self.rotation_enabled = True

    def timers(self, pairs: frozenset[TaskPair]) -> TimersRead:
        """Should this claim read the timers, and from when?"""
        now = time.monotonic()
        last = self._timers.get(pairs)
        if last is None or now - last.full_at >= FULL_TIMERS_EVERY:
            return TimersRead(read=True, after=None)
        if last.left or now - last.read_at >= TIMERS_EVERY:
            return TimersRead(read=True, after=last.after)
        return TimersRead(read=False, after=None)

    def timers_read(
        self,
        pairs: frozenset[TaskPair],
        asked: TimersRead,
        *,
        started: float,
        timers_from: datetime,
        left: bool,
        paused: frozenset[str] = frozenset(),
    ) -> None:
        """A claim that read the timers (from `started`, monotonic) said where the next starts,
        and which of the pairs were paused (left out: their timers were not read)."""
        last = self._timers.get(pairs)
        full_at = started if asked.after is None or last is None else last.full_at
        if last is not None and last.paused - paused:
            # A pair was resumed: its timers that came while it was paused may lie before
            # `timers_from`, which passed them over. Read them all at the next claim.
            full_at = float("-inf")
        self._timers[pairs] = _Timers(
            read_at=started, full_at=full_at, after=timers_from, left=left, paused=paused
        )

    def rotation_due(self) -> bool:
        return self.rotation_enabled and time.monotonic() >= self._rotate_at

    def rotated(self, outcome: str) -> None:
        """`rotate_ready` said `outcome`: offer again soon, or later after a backlog ('full')."""
        wait = ROTATE_AFTER_FULL if outcome == "full" else ROTATE_EVERY
        self._rotate_at = time.monotonic() + wait

    def disable_rotation(self, why: str) -> None:
        if self.rotation_enabled:
            _log.warning(
                "umt: the ready queue is no longer rotated by this worker (%s); claims stay "
                "correct, but a long open transaction elsewhere slows them down again. Grant "
                "the worker's role TRUNCATE on the ready_0..2 tables (or run it as their owner).",
                why,
            )
        self.rotation_enabled = False

    def sweep_due(self) -> bool:
        return time.monotonic() >= self._sweep_at

    @property
    def swept_to(self) -> tuple[datetime, uuid.UUID] | None:
        """Where the next sweep page starts (None: at the oldest queued run)."""
        return self._swept_to

    def swept(
        self, *, scanned: int, requeued: int, last: tuple[datetime, uuid.UUID] | None
    ) -> None:
        """A sweep page ended: a full page goes on from its last run a second later; a short
        one reached the end, and the next sweep starts again from the oldest in SWEEP_EVERY."""
        if requeued:
            _log.warning(
                "umt: %d queued run(s) had lost their row in the ready queue (a TRUNCATE or "
                "DELETE of umt's ready tables by hand?) and were handed back to the claim",
                requeued,
            )
        if scanned >= SWEEP_PAGE and last is not None:
            self._swept_to = last
            self._sweep_at = time.monotonic() + SWEEP_PAGE_EVERY
        else:
            self._swept_to = None
            self._sweep_at = time.monotonic() + SWEEP_EVERY

    def releases_due(self) -> bool:
        return time.monotonic() >= self._releases_at

    def releases_paid(self, *, groups: int) -> None:
        """A pass of pay_group_releases took `groups`: a full page goes on at the next claim."""
        self._releases_at = time.monotonic() + (0.0 if groups >= RELEASES_PAGE else RELEASES_EVERY)

    def sweep_failed(self) -> None:
        self._sweep_at = time.monotonic() + SWEEP_EVERY
