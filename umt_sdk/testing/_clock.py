from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from umt_sdk.exceptions import UsageError

__all__ = ["FakeClock"]


class FakeClock:
    """A virtual clock for backends that keep their own time (the memory backend): a
    `umt_sdk.backend.ControllableClock`.

    `advance(delta)` moves it; with `auto_advance=True` the backend jumps it to the next timer
    (a sleep's end, a retry, a wait's timeout) whenever every run is blocked and a caller is
    waiting on a result, so a test of a two-day approval finishes in milliseconds. It never
    jumps while a lease is live: after simulating a crash, `advance` past the lease yourself.
    """

    def __init__(self, start: datetime | None = None, *, auto_advance: bool = False) -> None:
        start = start or datetime(2030, 1, 1, tzinfo=UTC)
        if start.tzinfo is None:
            raise UsageError(
                f"FakeClock start must be timezone-aware (tzinfo=UTC, say), got {start!r}",
                argument="start",
            )
        self._now = start
        self.auto_advance = auto_advance
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def now(self) -> datetime:
        return self._now

    def advance(self, delta: timedelta) -> None:
        """Move the clock forward by `delta` (>= 0) and wake whatever was waiting for it."""
        if delta < timedelta(0):
            raise UsageError(
                f"FakeClock cannot go backwards (advance by {delta}); pass a delta >= 0",
                argument="delta",
            )
        with self._lock:
            self._now += delta
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def advance_to(self, when: datetime) -> None:
        """Move the clock to `when` if that is later than now."""
        if when > self._now:
            self.advance(when - self._now)

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener()` after every advance; returns the unsubscribe function."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe
