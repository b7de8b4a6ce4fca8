"""Fairness keys (`enqueue(fairness_key=, weight=)`) on the memory backend: whatever the
interleaving of enqueues of several keys with claims of any size, the turns hold:

- a claim takes a key's runs in rounds of its weight, and in enqueue order: a key that still
  has a due run after the claim is never a round behind another key (weight 3 takes three runs
  in a round, weight 1 one);
- a claim that takes fewer runs than it may has left no due run, but of keys that took their
  share of it in full (a key offers its weight's share of the claim: `limit` over the keys
  picked, rounded up, times its weight, so a short line leaves its share unused);
- while a key has a due run, every other key is served in one claim at most before it is:
  a backlog, however long, delays another key's run by one turn at most.

Enqueues go through `Engine.enqueue(fairness_key=...)`, as a user makes them; claims and
endings go through the SPI, as a worker makes them, so the interleaving is the one Hypothesis
drew. The contract suite checks that the Postgres claim agrees with this one.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from uuid import UUID

import attrs
from hypothesis import given
from hypothesis import strategies as st

from umt_sdk import Engine, Registry, TaskContext, connect, task
from umt_sdk.backend import Ending, Lease, TaskPair
from umt_sdk.testing import FakeClock


@attrs.frozen
class Item:
    n: int


@task("prop.fair", version=1)
async def fair(ctx: TaskContext[Item]) -> int:  # pragma: no cover - never executed
    return ctx.input.n


PAIR = TaskPair(name="prop.fair", version=1)
LEASE = timedelta(seconds=30)
WEIGHTS = {"a": 1, "b": 2, "c": 3, "d": 1}
DONE = Ending(status="completed", outcome="completed", output_json="1")

enqueue = st.tuples(
    st.just("enqueue"), st.sampled_from(sorted(WEIGHTS)), st.integers(min_value=1, max_value=6)
)
claim = st.tuples(st.just("claim"), st.integers(min_value=1, max_value=8), st.just(0))
tick = st.tuples(st.just("tick"), st.just(""), st.just(0))
operations = st.lists(st.one_of(enqueue, claim, tick), min_size=4, max_size=40)


async def _play(ops: list[tuple[str, str | int, int]]) -> None:
    clock = FakeClock()
    engine: Engine = await connect("memory://", registry=Registry([fair]), clock=clock)
    backend = engine.backend
    enqueued: dict[str, list[UUID]] = {key: [] for key in WEIGHTS}
    started: dict[str, list[UUID]] = {key: [] for key in WEIGHTS}
    key_of: dict[UUID, str] = {}
    # For each key with a due run: the other keys served since it had one and was not served.
    passed_by: dict[str, set[str]] = {key: set() for key in WEIGHTS}
    try:
        for n, (kind, arg, count) in enumerate(ops):
            if kind == "enqueue":
                key = str(arg)
                for i in range(count):
                    handle = await engine.enqueue(
                        fair, Item(n=n * 10 + i), fairness_key=key, weight=WEIGHTS[key]
                    )
                    enqueued[key].append(handle.run_id)
                    key_of[handle.run_id] = key
            elif kind == "tick":
                clock.advance(timedelta(milliseconds=1))
            else:
                limit = int(arg)
                waiting = {k for k in WEIGHTS if len(started[k]) < len(enqueued[k])}
                claimed = await backend.claim(
                    worker_id="prop", pairs=[PAIR], limit=limit, lease=LEASE
                )
                taken = Counter(key_of[c.run_id] for c in claimed)
                assert len(claimed) <= limit
                for c in claimed:
                    started[key_of[c.run_id]].append(c.run_id)
                    lease = Lease(
                        run_id=c.run_id,
                        fencing_token=c.fencing_token,
                        worker_id="prop",
                        duration=LEASE,
                    )
                    assert await backend.end_execution(lease, DONE) == "ended"
                left = {k for k in WEIGHTS if len(started[k]) < len(enqueued[k])}
                if len(claimed) < limit:
                    # Short of its limit, the claim took every key it picked (all the keys
                    # with a due run: fewer than `limit`) as far as its share went: a key
                    # still with a due run took its weight's share of the claim in full.
                    share = -(-limit // max(len(waiting), 1))
                    short = [k for k in left if taken[k] < WEIGHTS[k] * share]
                    assert not short, (short, taken)
                for behind in left:
                    current = taken[behind] // WEIGHTS[behind]  # the round it is in
                    for ahead, runs in taken.items():
                        last = -(-runs // WEIGHTS[ahead]) - 1  # the last round it took from
                        assert last <= current, (ahead, behind, taken)
                for key in waiting:
                    if taken[key]:
                        passed_by[key] = set()
                        continue
                    again = passed_by[key] & set(taken)
                    assert not again, f"{key} passed over twice by {again}"
                    passed_by[key] |= set(taken)
        for key in WEIGHTS:
            assert started[key] == enqueued[key][: len(started[key])], key
    finally:
        await engine.close()


@given(operations)
def test_fairness_keys_take_weighted_turns(ops: list[tuple[str, str | int, int]]) -> None:
    asyncio.run(_play(ops))
