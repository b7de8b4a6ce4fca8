"""Cron expressions and time zones, through `cronsim` and `zoneinfo` (never a parser of ours),
and the idempotency key that names one tick of one schedule.

`cronsim` (the parser of healthchecks.io) walks the expression in the schedule's time zone and
handles the clock changes the way Debian's cron does; with `30 2 * * *` in Europe/Paris:
- spring forward (02:00 jumps to 03:00): the run of the missing 02:30 happens at 03:00 local,
  once, the first moment after the gap;
- fall back (03:00 goes back to 02:00): 02:30 comes twice; the run happens once, at the first
  02:30 (summer time), not again an hour later.
A schedule whose hour field is a wildcard or a step (`0 * * * *`, `*/30 * * * *`) follows real
time instead: the repeated hour is run twice, and no hour is invented in the gap.

Every time leaves this module in UTC, the way the store keeps it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from attrs import frozen
from cronsim import CronSim, CronSimError

from umt_sdk._check import shown
from umt_sdk.exceptions import UsageError

__all__ = ["TICK_KEY_PREFIX", "CronSpec", "check_timezone", "tick_key", "tick_of_key"]

TICK_KEY_PREFIX = "umt.schedule:"
"""The idempotency keys of scheduled runs: `umt.schedule:<name>:<tick, UTC>`."""

_TICK_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_TICK_LENGTH = len("2030-01-01T00:00:00Z")
_SECOND = timedelta(seconds=1)

_CRON_HELP = (
    "five fields 'minute hour day-of-month month day-of-week' (an optional sixth for seconds), "
    "such as '0 3 * * *' (03:00 every day) or '*/15 9-17 * * MON-FRI'"
)


@lru_cache(maxsize=256)
def check_timezone(name: object, *, argument: str = "timezone", where: str = "") -> ZoneInfo:
    """The IANA time zone `name` (`UsageError` naming it when the tz database has no such zone)."""
    prefix = f"{where}: " if where else ""
    if not isinstance(name, str) or not name or name != name.strip():
        raise UsageError(
            f"{prefix}{argument} must be an IANA time zone name such as 'Europe/Paris' or "
            f"'UTC', got {shown(name)}",
            argument=argument,
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise UsageError(
            f"{prefix}{argument}: unknown time zone {name!r}; use an IANA name such as "
            "'Europe/Paris', 'America/New_York' or 'UTC' (zoneinfo.available_timezones() lists "
            "them; the tzdata package provides them where the system has none)",
            argument=argument,
        ) from exc


@frozen
class CronSpec:
    """A cron expression in a time zone: the ticks it gives, as UTC datetimes."""

    expression: str
    timezone: str

    @classmethod
    def parse(cls, expression: object, timezone: object = "UTC", *, where: str = "") -> CronSpec:
        """Check both now (`UsageError` naming the one that is wrong and how to write it)."""
        if isinstance(expression, str) and isinstance(timezone, str):
            with contextlib.suppress(UsageError):
                return _parsed(expression, timezone)
        return cls._parse(expression, timezone, where=where)

    @classmethod
    def _parse(cls, expression: object, timezone: object, *, where: str) -> CronSpec:
        prefix = f"{where}: " if where else ""
        if not isinstance(expression, str) or not expression.strip():
            raise UsageError(
                f"{prefix}cron must be a cron expression ({_CRON_HELP}), got {shown(expression)}",
                argument="cron",
            )
        zone = check_timezone(timezone, where=where)
        try:
            CronSim(expression, datetime(2030, 1, 1, tzinfo=zone))
        except CronSimError as exc:
            raise UsageError(
                f"{prefix}cron {expression!r} is not a cron expression cronsim accepts ({exc}); "
                f"write {_CRON_HELP}",
                argument="cron",
            ) from exc
        return cls(expression, zone.key)

    @property
    def zone(self) -> ZoneInfo:
        return check_timezone(self.timezone)

    def _walk(self, start: datetime, *, reverse: bool = False) -> Iterator[datetime]:
        # Strictly after `start` (before, in reverse), compared as instants: a start in the
        # repeated hour of a fall-back (fold=1) can make cronsim hand back the first
        # occurrence of a wall time, an hour before the start.
        for tick in CronSim(self.expression, start.astimezone(self.zone), reverse=reverse):
            moment = tick.astimezone(UTC)
            if (moment < start) if reverse else (moment > start):
                yield moment

    def walk_from(self, moment: datetime) -> Iterator[datetime]:
        """The ticks at `moment` or later, oldest first."""
        start = moment.replace(microsecond=0)
        return self._walk(start if start < moment else start - _SECOND)

    def next_after(self, moment: datetime) -> datetime:
        """The first tick strictly after `moment`."""
        return next(self._walk(moment.replace(microsecond=0)))

    def first_at_or_after(self, moment: datetime) -> datetime:
        """The first tick at `moment` or later."""
        return next(self.walk_from(moment))

    def last_at_or_before(self, moment: datetime) -> datetime:
        """The latest tick at `moment` or earlier."""
        # cronsim walks back by wall time, so from the repeated hour of a fall-back it can
        # step over a tick (02:30 CEST is before 02:05 CET): walk forward again from there.
        latest = next(self._walk(moment.replace(microsecond=0) + _SECOND, reverse=True))
        for tick in self._walk(latest):
            if tick > moment:
                break
            latest = tick
        return latest

    def between(self, start: datetime, end: datetime, *, limit: int) -> list[datetime]:
        """The ticks in [`start`, `end`], oldest first; at most `limit` of them (the oldest)."""
        ticks: list[datetime] = []
        if end < start:
            return ticks
        for tick in self.walk_from(start):
            if tick > end or len(ticks) >= limit:
                break
            ticks.append(tick)
        return ticks


@lru_cache(maxsize=256)
def _parsed(expression: str, timezone: str) -> CronSpec:
    return CronSpec._parse(expression, timezone, where="")


def tick_key(schedule_name: str, tick: datetime) -> str:
    """The idempotency key of the run of `tick`: the same in every process that computes it,
    so schedulers racing for one tick make one run."""
    return f"{TICK_KEY_PREFIX}{schedule_name}:{tick.astimezone(UTC).strftime(_TICK_FORMAT)}"


def tick_of_key(key: str | None) -> datetime | None:
    """The tick a scheduled run's key names, or None for any other key."""
    if key is None or not key.startswith(TICK_KEY_PREFIX) or len(key) <= _TICK_LENGTH:
        return None
    if key[-_TICK_LENGTH - 1] != ":":
        return None
    try:
        return datetime.strptime(key[-_TICK_LENGTH:], _TICK_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        return None
