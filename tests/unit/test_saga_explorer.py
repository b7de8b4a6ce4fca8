"""A 5-step saga under the crash explorer: at every crash point (and every pair of them), each
compensation runs once, newest first, none skipped, and the run ends `compensated`."""

from __future__ import annotations

from typing import Any

from umt_sdk import Compensate, RetryPolicy, TaskContext, task
from umt_sdk.testing import explore_crashes

STEPS = 5


class Trip:
    """The outside world: what is booked, and the undo calls in the order they came."""

    def __init__(self) -> None:
        self.booked: set[int] = set()
        self.undone: list[int] = []

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Trip) and self.booked == other.booked and self.undone == other.undone
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Trip:
        copied = Trip()
        copied.booked = set(self.booked)
        copied.undone = list(self.undone)
        return copied


TRIP = Trip()


def fresh_trip() -> Trip:
    global TRIP
    TRIP = Trip()
    return TRIP


def book(i: int) -> int:
    TRIP.booked.add(i)  # idempotent: a body run again after a crash books nothing more
    return i


def cancel_booking(i: int) -> None:
    # Idempotent too: a compensation run again after a crash before its record adds nothing.
    TRIP.booked.discard(i)
    if i not in TRIP.undone:
        TRIP.undone.append(i)


@task("five_step_saga", retry=RetryPolicy.none())
async def five_step_saga(ctx: TaskContext[None]) -> None:
    for i in range(STEPS):
        await ctx.step.run(f"book-{i}", book, i, compensate=cancel_booking)
    raise Compensate("the last hotel is full")


def every_booking_undone_newest_first(trip: Trip) -> bool:
    # Checked once the run ended, after every crash: nothing left booked, each undone once,
    # in reverse order of booking.
    return trip.booked == set() and trip.undone == list(reversed(range(STEPS)))


async def test_a_five_step_saga_survives_a_crash_at_every_point() -> None:
    report = await explore_crashes(
        five_step_saga,
        None,
        setup=fresh_trip,
        invariant=every_booking_undone_newest_first,
        depth=2,
    )
    assert report.ok, report.explain()
    ids = [p.id for p in report.points]
    for i in range(STEPS):
        assert f"after:book-{i}" in ids
        assert f"after:umt.compensate:book-{i}" in ids
    assert ids[-1] == "end:compensated"
    assert len(report.explorations) > len(ids), "depth 2: crashes in the recoveries too"
    for exploration in report.explorations:
        # No compensation body starts again once its completion is recorded (the explorer's
        # own check), and none is skipped: each ran at least once in every crash schedule.
        for i in range(STEPS):
            assert exploration.step_starts[f"umt.compensate:book-{i}"] >= 1, exploration.crashes
