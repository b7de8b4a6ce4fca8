"""Events, over any sequence of publishes (keys repeated or not, payloads equal or not) and
clock moves, then a subscriber registered late, and its passes repeated:

- each event starts each subscriber the publisher knows exactly once, with the event's payload;
  a repeat of (name, key) starts nothing, with another payload it is refused;
- the late subscriber gets exactly the events published within the window before its pass,
  each once, however many passes run, and never an older one;
- the order promised: the late subscriber's runs are claimed in the order of the events'
  publish.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import attrs
from hypothesis import given
from hypothesis import strategies as st

from umt_sdk import Engine, IdempotencyConflictError, Registry, TaskContext, connect, task
from umt_sdk.testing import FakeClock

WINDOW = timedelta(hours=24)


@attrs.frozen
class Sale:
    n: int


@task("prop.events.known", on_event="prop.sold")
async def known(ctx: TaskContext[Sale]) -> int:
    return ctx.input.n


@task("prop.events.late", on_event="prop.sold")
async def late(ctx: TaskContext[Sale]) -> int:
    return ctx.input.n


@task("prop.events.other", on_event="prop.other")
async def other(ctx: TaskContext[Sale]) -> int:
    return ctx.input.n


PUBLISH = st.tuples(
    st.just("publish"),
    st.sampled_from(["prop.sold", "prop.other"]),
    st.one_of(st.none(), st.sampled_from(["k1", "k2", "k3"])),
    st.integers(0, 2),
)
ADVANCE = st.tuples(st.just("advance"), st.integers(0, 30))
STEPS = st.lists(st.one_of(PUBLISH, ADVANCE), max_size=25)


async def _runs(engine: Engine, task_name: str) -> list[Any]:
    return list(await engine.list(task_name=task_name, limit=1000))


async def _check(steps: list[tuple[Any, ...]], passes: int) -> None:
    clock = FakeClock()
    engine = await connect("memory://", registry=Registry([known, other]), clock=clock)
    try:
        stored: dict[tuple[str, str], tuple[Any, int, Any]] = {}  # (name, key) -> event
        for step in steps:
            if step[0] == "advance":
                clock.advance(timedelta(hours=step[1]))
                continue
            _, name, key, n = step
            found = stored.get((name, key)) if key is not None else None
            if found is not None and found[1] != n:
                try:
                    await engine.publish(name, Sale(n), key=key)
                    raise AssertionError("a repeat with another payload must be refused")
                except IdempotencyConflictError:
                    continue
            published = await engine.publish(name, Sale(n), key=key)
            assert published.created == (found is None)
            if found is None:
                assert len(published.runs) == 1
                stored[(name, published.key)] = (published.event_id, n, clock.now())
            else:
                assert published.runs == ()
                assert published.event_id == found[0]
        # Each event started each known subscriber once, with its payload.
        for task_name, event_name in (
            ("prop.events.known", "prop.sold"),
            ("prop.events.other", "prop.other"),
        ):
            runs = await _runs(engine, task_name)
            want = {(e[0], e[1]) for (name, _), e in stored.items() if name == event_name}
            got = {(r.idempotency_key, r.input["n"]) for r in runs}
            assert got == {(f"umt.event:{event_id}", n) for event_id, n in want}
            assert len(runs) == len(want)
        # A late subscriber, its passes repeated (restarts, several workers).
        later = Engine(engine.backend, Registry([late]))
        starter = later._event_starter([late.pair])
        assert starter is not None
        for _ in range(passes):
            await starter.run_pass()
        now = clock.now()
        in_window = sorted(
            (at, event_id, n)
            for (name, _), (event_id, n, at) in stored.items()
            if name == "prop.sold" and at >= now - WINDOW
        )
        runs = await _runs(later, "prop.events.late")
        assert len(runs) == len(in_window)
        assert {r.idempotency_key for r in runs} == {f"umt.event:{e}" for _, e, _ in in_window}
        claimed = await engine.backend.claim(
            worker_id="prop", pairs=[late.pair], limit=1000, lease=timedelta(seconds=30)
        )
        order = [(await engine.get(c.run_id)).idempotency_key for c in claimed]
        assert order == [f"umt.event:{e}" for _, e, _ in in_window], "in publish order"
    finally:
        await engine.close()


@given(steps=STEPS, passes=st.integers(1, 3))
def test_every_event_starts_each_subscriber_once(steps: list[tuple[Any, ...]], passes: int) -> None:
    asyncio.run(_check(steps, passes))
