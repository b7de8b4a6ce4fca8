from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["SystemClock"]


class SystemClock:
    """Wall-clock time, timezone-aware UTC."""

    def now(self) -> datetime:
        return datetime.now(UTC)
