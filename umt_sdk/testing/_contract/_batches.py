"""`enqueue_many`: a batch is stored as its inputs enqueued one at a time would be (order,
priority, delay, tags, deadlines, concurrency keys), and honours idempotency keys: given twice
in the batch, already stored, or stored by a racing single enqueue."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import Engine, IdempotencyConflictError, TaskDefinition, UsageError
from umt_sdk.testing._contract._base import Job, Tally, echo_task_v2, eventually
from umt_sdk.testing._contract._concurrency import keyed_task

__all__ = ["BatchesContract"]


TASKS: tuple[TaskDefinition[Any, Any], ...] = ()
"""None of its own: these tests run the shared tasks of `_base` and `_concurrency`."""


class BatchesContract:
    """One write for many runs, with the outcome of as many single enqueues."""

    async def test_a_batch_runs_in_the_order_given(self, engine: Engine) -> None:
        handles = await engine.enqueue_many(echo_task_v2, [Job(key=str(i)) for i in range(6)])
        assert [h.created for h in handles] == [True] * 6
        assert len({h.run_id for h in handles}) == 6
        assert all(h.task_version == 2 for h in handles)
        claimed = await engine.backend.claim(
            worker_id="contract-batch",
            pairs=[echo_task_v2.pair],
            limit=6,
            lease=timedelta(seconds=30),
        )
        assert [c.run_id for c in claimed] == [h.run_id for h in handles], "FIFO as given"
        assert [(await engine.get(c.run_id)).input["key"] for c in claimed] == [
            str(i) for i in range(6)
        ]

    async def test_a_batch_runs_to_its_results(self, engine: Engine) -> None:
        inputs: list[Any] = [Job(key="a"), {"key": "b", "n": 5}]  # an input or its JSON form
        handles = await engine.enqueue_many(echo_task_v2, inputs)
        async with engine.worker(concurrency=2):
            results = [await h.result(timeout=15) for h in handles]
        assert results == [Job(key="a", n=2), Job(key="b", n=7)]

    async def test_an_empty_batch_stores_nothing(self, engine: Engine) -> None:
        assert await engine.enqueue_many(echo_task_v2, []) == []
        assert len(await engine.list()) == 0

    async def test_options_apply_to_every_run(self, engine: Engine) -> None:
        handles = await engine.enqueue_many(
            echo_task_v2,
            [Job(key="p"), Job(key="q")],
            priority=7,
            delay=timedelta(hours=1),
            tags={"tenant": "t7"},
            deadline=timedelta(days=1),
            start_within=timedelta(hours=2),
        )
        for handle in handles:
            info = await engine.get(handle.run_id)
            assert (info.priority, info.tags, info.status) == (7, {"tenant": "t7"}, "pending")
            assert info.deadline_at is not None
            assert info.start_by is not None
        tagged = await engine.list(tags={"tenant": "t7"})
        assert {r.run_id for r in tagged} == {h.run_id for h in handles}
        claimed = await engine.backend.claim(
            worker_id="contract-batch",
            pairs=[echo_task_v2.pair],
            limit=2,
            lease=timedelta(seconds=30),
        )
        assert claimed == [], "the delay holds them"

    async def test_keys_given_twice_or_stored_name_one_run(self, engine: Engine) -> None:
        stored = await engine.enqueue(echo_task_v2, Job(key="s"), idempotency_key="k:s")
        handles = await engine.enqueue_many(
            echo_task_v2,
            [Job(key="a"), Job(key="s"), Job(key="a"), Job(key="b"), Job(key="c")],
            idempotency_keys=["k:a", "k:s", "k:a", "k:b", None],
        )
        assert [h.created for h in handles] == [True, False, False, True, True]
        assert handles[1].run_id == stored.run_id
        assert handles[2].run_id == handles[0].run_id
        assert len({h.run_id for h in handles}) == 4
        assert len(await engine.list()) == 4
        again = await engine.enqueue_many(
            echo_task_v2, [Job(key="b"), Job(key="a")], idempotency_keys=["k:b", "k:a"]
        )
        assert [(h.run_id, h.created) for h in again] == [
            (handles[3].run_id, False),
            (handles[0].run_id, False),
        ]
        single = await engine.enqueue(echo_task_v2, Job(key="b"), idempotency_key="k:b")
        assert (single.run_id, single.created) == (handles[3].run_id, False)

    async def test_a_key_of_another_input_is_refused(self, engine: Engine) -> None:
        with pytest.raises(IdempotencyConflictError, match="given twice in this batch"):
            await engine.enqueue_many(
                echo_task_v2, [Job(key="a"), Job(key="b")], idempotency_keys=["k", "k"]
            )
        assert len(await engine.list()) == 0, "refused before anything is stored"
        stored = await engine.enqueue(echo_task_v2, Job(key="s"), idempotency_key="k:s")
        with pytest.raises(IdempotencyConflictError, match="different input") as caught:
            await engine.enqueue_many(echo_task_v2, [Job(key="t")], idempotency_keys=["k:s"])
        assert caught.value.run_id == stored.run_id
        with pytest.raises(IdempotencyConflictError, match="version 2, not version 1"):
            await engine.enqueue_many(
                "contract.echo", [Job(key="s")], idempotency_keys=["k:s"], version=1
            )

    async def test_a_batch_racing_single_enqueues_of_its_keys(self, engine: Engine) -> None:
        keys = [f"race:{i}" for i in range(20)]
        jobs = [Job(key=k) for k in keys]

        async def singles() -> list[Any]:
            return [
                await engine.enqueue(echo_task_v2, job, idempotency_key=key)
                for job, key in zip(reversed(jobs), reversed(keys), strict=True)
            ]

        batch, single = await asyncio.gather(
            engine.enqueue_many(echo_task_v2, jobs, idempotency_keys=keys), singles()
        )
        by_key = {key: h.run_id for key, h in zip(keys, batch, strict=True)}
        assert {by_key[k]: h.run_id for k, h in zip(reversed(keys), single, strict=True)} == {
            h.run_id: h.run_id for h in single
        }, "both name the same run for every key"
        assert sum(h.created for h in batch) + sum(h.created for h in single) == 20
        assert len(await engine.list(limit=100)) == 20

    async def test_arguments_are_checked_before_anything_is_stored(self, engine: Engine) -> None:
        with pytest.raises(UsageError, match="idempotency_keys has 1 keys for 2 inputs"):
            await engine.enqueue_many(
                echo_task_v2, [Job(key="a"), Job(key="b")], idempotency_keys=["x"]
            )
        with pytest.raises(UsageError, match="inputs"):
            await engine.enqueue_many(echo_task_v2, {"key": "a"})  # type: ignore[misc]
        with pytest.raises(UsageError, match="priority"):
            await engine.enqueue_many(echo_task_v2, [Job(key="a")], priority=40000)
        assert len(await engine.list()) == 0

    async def test_concurrency_keys_count_every_run_of_a_batch(
        self, engine: Engine, tally: Tally
    ) -> None:
        gate = tally.gate("t1")
        handles = await engine.enqueue_many(keyed_task, [Job(key=f"t1:{i}") for i in range(5)])
        async with engine.worker(concurrency=5):
            await eventually(lambda: _inside(tally, "t1", 2))
            await asyncio.sleep(0.2)
            assert tally.business["most"]["t1"] == 2, "the key's limit holds across the batch"
            gate.set()
            for handle in handles:
                await handle.result(timeout=15)
        assert tally.business["most"]["t1"] == 2


async def _inside(tally: Tally, tenant: str, count: int) -> bool:
    inside = tally.business.get("inside")
    return inside is not None and inside[tenant] == count
