"""`engine.enqueue_many(task, inputs, idempotency_keys=...)` has the observable outcome of
`engine.enqueue(task, input, idempotency_key=key)` called once per input, in order, after the
same earlier runs: the same handles (created or not, naming the same runs), the same stored
runs, claimed in the same order; and where the singles meet a key of another input, the batch
raises `IdempotencyConflictError` too."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import attrs
from hypothesis import example, given
from hypothesis import strategies as st

from umt_sdk import Engine, IdempotencyConflictError, Registry, TaskContext, connect, task
from umt_sdk.testing import FakeClock


@attrs.frozen
class Order:
    item: str


@task("prop.many")
async def many(ctx: TaskContext[Order]) -> str:
    return ctx.input.item


KEYS = st.one_of(st.none(), st.sampled_from(["k1", "k2", "k3", "k4"]))
ENTRY = st.tuples(st.sampled_from(["a", "b", "c"]), KEYS)


async def _engine() -> Engine:
    return await connect("memory://", registry=Registry([many]), clock=FakeClock(auto_advance=True))


async def _observe(
    engine: Engine, handles: list[Any], earlier: list[Any]
) -> tuple[list[tuple[bool, int]], list[tuple[str, str | None, int, int]]]:
    """The handles and the store, with run ids replaced by their order of first mention, so
    two engines' outcomes compare."""
    names: dict[Any, int] = {}
    for handle in (*earlier, *handles):
        names.setdefault(handle.run_id, len(names))
    said = [(h.created, names[h.run_id]) for h in handles]
    claimed = await engine.backend.claim(
        worker_id="prop", pairs=[many.pair], limit=100, lease=timedelta(seconds=30)
    )
    stored = []
    for run in claimed:
        info = await engine.get(run.run_id)
        stored.append(
            (info.input["item"], info.idempotency_key, info.priority, names.get(run.run_id, -1))
        )
    return said, stored


async def _both(
    before: list[tuple[str, str | None]], batch: list[tuple[str, str | None]], priority: int
) -> None:
    first: dict[str | None, str] = {}
    before = [(first.setdefault(key, item) if key else item, key) for item, key in before]
    singles, batched = await _engine(), await _engine()
    try:
        outcomes = []
        for engine, at_once in ((singles, False), (batched, True)):
            earlier = [
                await engine.enqueue(many, Order(item), idempotency_key=key) for item, key in before
            ]
            try:
                if at_once:
                    handles = await engine.enqueue_many(
                        many,
                        [Order(item) for item, _ in batch],
                        idempotency_keys=[key for _, key in batch],
                        priority=priority,
                    )
                else:
                    handles = [
                        await engine.enqueue(
                            many, Order(item), idempotency_key=key, priority=priority
                        )
                        for item, key in batch
                    ]
            except IdempotencyConflictError:
                outcomes.append(None)
                continue
            outcomes.append(await _observe(engine, handles, earlier))
        assert outcomes[0] == outcomes[1]
    finally:
        await singles.close()
        await batched.close()


@given(
    before=st.lists(ENTRY, max_size=4),
    batch=st.lists(ENTRY, max_size=12),
    priority=st.integers(-2, 2),
)
# Found by Hypothesis: the repeat of a second key named the first key's run.
@example(before=[], batch=[("b", "k1"), ("b", "k1"), ("a", "k2"), ("a", "k2")], priority=0)
def test_a_batch_is_its_inputs_enqueued_one_at_a_time(
    before: list[tuple[str, str | None]], batch: list[tuple[str, str | None]], priority: int
) -> None:
    asyncio.run(_both(before, batch, priority))
