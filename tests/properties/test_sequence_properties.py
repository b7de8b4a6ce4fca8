"""Per-key FIFO (`enqueue(sequence=key)`) on the memory backend: whatever the interleaving of
enqueues of several keys with claims and every way an execution ends, the runs of one key start
(are first claimed) in the order they were enqueued, and at most one run of a key holds its
slot (running, or parked on a sleep or a fact) at any time.

Enqueues go through `Engine.enqueue(sequence=...)`, as a user makes them; claims and endings go
through the SPI, as a worker makes them, so the interleaving is the one Hypothesis drew.
"""

from __future__ import annotations

import asyncio
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


@task("prop.sequenced", version=1)
async def sequenced(ctx: TaskContext[Item]) -> int:  # pragma: no cover - never executed
    return ctx.input.n


PAIR = TaskPair(name="prop.sequenced", version=1)
LEASE = timedelta(seconds=30)
KEYS = ("a", "b", "c")

enqueue = st.tuples(st.just("enqueue"), st.sampled_from(KEYS))
claim = st.tuples(st.just("claim"), st.integers(min_value=1, max_value=4))
end = st.tuples(
    st.just("end"),
    st.sampled_from(["fact", "sleep", "released", "completed", "failed"]),
    st.integers(min_value=0, max_value=1000),
)
wake = st.tuples(st.just("wake"), st.integers(min_value=0, max_value=1000))
operations = st.lists(st.one_of(enqueue, claim, end, wake), min_size=4, max_size=40)


async def _play(ops: list[tuple[object, ...]]) -> None:
    clock = FakeClock()
    engine: Engine = await connect("memory://", registry=Registry([sequenced]), clock=clock)
    backend = engine.backend
    enqueued: dict[str, list[UUID]] = {key: [] for key in KEYS}
    key_of: dict[UUID, str] = {}
    started: dict[str, list[UUID]] = {key: [] for key in KEYS}
    leases: dict[UUID, Lease] = {}
    parked: dict[UUID, str] = {}  # run -> the fact it waits for
    try:
        for n, op in enumerate(ops):
            if op[0] == "enqueue":
                key = str(op[1])
                handle = await engine.enqueue(sequenced, Item(n=n), sequence=key)
                assert handle.created
                enqueued[key].append(handle.run_id)
                key_of[handle.run_id] = key
            elif op[0] == "claim":
                claimed = await backend.claim(
                    worker_id="prop", pairs=[PAIR], limit=int(str(op[1])), lease=LEASE
                )
                for c in claimed:
                    key = key_of[c.run_id]
                    if c.run_id not in started[key]:
                        started[key].append(c.run_id)
                    parked.pop(c.run_id, None)
                    leases[c.run_id] = Lease(
                        run_id=c.run_id,
                        fencing_token=c.fencing_token,
                        worker_id="prop",
                        duration=LEASE,
                    )
            elif op[0] == "end" and leases:
                how, pick = str(op[1]), int(str(op[2]))
                run_id = sorted(leases)[pick % len(leases)]
                lease = leases.pop(run_id)
                if how == "completed":
                    ending = Ending(status="completed", outcome="completed", output_json="1")
                elif how == "failed":
                    ending = Ending(status="failed", outcome="failed")
                elif how == "released":
                    ending = Ending(status="pending", outcome="released")
                elif how == "sleep":
                    ending = Ending(
                        status="waiting",
                        outcome="waiting",
                        available_at=clock.now() + timedelta(seconds=1),
                    )
                else:
                    parked[run_id] = f"go-{run_id}"
                    ending = Ending(status="waiting", outcome="waiting", wait_for=parked[run_id])
                assert await backend.end_execution(lease, ending) == "ended"
                if how == "sleep":
                    clock.advance(timedelta(seconds=1))
            elif op[0] == "wake" and parked:
                run_id = sorted(parked)[int(str(op[1])) % len(parked)]
                await backend.signal(run_id=run_id, name=parked.pop(run_id), payload_json="1")
            # At most one run of a key holds its slot: running, or parked (count_waiting).
            for key in KEYS:
                holding = [
                    run_id
                    for run_id in enqueued[key]
                    if (head := await backend.get_run_head(run_id)) is not None
                    and head.status in ("running", "waiting")
                ]
                assert len(holding) <= 1, (key, holding)
        for key in KEYS:
            assert started[key] == enqueued[key][: len(started[key])], key
    finally:
        await engine.close()


@given(operations)
def test_runs_of_a_sequence_start_in_enqueue_order_one_at_a_time(
    ops: list[tuple[object, ...]],
) -> None:
    asyncio.run(_play(ops))
