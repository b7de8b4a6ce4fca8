"""A bounded-memory latency histogram (stdlib only; the scenario workers import it too).

Log-spaced buckets, 5% wide, from 0.01 ms up: a percentile read from it is within about 2.5%
of the true value, and a histogram never holds more than ~430 buckets however many values it
counts. Histograms merge by adding counts, so workers send the last second's values and the
harness folds them into per-window totals.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["Histogram"]

_BASE = 1.05
_FLOOR_MS = 0.01
_LOG_BASE = math.log(_BASE)


class Histogram:
    """Counts of latencies (milliseconds) in 5%-wide buckets."""

    __slots__ = ("buckets", "count", "max_ms", "total_ms")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.count = 0
        self.total_ms = 0.0
        self.max_ms = 0.0

    @staticmethod
    def index(ms: float) -> int:
        if ms <= _FLOOR_MS:
            return 0
        return 1 + int(math.log(ms / _FLOOR_MS) / _LOG_BASE)

    @staticmethod
    def value(index: int) -> float:
        """The bucket's representative value: the geometric middle of its bounds."""
        if index <= 0:
            return _FLOOR_MS
        return _FLOOR_MS * _BASE ** (index - 0.5)

    def add(self, ms: float) -> None:
        i = self.index(ms)
        self.buckets[i] = self.buckets.get(i, 0) + 1
        self.count += 1
        self.total_ms += ms
        self.max_ms = max(self.max_ms, ms)

    def merge(self, other: Histogram) -> None:
        for i, n in other.buckets.items():
            self.buckets[i] = self.buckets.get(i, 0) + n
        self.count += other.count
        self.total_ms += other.total_ms
        self.max_ms = max(self.max_ms, other.max_ms)

    def percentile(self, p: float) -> float | None:
        if not self.count:
            return None
        rank = max(1, math.ceil(p / 100.0 * self.count))
        seen = 0
        for i in sorted(self.buckets):
            seen += self.buckets[i]
            if seen >= rank:
                return min(self.value(i), self.max_ms)
        return self.max_ms

    def summary(self) -> dict[str, float | int | None]:
        return {
            "n": self.count,
            "p50_ms": self.percentile(50),
            "p95_ms": self.percentile(95),
            "p99_ms": self.percentile(99),
            "max_ms": self.max_ms if self.count else None,
            "mean_ms": self.total_ms / self.count if self.count else None,
        }

    def to_json(self) -> dict[str, object]:
        return {
            "b": {str(i): n for i, n in self.buckets.items()},
            "n": self.count,
            "sum": self.total_ms,
            "max": self.max_ms,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Histogram:
        h = cls()
        buckets = data.get("b") or {}
        assert isinstance(buckets, Mapping)
        h.buckets = {int(i): int(n) for i, n in buckets.items()}
        h.count = int(data.get("n") or 0)
        h.total_ms = float(data.get("sum") or 0.0)
        h.max_ms = float(data.get("max") or 0.0)
        return h

    @classmethod
    def of(cls, values: Iterable[float]) -> Histogram:
        h = cls()
        for v in values:
            h.add(v)
        return h
