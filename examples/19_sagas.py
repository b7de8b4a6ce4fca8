"""Sagas: a trip is booked step by step; when a later step cannot be done, the steps that were
done are undone, newest first, each undo a durable step of its own.

Run it: `python examples/19_sagas.py` (the memory backend and a `FakeClock`; the same code runs
on Postgres, and a worker killed while undoing resumes where it was, never undoing a step twice
nor skipping one: tests/chaos/test_saga_killed.py).

- `ctx.step.run("flight", book_flight, trip, compensate=cancel_flight)` registers the undo with
  the step's record; it is called with what the step returned;
- `raise Compensate("...")` in the handler gives up: the compensations of the completed steps
  run in reverse order (the step `umt.compensate:<step>`, retried by its policy) and the run
  ends `compensated`; `result()` raises `RunCompensatedError` (a `RunFailedError`);
- `@task(on_failure="compensate")` does the same for a run that fails for good (its retries
  spent), here the car rental that is sold out;
- a compensated run is a finished run: listed by status, deleted by retention like the others.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from attrs import frozen

from umt_sdk import (
    Compensate,
    Registry,
    RetryPolicy,
    RunCompensatedError,
    RunPrunedError,
    TaskContext,
    connect,
    task,
)
from umt_sdk.testing import FakeClock

BOOKED: dict[str, str] = {}
"""The outside world: booking reference -> what it is."""


@frozen
class Trip:
    traveller: str
    nights: int
    budget: int


def book(kind: str, trip: Trip) -> str:
    reference = f"{kind}-{trip.traveller}"
    BOOKED[reference] = kind
    print(f"  booked {reference}")
    return reference


def cancel(reference: str) -> None:
    """A compensation: idempotent, like every step body (a crash may run it again)."""
    if BOOKED.pop(reference, None) is not None:
        print(f"  canceled {reference}")


@task("book_trip", version=1, retry=RetryPolicy.none())
async def book_trip(ctx: TaskContext[Trip]) -> str:
    trip = ctx.input
    await ctx.step.run("flight", book, "flight", trip, compensate=cancel)
    await ctx.step.run("hotel", book, "hotel", trip, compensate=cancel)
    price = await ctx.step.run("quote", lambda: 120 * trip.nights)  # nothing to undo
    if price > trip.budget:
        raise Compensate(f"the trip costs {price}, over the budget of {trip.budget}")
    await ctx.step.run("pay", book, "payment", trip, compensate=cancel)
    return f"trip of {trip.traveller} booked for {price}"


def rent_car(trip: Trip) -> str:
    raise ConnectionError("every car is rented")


@task("book_road_trip", version=1, retry=RetryPolicy.none(), on_failure="compensate")
async def book_road_trip(ctx: TaskContext[Trip]) -> str:
    await ctx.step.run("hotel", book, "hotel", ctx.input, compensate=cancel)
    await ctx.step.run("car", rent_car, ctx.input, compensate=cancel)  # fails: nothing to undo
    return "unreachable"


async def main() -> None:
    clock = FakeClock(auto_advance=True)
    registry = Registry([book_trip, book_road_trip])
    engine = await connect(
        "memory://", registry=registry, clock=clock, retention=timedelta(days=30)
    )
    async with engine, engine.worker(prune_interval=timedelta(seconds=1)):
        print("ana, 2 nights, budget 500:")
        ana = await engine.enqueue(book_trip, Trip("ana", nights=2, budget=500))
        print(" ", await ana.result(timeout=10))

        print("bob, 5 nights, budget 500:")
        bob = await engine.enqueue(book_trip, Trip("bob", nights=5, budget=500))
        try:
            await bob.result(timeout=10)
        except RunCompensatedError as exc:
            print(f"  compensated: {exc.error_message}")
        info = await engine.get(bob.run_id)
        print("  steps:", [s.name for s in info.timeline if not s.name.startswith("umt.compens")])
        print("  undone:", [s.name for s in info.timeline if s.name.startswith("umt.compensate:")])

        print("cy, a road trip:")
        cy = await engine.enqueue(book_road_trip, Trip("cy", nights=1, budget=900))
        try:
            await cy.result(timeout=10)
        except RunCompensatedError as exc:
            print(f"  compensated after {exc.error_type}: {exc.error_message}")

        assert sorted(BOOKED) == ["flight-ana", "hotel-ana", "payment-ana"], BOOKED
        page = await engine.list(status="compensated")
        print("compensated runs:", sorted(r.run_id in (bob.run_id, cy.run_id) for r in page.runs))

        clock.advance(timedelta(days=31))  # retention deletes finished runs, compensated too
        for _ in range(200):
            try:
                await engine.get(bob.run_id)
            except RunPrunedError:
                print("after 31 days: bob's compensated run was deleted by retention")
                break
            await asyncio.sleep(0.01)
        else:
            raise SystemExit("retention did not delete the compensated run")


if __name__ == "__main__":
    asyncio.run(main())
