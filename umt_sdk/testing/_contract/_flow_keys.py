"""Keys that shape the flow at enqueue: singletons (skip, replace), debounce, per-key FIFO.

Singletons and sequences are concurrency keys of limit 1: the claim starts one run of the key
at a time. What a singleton adds is decided at the enqueue, serialized per key: concurrent
triggers never both store a run (`skip`), and concurrent replaces keep exactly one. A
debounced burst makes one run with the last input, started `period` after the last trigger
and at the latest `max_wait` after the first.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    Debounce,
    Engine,
    PayloadError,
    RunCanceledError,
    Singleton,
    TaskContext,
    TaskDefinition,
    UsageError,
    task,
)
from umt_sdk.testing._contract._base import Job, Tally, current_tally, echo_task, echo_task_v2
from umt_sdk.testing._contract._concurrency import keyed_task
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["FlowKeysContract"]

LONG = timedelta(seconds=60)


async def _inside(ctx: TaskContext[Job], group: str) -> None:
    """Count how many runs of `group` are inside at once; wait on the gate `ctx.input.key`
    (until opened, or until a cancel's abort signal)."""
    tally = current_tally()
    inside: Counter[str] = tally.business.setdefault("inside", Counter())
    most: Counter[str] = tally.business.setdefault("most", Counter())
    tally.business.setdefault("starts", []).append(ctx.input.key)
    inside[group] += 1
    most[group] = max(most[group], inside[group])
    try:
        tally.gate(ctx.input.key + ":in").set()
        gate = tally.gates.get(ctx.input.key)
        if gate is not None:
            opened = asyncio.ensure_future(gate.wait())
            aborted = asyncio.ensure_future(ctx.abort_event.wait())
            try:
                await asyncio.wait(
                    {opened, aborted}, timeout=20, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                opened.cancel()
                aborted.cancel()
        await asyncio.sleep(0.01)
    finally:
        inside[group] -= 1
    ctx.throw_if_canceled()


@task("contract.singleton", version=1)
async def singleton_task(ctx: TaskContext[Job]) -> str:
    """Counts the runs inside at once (one group); waits on the gate of its input's key."""

    async def body() -> None:
        await _inside(ctx, "singleton")

    await ctx.step.run("body", body)
    return ctx.input.key


@task("contract.debounced", version=1)
async def debounced_task(ctx: TaskContext[Job]) -> str:
    return ctx.input.key


@task("contract.sequenced", version=1)
async def sequenced_task(ctx: TaskContext[Job]) -> str:
    """Records its start; counts the runs of its sequence (the key's prefix) inside at once."""

    async def body() -> None:
        await _inside(ctx, ctx.input.key.split(":")[0])

    await ctx.step.run("body", body)
    return ctx.input.key


TASKS: tuple[TaskDefinition[Any, Any], ...] = (singleton_task, debounced_task, sequenced_task)
"""The tasks of this topic that the suite's engine registers."""


class FlowKeysContract:
    """Singletons, debounce and sequences (mixed into `BackendContract`, whose `engine`,
    `tally` and `harness` fixtures it uses)."""

    # -- singletons -------------------------------------------------------------------------

    async def test_a_singleton_skips_while_its_run_is_active_and_starts_again_after(
        self, engine: Engine
    ) -> None:
        first = await engine.enqueue(singleton_task, Job(key="s:1"), singleton=Singleton("s"))
        again = await engine.enqueue(singleton_task, Job(key="s:2"), singleton=Singleton("s"))
        other = await engine.enqueue(singleton_task, Job(key="o:1"), singleton=Singleton("o"))
        assert first.created
        assert not again.created
        assert again.run_id == first.run_id, "skip returns the active run's handle"
        assert other.created, "another key is another singleton"
        async with engine.worker(concurrency=4):
            assert await again.result(timeout=15) == "s:1", "the skipped input is not stored"
            assert await other.result(timeout=15) == "o:1"
            later = await engine.enqueue(
                singleton_task, Job(key="s:3"), singleton=Singleton("s", mode="skip")
            )
            assert later.created, "the key's run ended: a new trigger starts a new run"
            assert await later.result(timeout=15) == "s:3"
        page = await engine.list(task_name=singleton_task.name, concurrency_key="s")
        assert sorted(r.run_id for r in page.runs) == sorted([first.run_id, later.run_id])

    async def test_a_singleton_skips_for_a_running_and_a_waiting_run(
        self, engine: Engine, tally: Tally
    ) -> None:
        tally.gate("busy:1")  # the run waits on it: it stays running
        first = await engine.enqueue(singleton_task, Job(key="busy:1"), singleton=Singleton("b"))
        async with engine.worker(concurrency=4):
            await asyncio.wait_for(tally.gate("busy:1:in").wait(), timeout=15)
            again = await engine.enqueue(
                singleton_task, Job(key="busy:2"), singleton=Singleton("b")
            )
            assert (again.created, again.run_id) == (False, first.run_id)
            tally.gate("busy:1").set()
            assert await first.result(timeout=15) == "busy:1"
        assert tally.business["starts"] == ["busy:1"]

    async def test_concurrent_singleton_triggers_store_one_run(self, engine: Engine) -> None:
        for round_ in range(4):
            key = f"race{round_}"
            handles = await asyncio.gather(
                *(
                    engine.enqueue(singleton_task, Job(key=f"{key}:{i}"), singleton=Singleton(key))
                    for i in range(16)
                )
            )
            assert sum(h.created for h in handles) == 1
            assert len({h.run_id for h in handles}) == 1
            page = await engine.list(task_name=singleton_task.name, concurrency_key=key)
            assert len(page.runs) == 1

    async def test_a_skip_for_a_run_of_another_version_names_that_version(
        self, engine: Engine
    ) -> None:
        old = await engine.enqueue(
            echo_task, Job(key="v", n=1), version=1, singleton=Singleton("versions")
        )
        newer = await engine.enqueue(
            echo_task_v2, Job(key="v", n=2), singleton=Singleton("versions")
        )
        assert (newer.created, newer.run_id, newer.task_version) == (False, old.run_id, 1)
        async with engine.worker():
            assert await newer.result(timeout=15) == Job(key="V", n=2), "v1's output type"

    async def test_replace_cancels_the_active_run_and_the_new_one_runs_after_it(
        self, engine: Engine, tally: Tally
    ) -> None:
        tally.gate("r:1")  # nobody opens it: the first run runs until canceled
        first = await engine.enqueue(
            singleton_task, Job(key="r:1"), singleton=Singleton("r", mode="replace")
        )
        async with engine.worker(concurrency=4):
            await asyncio.wait_for(tally.gate("r:1:in").wait(), timeout=15)
            second = await engine.enqueue(
                singleton_task, Job(key="r:2"), singleton=Singleton("r", mode="replace")
            )
            assert second.created
            with pytest.raises(RunCanceledError) as caught:
                await first.result(timeout=15)
            assert "singleton" in caught.value.reason
            assert str(second.run_id) in caught.value.reason
            assert await second.result(timeout=15) == "r:2"
        assert tally.business["most"]["singleton"] == 1, "the new run started after the old"

    async def test_concurrent_replaces_keep_exactly_one_run(self, engine: Engine) -> None:
        handles = await asyncio.gather(
            *(
                engine.enqueue(
                    singleton_task,
                    Job(key=f"many:{i}"),
                    singleton=Singleton("many", mode="replace"),
                )
                for i in range(12)
            )
        )
        assert all(h.created for h in handles)
        page = await engine.list(task_name=singleton_task.name, concurrency_key="many")
        assert len(page.runs) == 12
        kept = [r for r in page.runs if r.status != "canceled"]
        assert len(kept) == 1, [(r.run_id, r.status) for r in page.runs]
        async with engine.worker(concurrency=4):
            handle = next(h for h in handles if h.run_id == kept[0].run_id)
            assert (await handle.result(timeout=15)).startswith("many:")

    async def test_a_singleton_refuses_bad_input_and_stores_nothing(self, engine: Engine) -> None:
        with pytest.raises(UsageError) as caught:
            Singleton("")
        assert caught.value.argument == "key"
        with pytest.raises(UsageError) as caught:
            Singleton("k", mode="newest")  # type: ignore[arg-type]  # the bad input under test
        assert caught.value.argument == "mode"
        refused: list[tuple[str, dict[str, Any]]] = [
            ("singleton", {"singleton": "k"}),
            (
                "debounce",
                {"singleton": Singleton("k"), "debounce": Debounce("k", timedelta(seconds=1))},
            ),
            ("sequence", {"singleton": Singleton("k"), "sequence": "k"}),
            ("singleton", {"singleton": Singleton("k"), "idempotency_key": "i"}),
        ]
        for argument, kwargs in refused:
            with pytest.raises(UsageError) as caught:
                await engine.enqueue(singleton_task, Job(key="bad"), **kwargs)
            assert caught.value.argument == argument, kwargs
        with pytest.raises(UsageError, match="concurrency") as caught:
            await engine.enqueue(keyed_task, Job(key="t:1"), singleton=Singleton("t"))
        assert caught.value.argument == "singleton"
        with pytest.raises(UsageError) as caught:
            await engine.enqueue(keyed_task, Job(key="t:1"), sequence="t")
        assert caught.value.argument == "sequence"
        for name in (singleton_task.name, keyed_task.name):
            assert not (await engine.list(task_name=name)).runs

    # -- debounce ---------------------------------------------------------------------------

    async def test_a_burst_collapses_into_one_run_with_the_last_input(self, engine: Engine) -> None:
        # No worker serves the task yet, so the run cannot start during the burst: the
        # triggers join it whatever time the enqueues take.
        debounce = Debounce("d", period=timedelta(milliseconds=200))
        handles = [
            await engine.enqueue(debounced_task, Job(key=f"d:{i}"), debounce=debounce)
            for i in range(5)
        ]
        other = await engine.enqueue(
            debounced_task, Job(key="e:0"), debounce=Debounce("e", timedelta(milliseconds=200))
        )
        assert [h.created for h in handles] == [True, False, False, False, False]
        assert len({h.run_id for h in handles}) == 1
        assert other.created
        assert other.run_id != handles[0].run_id
        async with engine.worker(concurrency=4):
            assert await handles[0].result(timeout=15) == "d:4", "the last input wins"
            assert await other.result(timeout=15) == "e:0"
            after = await engine.enqueue(debounced_task, Job(key="d:5"), debounce=debounce)
            assert after.created, "the run started: the next trigger makes a new one"
            assert await after.result(timeout=15) == "d:5"
        page = await engine.list(task_name=debounced_task.name)
        assert len(page.runs) == 3

    async def test_each_trigger_moves_the_start_but_never_past_max_wait(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        period = timedelta(seconds=30)
        bounded = Debounce("m", period=period, max_wait=timedelta(seconds=40))
        first = await engine.enqueue(debounced_task, Job(key="m:0"), debounce=bounded)
        head = await engine.backend.get_run_head(first.run_id)
        assert head is not None
        assert head.available_at == head.created_at + period
        await harness.advance(timedelta(milliseconds=50))
        again = await engine.enqueue(debounced_task, Job(key="m:1"), debounce=bounded)
        assert again.run_id == first.run_id
        moved = await engine.backend.get_run_head(first.run_id)
        assert moved is not None
        assert moved.available_at is not None
        assert bounded.max_wait is not None
        assert head.created_at + period < moved.available_at <= head.created_at + bounded.max_wait
        tight = Debounce("t", period=period, max_wait=period)
        first = await engine.enqueue(debounced_task, Job(key="t:0"), debounce=tight)
        await harness.advance(timedelta(milliseconds=50))
        await engine.enqueue(debounced_task, Job(key="t:1"), debounce=tight)
        held = await engine.backend.get_run_head(first.run_id)
        assert held is not None
        assert held.available_at == held.created_at + period, "max_wait from the first trigger"
        assert held.input_json != head.input_json

    async def test_a_debounce_refuses_bad_input_and_stores_nothing(self, engine: Engine) -> None:
        bad: list[tuple[str, Any]] = [
            ("key", lambda: Debounce("", timedelta(seconds=1))),
            ("period", lambda: Debounce("k", timedelta(0))),
            ("period", lambda: Debounce("k", timedelta(seconds=-1))),
            ("max_wait", lambda: Debounce("k", timedelta(seconds=5), timedelta(seconds=4))),
        ]
        for argument, make in bad:
            with pytest.raises(UsageError) as caught:
                make()
            assert caught.value.argument == argument
        debounce = Debounce("k", timedelta(seconds=1))
        refused: list[tuple[str, dict[str, Any]]] = [
            ("debounce", {"debounce": "k"}),
            ("delay", {"debounce": debounce, "delay": timedelta(seconds=1)}),
            ("start_within", {"debounce": debounce, "start_within": timedelta(seconds=1)}),
            ("debounce", {"debounce": debounce, "idempotency_key": "i"}),
            ("sequence", {"debounce": debounce, "sequence": "s"}),
        ]
        for argument, kwargs in refused:
            with pytest.raises(UsageError) as caught:
                await engine.enqueue(debounced_task, Job(key="bad"), **kwargs)
            assert caught.value.argument == argument, kwargs
        assert not (await engine.list(task_name=debounced_task.name)).runs

    # -- sequences --------------------------------------------------------------------------

    async def test_runs_of_a_sequence_start_one_at_a_time_in_enqueue_order(
        self, engine: Engine, tally: Tally
    ) -> None:
        handles = [
            await engine.enqueue(sequenced_task, Job(key=f"{seq}:{i}"), sequence=seq)
            for i in range(5)
            for seq in ("a", "b")
        ]
        async with engine.worker(concurrency=8):
            for handle in handles:
                await handle.result(timeout=30)
        starts = tally.business["starts"]
        for seq in ("a", "b"):
            assert [k for k in starts if k.startswith(seq + ":")] == [
                f"{seq}:{i}" for i in range(5)
            ]
        assert tally.business["most"] == Counter({"a": 1, "b": 1})

    async def test_a_sequence_waits_for_the_run_before_it_to_end(
        self, engine: Engine, tally: Tally
    ) -> None:
        tally.gate("q:0")
        first = await engine.enqueue(sequenced_task, Job(key="q:0"), sequence="q")
        second = await engine.enqueue(sequenced_task, Job(key="q:1"), sequence="q")
        free = await engine.enqueue(sequenced_task, Job(key="z:0"), sequence="z")
        async with engine.worker(concurrency=4):
            await asyncio.wait_for(tally.gate("q:0:in").wait(), timeout=15)
            assert await free.result(timeout=15) == "z:0", "another key is not held up"
            assert (await engine.get(second.run_id)).status == "pending"
            tally.gate("q:0").set()
            assert await second.result(timeout=15) == "q:1"
            assert await first.result(timeout=15) == "q:0"
        assert tally.business["starts"].index("q:0") < tally.business["starts"].index("q:1")
        assert (await engine.get(second.run_id)).concurrency_key == "q"

    async def test_a_rerun_and_a_fork_of_a_sequenced_run_keep_its_key_and_wait_their_turn(
        self, engine: Engine, tally: Tally
    ) -> None:
        done = await engine.enqueue(sequenced_task, Job(key="r:0"), sequence="r")
        async with engine.worker(concurrency=4):
            assert await done.result(timeout=15) == "r:0"
            tally.gate("r:1")  # the key's next run stays inside until the gate opens
            busy = await engine.enqueue(sequenced_task, Job(key="r:1"), sequence="r")
            await asyncio.wait_for(tally.gate("r:1:in").wait(), timeout=15)
            again = await engine.rerun(done.run_id)
            forked = await engine.fork(done.run_id, "body")
            # A run enqueued after them ends: the claim has passed over the two of key "r".
            free = await engine.enqueue(sequenced_task, Job(key="y:0"), sequence="y")
            assert await free.result(timeout=15) == "y:0"
            for handle in (again, forked):
                info = await engine.get(handle.run_id)
                assert (info.concurrency_key, info.status) == ("r", "pending"), info
            tally.gate("r:1").set()
            assert await busy.result(timeout=15) == "r:1"
            assert await again.result(timeout=15) == "r:0"
            assert await forked.result(timeout=15) == "r:0"
        assert tally.business["most"]["r"] == 1, "one run of the key inside at a time"
        starts = tally.business["starts"]
        assert starts.index("r:1") < len(starts) - 2, "the rerun and the fork started after r:1"

    # -- in a batch (enqueue_many) ----------------------------------------------------------

    async def test_a_batch_with_sequence_keys_starts_each_key_in_the_order_given(
        self, engine: Engine, tally: Tally
    ) -> None:
        jobs = [Job(key=f"{seq}:{i}") for i in range(4) for seq in ("ba", "bb")]
        handles = await engine.enqueue_many(
            sequenced_task, jobs, sequence=[job.key.split(":")[0] for job in jobs]
        )
        one_key = await engine.enqueue_many(sequenced_task, [Job(key="bc:0")], sequence="bc")
        assert (await engine.get(handles[1].run_id)).concurrency_key == "bb"
        async with engine.worker(concurrency=8):
            for handle in [*handles, *one_key]:
                await handle.result(timeout=30)
        starts = tally.business["starts"]
        for seq in ("ba", "bb"):
            assert [k for k in starts if k.startswith(seq + ":")] == [
                f"{seq}:{i}" for i in range(4)
            ]
        assert tally.business["most"] == Counter({"ba": 1, "bb": 1, "bc": 1})

    async def test_a_batch_of_debounces_makes_one_run_per_key_with_its_last_input(
        self, engine: Engine
    ) -> None:
        d, e = (Debounce(k, period=timedelta(milliseconds=200)) for k in ("bd", "be"))
        handles = await engine.enqueue_many(
            debounced_task,
            [Job(key="bd:0"), Job(key="be:0"), Job(key="bd:1"), Job(key="bd:2")],
            debounce=[d, e, d, d],
        )
        assert [h.created for h in handles] == [True, True, False, False]
        assert handles[0].run_id == handles[2].run_id == handles[3].run_id != handles[1].run_id
        async with engine.worker(concurrency=4):
            assert await handles[0].result(timeout=15) == "bd:2", "the last input wins"
            assert await handles[1].result(timeout=15) == "be:0"
        assert len((await engine.list(task_name=debounced_task.name)).runs) == 2

    async def test_a_batch_of_singletons_stores_one_run_per_key(self, engine: Engine) -> None:
        handles = await engine.enqueue_many(
            singleton_task,
            [Job(key="bs:1"), Job(key="bs:2"), Job(key="bo:1")],
            singleton=[Singleton("bs"), Singleton("bs"), Singleton("bo")],
        )
        assert [h.created for h in handles] == [True, False, True]
        assert handles[1].run_id == handles[0].run_id
        same = await engine.enqueue_many(
            singleton_task, [Job(key="bt:1"), Job(key="bt:2")], singleton=Singleton("bt")
        )
        assert [h.created for h in same] == [True, False]
        async with engine.worker(concurrency=4):
            assert await handles[1].result(timeout=15) == "bs:1", "the skipped input is not stored"
            assert await same[1].result(timeout=15) == "bt:1"
        assert len((await engine.list(task_name=singleton_task.name)).runs) == 3

    async def test_batch_keys_refuse_bad_input_and_store_nothing(self, engine: Engine) -> None:
        debounce = Debounce("bk", timedelta(seconds=1))
        two = [Job(key="bad:0"), Job(key="bad:1")]
        refused: list[tuple[str, TaskDefinition[Any, Any], dict[str, Any]]] = [
            ("sequence", sequenced_task, {"sequence": ["a"]}),
            ("sequence", sequenced_task, {"sequence": ["a", 3]}),
            ("sequence", keyed_task, {"sequence": "a"}),
            ("singleton", singleton_task, {"singleton": "s"}),
            ("singleton", singleton_task, {"singleton": [Singleton("s")] * 3}),
            ("debounce", debounced_task, {"debounce": {"key": "k"}}),
            ("debounce", debounced_task, {"debounce": debounce, "idempotency_keys": ["i", None]}),
            ("delay", debounced_task, {"debounce": debounce, "delay": timedelta(seconds=1)}),
            ("sequence", debounced_task, {"debounce": [debounce, None], "sequence": "s"}),
        ]
        for argument, target, kwargs in refused:
            with pytest.raises(UsageError) as caught:
                await engine.enqueue_many(target, two, **kwargs)
            assert caught.value.argument == argument, kwargs
        with pytest.raises(PayloadError):  # the second input is bad: the first is not stored
            await engine.enqueue_many(
                debounced_task.name, [Job(key="ok"), {"n": 1}], debounce=debounce
            )
        for name in (
            singleton_task.name,
            debounced_task.name,
            sequenced_task.name,
            keyed_task.name,
        ):
            assert not (await engine.list(task_name=name)).runs
