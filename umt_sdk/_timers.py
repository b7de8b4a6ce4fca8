"""Waiting for a time on the backend's clock: what step timeouts and run deadlines count on.

Time is the backend's (`Execution.now()`): a clock a test moves (`FakeClock`) fires a timer
when it is moved past it, never on its own; any other clock (a real one, or the database's time
measured from the claim) fires it when that much real time has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime

from umt_sdk._spi import Clock, ControllableClock

__all__ = ["wait_until"]

# A real clock is looked at again at least this often (seconds): a wall clock that jumps (NTP)
# must not leave a timer asleep for the old distance.
_LONGEST_NAP = 5.0


async def wait_until(now: Callable[[], datetime], when: datetime, clock: Clock | None) -> None:
    """Return once `now()` is at or past `when`.

    `clock`: the backend's own clock, if it keeps one; a `ControllableClock` wakes the wait
    when it moves (from any thread)."""
    moved = asyncio.Event()
    unsubscribe: Callable[[], None] | None = None
    controllable = isinstance(clock, ControllableClock)
    if controllable:
        assert isinstance(clock, ControllableClock)
        loop = asyncio.get_running_loop()

        def wake() -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(moved.set)

        unsubscribe = clock.subscribe(wake)
    try:
        while (remaining := (when - now()).total_seconds()) > 0:
            nap = None if controllable else min(remaining, _LONGEST_NAP)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(nap):
                    await moved.wait()
            moved.clear()
    finally:
        if unsubscribe is not None:
            unsubscribe()
