"""Fairness keys: within a task, the keys' due runs take turns in the claim, least recently
served key first, each turn up to the key's weight; a key's backlog delays another key's run
by one turn at most. Bad input is refused before anything is stored.

The turns are driven through the SPI, as the worker claims, so what each claim takes is exact,
not timed; one test runs a real worker end to end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest

from umt_sdk import Engine, Singleton, TaskContext, TaskDefinition, UsageError, task
from umt_sdk.backend import Backend, Ending, Lease, NewRun, TaskPair, new_run_id
from umt_sdk.testing._contract._base import Job, Tally, current_tally
from umt_sdk.testing._contract._concurrency import keyed_task

__all__ = ["FairnessContract"]

PAIR = TaskPair(name="contract.fair_spi", version=1)
"""No worker serves it: every claim of it in these tests is the test's own."""
LONG = timedelta(seconds=60)
WORKER = "contract-fair"
FAIR_SLOTS = 2_147_483_647
DONE = Ending(status="completed", outcome="completed", output_json="null")


@task("contract.fair", version=1)
async def fair_task(ctx: TaskContext[Job]) -> str:
    """Notes the order the runs start in."""
    current_tally().business.setdefault("starts", []).append(ctx.input.key)
    return ctx.input.key


TASKS: tuple[TaskDefinition[Any, Any], ...] = (fair_task,)
"""The tasks of this topic that the suite's engine registers."""


def _new(key: str | None, *, weight: int = 1, priority: int = 0) -> NewRun:
    fields: dict[str, Any] = {}
    if key is not None:
        fields = {
            "concurrency_key": key,
            "concurrency_limit": FAIR_SLOTS,
            "fairness_weight": weight,
        }
    return NewRun(
        run_id=new_run_id(),
        task_name=PAIR.name,
        task_version=PAIR.version,
        input_json="null",
        input_hash="contract-fair",
        priority=priority,
        **fields,
    )


async def _backlog(backend: Backend, key: str, runs: int, *, weight: int = 1) -> list[UUID]:
    return [await _one(backend, key, weight=weight) for _ in range(runs)]


async def _one(backend: Backend, key: str | None, **kwargs: Any) -> UUID:
    new = _new(key, **kwargs)
    assert (await backend.enqueue(new)).created
    return new.run_id


async def _claim(backend: Backend, limit: int) -> list[UUID]:
    """The runs one claim takes, each ended at once (as a worker's quick runs would be)."""
    claimed = await backend.claim(worker_id=WORKER, pairs=[PAIR], limit=limit, lease=LONG)
    for c in claimed:
        lease = Lease(
            run_id=c.run_id, fencing_token=c.fencing_token, worker_id=WORKER, duration=LONG
        )
        assert await backend.end_execution(lease, DONE) == "ended"
    return [c.run_id for c in claimed]


def _keys(claimed: Sequence[UUID], owners: dict[UUID, str]) -> Counter[str]:
    return Counter(owners[run_id] for run_id in claimed)


class FairnessContract:
    """Keys take weighted turns (mixed into `BackendContract`, whose `engine` fixture it uses)."""

    async def test_a_keys_backlog_delays_another_keys_run_by_one_turn_at_most(
        self, engine: Engine
    ) -> None:
        backend = engine.backend
        busy = await _backlog(backend, "busy", 40)
        assert await _claim(backend, 1) == [busy[0]]
        quiet = await _one(backend, "quiet")
        assert await _claim(backend, 1) == [quiet], "never served: its turn comes first"
        assert await _claim(backend, 1) == [busy[1]]
        late = await _one(backend, "quiet")
        assert set(await _claim(backend, 2)) == {late, busy[2]}, "one run of each key's turn"

    async def test_a_turn_takes_up_to_the_keys_weight_in_fifo_order(self, engine: Engine) -> None:
        backend = engine.backend
        owners: dict[UUID, str] = {}
        lines: dict[str, list[UUID]] = {}
        for key, weight in (("heavy", 3), ("light", 1), ("mid", 2)):
            lines[key] = await _backlog(backend, key, 9, weight=weight)
            owners.update(dict.fromkeys(lines[key], key))
        taken: list[UUID] = []
        for _ in range(3):
            claimed = await _claim(backend, 6)
            assert _keys(claimed, owners) == Counter({"heavy": 3, "mid": 2, "light": 1})
            taken += claimed
        for key, line in lines.items():
            assert [r for r in taken if owners[r] == key] == line[
                : len([r for r in taken if owners[r] == key])
            ], f"FIFO within {key}"

    async def test_a_claim_with_room_takes_more_rounds(self, engine: Engine) -> None:
        backend = engine.backend
        alone = await _backlog(backend, "alone", 20)
        assert await _claim(backend, 8) == alone[:8], "one key fills the batch, FIFO"
        owners = dict.fromkeys(alone, "alone")
        owners.update(dict.fromkeys(await _backlog(backend, "other", 20), "other"))
        assert _keys(await _claim(backend, 8), owners) == Counter({"alone": 4, "other": 4})

    async def test_a_run_without_a_key_waits_one_turn_at_most_behind_a_backlog(
        self, engine: Engine
    ) -> None:
        backend = engine.backend
        busy = await _backlog(backend, "busy", 20)
        assert await _claim(backend, 1) == [busy[0]]
        plain = await _one(backend, None)
        got = await _claim(backend, 1) + await _claim(backend, 1)
        assert set(got) == {plain, busy[1]}

    async def test_a_claim_takes_from_the_keys_least_recently_served_then_by_priority(
        self, engine: Engine
    ) -> None:
        """With more keys due than a claim takes runs, the claim takes from the `limit` keys
        least recently served, and among their runs the higher priority first: a key just
        served waits its turn even for an urgent run (one turn at most)."""
        backend = engine.backend
        first = await _one(backend, "a")
        assert await _claim(backend, 1) == [first]
        urgent = await _one(backend, "a", priority=9)
        waiting = await _one(backend, "b")
        assert await _claim(backend, 1) == [waiting], "b's turn: a was served last"
        assert await _claim(backend, 1) == [urgent]
        low = await _one(backend, "c")
        high = await _one(backend, "d", priority=9)
        assert await _claim(backend, 2) == [high, low], "both keys' turn: priority decides"

    async def test_a_key_offers_its_weights_share_of_a_claim(self, engine: Engine) -> None:
        """Each key picked offers its weight's share of the claim (`limit` over the keys
        picked, rounded up, times the weight): a key with a short line leaves its share
        unused this claim rather than a long line taking it."""
        backend = engine.backend
        owners = dict.fromkeys(await _backlog(backend, "long", 10), "long")
        owners.update(dict.fromkeys(await _backlog(backend, "short", 1), "short"))
        assert _keys(await _claim(backend, 6), owners) == Counter({"long": 3, "short": 1})
        assert _keys(await _claim(backend, 6), owners) == Counter({"long": 6})

    async def test_priority_orders_the_runs_of_a_key(self, engine: Engine) -> None:
        backend = engine.backend
        low = await _one(backend, "k")
        high = await _one(backend, "k", priority=5)
        assert await _claim(backend, 1) == [high]
        assert await _claim(backend, 1) == [low]
        assert await _claim(backend, 1) == []

    async def test_the_newest_enqueues_weight_is_the_keys(self, engine: Engine) -> None:
        backend = engine.backend
        owners: dict[UUID, str] = {}
        owners.update(dict.fromkeys(await _backlog(backend, "a", 6, weight=4), "a"))
        owners.update(dict.fromkeys(await _backlog(backend, "b", 6, weight=1), "b"))
        owners[await _one(backend, "a", weight=2)] = "a"
        # Rounds of 2 and 1: a a b a a b (weight 4 would make it a a a a b a).
        assert _keys(await _claim(backend, 6), owners) == Counter({"a": 4, "b": 2})

    async def test_runs_enqueued_with_a_fairness_key_start_in_turns(
        self, engine: Engine, tally: Tally
    ) -> None:
        handles = [
            await engine.enqueue(fair_task, Job(key=f"busy:{i}"), fairness_key="busy")
            for i in range(8)
        ]
        handles.append(await engine.enqueue(fair_task, Job(key="quiet:0"), fairness_key="quiet"))
        page = await engine.list(task_name=fair_task.name, concurrency_key="quiet")
        assert [r.run_id for r in page.runs] == [handles[-1].run_id]
        async with engine.worker(concurrency=1):
            for handle in handles:
                await handle.result(timeout=30)
        starts = tally.business["starts"]
        assert starts.index("quiet:0") <= 1, starts
        assert [k for k in starts if k.startswith("busy:")] == [f"busy:{i}" for i in range(8)]

    async def test_a_rerun_keeps_the_runs_fairness_key_and_weight(self, engine: Engine) -> None:
        done = await engine.enqueue(fair_task, Job(key="f:0"), fairness_key="f", weight=2)
        first = await engine.backend.get_run_head(done.run_id)
        assert first is not None
        assert first.fairness_weight == 2
        async with engine.worker(concurrency=2):
            assert await done.result(timeout=15) == "f:0"
            again = await engine.rerun(done.run_id)
            assert await again.result(timeout=15) == "f:0"
        record = await engine.backend.get_run_head(again.run_id)
        assert record is not None
        assert (record.concurrency_key, record.fairness_weight) == ("f", 2)
        plain = await engine.enqueue(fair_task, Job(key="p:0"))
        unkeyed = await engine.backend.get_run_head(plain.run_id)
        assert unkeyed is not None
        assert unkeyed.fairness_weight is None

    async def test_a_batch_takes_a_fairness_key_and_weight_per_input(self, engine: Engine) -> None:
        handles = await engine.enqueue_many(
            fair_task,
            [Job(key="m:0"), Job(key="m:1"), Job(key="m:2")],
            fairness_key=["a", "b", None],
            weight=[3, None, None],
        )
        heads = [await engine.backend.get_run_head(h.run_id) for h in handles]
        assert [(h.concurrency_key, h.fairness_weight) for h in heads if h is not None] == [
            ("a", 3),
            ("b", 1),
            (None, None),
        ]
        same = await engine.enqueue_many(fair_task, [Job(key="m:3")], fairness_key="a", weight=2)
        head = await engine.backend.get_run_head(same[0].run_id)
        assert head is not None
        assert (head.concurrency_key, head.fairness_weight) == ("a", 2)
        for argument, kwargs in (
            ("weight", {"fairness_key": "a", "weight": [1, 0]}),
            ("weight", {"weight": 2}),
            ("fairness_key", {"fairness_key": ["a"]}),
            ("fairness_key", {"fairness_key": ["a", ""]}),
        ):
            with pytest.raises(UsageError) as caught:
                await engine.enqueue_many(fair_task, [Job(key="bad:0"), Job(key="bad:1")], **kwargs)
            assert caught.value.argument == argument, kwargs
        stored = (await engine.list(task_name=fair_task.name)).runs
        assert sorted(r.run_id for r in stored) == sorted(h.run_id for h in [*handles, *same])

    async def test_bad_fairness_input_is_refused_and_nothing_stored(self, engine: Engine) -> None:
        refused: list[tuple[str, dict[str, Any]]] = [
            ("weight", {"fairness_key": "t", "weight": 0}),
            ("weight", {"fairness_key": "t", "weight": -2}),
            ("weight", {"fairness_key": "t", "weight": 1.5}),
            ("weight", {"fairness_key": "t", "weight": True}),
            ("weight", {"fairness_key": "t", "weight": 1001}),
            ("weight", {"weight": 2}),
            ("fairness_key", {"fairness_key": ""}),
            ("fairness_key", {"fairness_key": "x" * 256}),
            ("fairness_key", {"fairness_key": 7}),
            ("fairness_key", {"fairness_key": "t", "sequence": "t"}),
            ("fairness_key", {"fairness_key": "t", "singleton": Singleton("t")}),
        ]
        for argument, kwargs in refused:
            with pytest.raises(UsageError) as caught:
                await engine.enqueue(fair_task, Job(key="bad"), **kwargs)
            assert caught.value.argument == argument, kwargs
            assert argument in str(caught.value), kwargs
        with pytest.raises(UsageError, match="concurrency") as caught:
            await engine.enqueue(keyed_task, Job(key="t:1"), fairness_key="t")
        assert caught.value.argument == "fairness_key"
        for name in (fair_task.name, keyed_task.name):
            assert not (await engine.list(task_name=name)).runs
