"""Run ids: UUIDv7, time-ordered, monotonic within the process."""

from __future__ import annotations

import os
import threading
import time
from uuid import UUID

__all__ = ["new_run_id"]

_last_run_id = 0
_run_id_lock = threading.Lock()


def new_run_id() -> UUID:
    """A UUIDv7: time-ordered, so new runs land at the end of the primary-key index.

    Monotonic within the process (RFC 9562, method 3): an id drawn in the same millisecond as
    the previous one, or with the clock set back, is the previous one plus one, so runs
    enqueued one after the other list in that order.
    """
    global _last_run_id
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= ((rand >> 62) & 0xFFF) << 64
    value |= 0b10 << 62
    value |= rand & ((1 << 62) - 1)
    with _run_id_lock:
        if value <= _last_run_id:
            value = _next_after(_last_run_id)
        _last_run_id = value
    return UUID(int=value)


def _next_after(previous: int) -> int:
    """The next UUIDv7 value: +1 in the random bits, carrying into rand_a and the time."""
    rand_b = (previous & ((1 << 62) - 1)) + 1
    rand_a = (previous >> 64) & 0xFFF
    millis = previous >> 80
    if rand_b >> 62:
        rand_b = 0
        rand_a += 1
        if rand_a >> 12:
            rand_a = 0
            millis += 1
    return ((millis & ((1 << 48) - 1)) << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
