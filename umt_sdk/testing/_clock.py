from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from umt_sdk import _check as check
from umt_sdk._check import shown
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
        start = datetime(2030, 1, 1, tzinfo=UTC) if start is None else start
        if not isinstance(start, datetime) or start.utcoffset() is None:
            raise UsageError(
                "FakeClock start must be a timezone-aware datetime (tzinfo=UTC, say), or None; "
                f"got {shown(start)}",
                argument="start",
            )
        self._now = start
        self.auto_advance = check.flag(auto_advance, "auto_advance", where="FakeClock")
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def now(self) -> datetime:
        return self._now

    def advance(self, delta: timedelta) -> None:
        """Move the clock forward by `delta` (>= 0) and wake whatever was waiting for it."""
        if isinstance(delta, timedelta) and delta < timedelta(0):
            raise UsageError(
                f"FakeClock cannot go backwards (advance by {delta}); pass a delta >= 0",
                argument="delta",
            )
        check.duration(
            delta,
            "delta",
            at_most=timedelta.max,
            expected="a timedelta >= 0 such as timedelta(minutes=5)",
            where="FakeClock.advance",
        )
        with self._lock:
            try:
                self._now += delta
            except OverflowError:
                raise UsageError(
                    f"FakeClock.advance: delta {delta} takes the clock from {self._now} past the "
                    "last datetime (year 9999); pass a smaller delta",
                    argument="delta",
                ) from None
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def advance_to(self, when: datetime) -> None:
        """Move the clock to `when` if that is later than now."""
        check.aware_datetime(when, "when", where="FakeClock.advance_to")
        if when > self._now:
            self.advance(when - self._now)

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener()` after every advance; returns the unsubscribe function."""
        check.function(listener, "listener", where="FakeClock.subscribe")
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe
