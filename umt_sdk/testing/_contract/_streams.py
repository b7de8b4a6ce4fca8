"""Streams out of a run: values written in order, read back in order (all, since a seq, the
newest), followed live until the run ends, and never duplicated by code that runs again (a
step re-run after a crash, a handler replaying); a step retried after a failure writes anew.
Also the store itself (`StreamStore`), driven at the seam: first write wins per key, one seq
per stream, fenced writes."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    Engine,
    PayloadError,
    RetryPolicy,
    StreamItem,
    SyncTaskContext,
    TaskContext,
    TaskDefinition,
    UsageError,
    task,
)
from umt_sdk._probe import Point, observing
from umt_sdk.backend import (
    Ending,
    Lease,
    NewRun,
    StreamAppend,
    StreamStore,
    TaskPair,
    new_run_id,
)
from umt_sdk.exceptions import FencingError, RunNotFoundError
from umt_sdk.testing._contract._base import Job, Tally, current_tally, eventually, holds
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["StreamsContract"]

_FAST_RETRY = RetryPolicy(max_attempts=2, initial=timedelta(milliseconds=50))


@task("contract.streams", version=1, retry=_FAST_RETRY)
async def streams_task(ctx: TaskContext[Job]) -> int:
    """Writes `progress` {done, total} before, in and after its step `work`, and `log` lines
    in the step. By the key: `gate...` waits in the step after its first value until the test
    opens the gate; `retry...` fails the step's first attempt after its values; `replay...`
    sleeps at the end (one more execution, replaying everything above)."""
    key, total = ctx.input.key, ctx.input.n
    tally = current_tally()
    await ctx.stream.write("progress", {"done": 0, "total": total})

    async def work() -> int:
        tally.body_runs[(key, "work")] += 1
        for done in range(1, total + 1):
            await ctx.stream.write("progress", {"done": done, "total": total})
            await ctx.stream.write("log", f"item {done}")
            if done == 1 and key.startswith("gate"):
                await tally.gate(key).wait()
        if key.startswith("retry") and tally.body_runs[(key, "work")] == 1:
            raise ValueError("the first attempt fails after writing")
        return total

    count = await ctx.step.run("work", work)
    await ctx.stream.write("progress", {"done": count, "total": total, "finished": True})
    if key.startswith("replay"):
        await ctx.step.sleep("nap", timedelta(milliseconds=200))
    return count


@task("contract.streams_sync", version=1)
def sync_streams_task(ctx: SyncTaskContext[Job]) -> int:
    """The same from a plain task: the handler's thread and the step's thread both write."""
    ctx.stream.write("progress", 0)

    def work() -> int:
        for done in range(1, ctx.input.n + 1):
            ctx.stream.write("progress", done)
        return ctx.input.n

    count: int = ctx.step.run("work", work)
    ctx.stream.write("progress", "done")
    return count


@task("contract.streams_refused", version=1)
async def refused_task(ctx: TaskContext[Job]) -> list[str]:
    """Writes what a stream refuses and reports each error."""
    errors = []
    for name, value in (
        ("bad name!", 1),
        ("", 1),
        ("progress", "x" * (64 * 1024 + 1)),
        ("progress", float("nan")),
    ):
        try:
            await ctx.stream.write(name, value)
        except (UsageError, PayloadError) as exc:
            errors.append(type(exc).__name__)
    await ctx.stream.write("progress", "é" * (32 * 1024 - 1))  # 65,536 bytes with its quotes
    return errors


TASKS: tuple[TaskDefinition[Any, Any], ...] = (streams_task, sync_streams_task, refused_task)
"""The tasks of this topic that the suite's engine registers."""

_SPI_PAIR = TaskPair(name="contract.streams.spi", version=1)
"""No worker serves it: the store tests claim their runs themselves."""


def _progress(total: int) -> list[dict[str, Any]]:
    """What `streams_task` writes to `progress` once, in order."""
    return [{"done": done, "total": total} for done in range(total + 1)] + [
        {"done": total, "total": total, "finished": True}
    ]


async def _all(engine: Engine, run_id: Any, name: str, **options: Any) -> list[StreamItem]:
    return [item async for item in engine.stream(run_id, name, **options)]


def _store(engine: Engine) -> StreamStore:
    backend = engine.backend
    assert isinstance(backend, StreamStore), "the backends under the suite store streams"
    return backend


async def _held_run(engine: Engine) -> Lease:
    """A run of the store tests' pair, claimed by the test: its lease."""
    backend = engine.backend
    run_id = new_run_id()
    await backend.enqueue(
        NewRun(
            run_id=run_id,
            task_name=_SPI_PAIR.name,
            task_version=_SPI_PAIR.version,
            input_json="null",
            input_hash="contract-streams",
        )
    )
    for _ in range(300):
        claimed = await backend.claim(
            worker_id="contract-streams", pairs=[_SPI_PAIR], limit=1, lease=timedelta(seconds=60)
        )
        if claimed:
            return Lease(
                run_id=claimed[0].run_id,
                fencing_token=claimed[0].fencing_token,
                worker_id="contract-streams",
                duration=timedelta(seconds=60),
            )
        await asyncio.sleep(0.05)
    raise AssertionError("the store tests' run was never claimed")


class StreamsContract:
    """Streams on every backend."""

    async def test_values_are_read_back_in_order_and_the_newest_is_at_hand(
        self, engine: Engine
    ) -> None:
        handle = await engine.enqueue(streams_task, Job(key="order", n=3))
        async with engine.worker():
            assert await handle.result(timeout=15) == 3
        items = await _all(engine, handle.run_id, "progress")
        assert [item.value for item in items] == _progress(3)
        assert [item.seq for item in items] == [1, 2, 3, 4, 5]
        assert {(item.run_id, item.stream) for item in items} == {(handle.run_id, "progress")}
        assert [i.written_at for i in items] == sorted(i.written_at for i in items)
        logs = await _all(engine, handle.run_id, "log")
        assert [item.value for item in logs] == ["item 1", "item 2", "item 3"]
        last = await engine.stream_last(handle.run_id, "progress")
        assert last == items[-1]
        heads = await engine.stream_heads([handle.run_id])
        assert dict(heads[handle.run_id]) == {"log": logs[-1], "progress": items[-1]}
        only = await engine.stream_heads([handle.run_id], name="log")
        assert list(only[handle.run_id]) == ["log"]

    async def test_since_gives_what_came_after_a_seq(self, engine: Engine) -> None:
        handle = await engine.enqueue(streams_task, Job(key="since", n=3))
        async with engine.worker():
            await handle.result(timeout=15)
        later = await _all(engine, handle.run_id, "progress", since=3)
        assert [(item.seq, item.value) for item in later] == [
            (4, {"done": 3, "total": 3}),
            (5, {"done": 3, "total": 3, "finished": True}),
        ]
        assert await _all(engine, handle.run_id, "progress", since=5) == []
        assert await _all(engine, handle.run_id, "nothing") == []

    async def test_a_follower_sees_values_live_and_ends_when_the_run_ends(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(streams_task, Job(key="gate-live", n=2))
        async with engine.worker():
            items = engine.stream(handle.run_id, "progress")
            seen = [await anext(items), await anext(items)]
            # The step waits for the gate after its first value: the run is still going.
            assert (await engine.get(handle.run_id)).status == "running"
            assert [item.value for item in seen] == _progress(2)[:2]
            tally.gate("gate-live").set()
            seen += [item async for item in items]
        assert [item.value for item in seen] == _progress(2)
        assert (await engine.get(handle.run_id)).status == "completed"

    async def test_a_follower_started_before_the_first_value_waits_for_it(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(streams_task, Job(key="gate-early", n=1))
        follower = asyncio.create_task(_all(engine, handle.run_id, "log"))
        async with engine.worker():
            await eventually(lambda: holds(tally.body_runs[("gate-early", "work")] == 1))
            tally.gate("gate-early").set()
            assert [item.value for item in await follower] == ["item 1"]

    async def test_a_step_run_again_after_a_crash_does_not_write_twice(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        crashed: list[Point] = []

        def crash_once_after_work(point: Point) -> bool:
            if point.kind == "step.returned" and point.name == "work" and not crashed:
                crashed.append(point)
                return True  # its values are stored, its record is not
            return False

        handle = await engine.enqueue(streams_task, Job(key="crash", n=3))
        with observing(crash_once_after_work):
            worker = engine.worker(lease=harness.lease)
            await worker.start()
        try:
            await eventually(lambda: holds(bool(crashed)))
            await harness.advance(harness.lease * 2)
            assert await handle.result(timeout=20) == 3
        finally:
            await worker.stop()
        assert tally.body_runs[("crash", "work")] == 2, "the step ran again"
        items = await _all(engine, handle.run_id, "progress")
        assert [item.value for item in items] == _progress(3)
        assert [item.value for item in await _all(engine, handle.run_id, "log")] == [
            "item 1",
            "item 2",
            "item 3",
        ]

    async def test_a_replaying_handler_does_not_write_twice(self, engine: Engine) -> None:
        handle = await engine.enqueue(streams_task, Job(key="replay", n=2))
        async with engine.worker():
            assert await handle.result(timeout=15) == 2
        info = await engine.get(handle.run_id)
        assert len(info.executions) == 2, "the sleep made a second execution, which replayed"
        items = await _all(engine, handle.run_id, "progress")
        assert [item.value for item in items] == _progress(2)
        keys = [
            e.key
            for e in await _store(engine).read_stream(handle.run_id, "progress", after=0, limit=10)
        ]
        # Outside a step: the step calls made before, and the position since; inside: the
        # step's name, its attempt and the position in it.
        assert keys == ["run:0:0", "step:work:1:0", "step:work:1:1", "run:1:0"]

    async def test_a_step_retried_after_a_failure_writes_new_values(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(streams_task, Job(key="retry", n=2))
        async with engine.worker():
            assert await handle.result(timeout=15) == 2
        assert tally.body_runs[("retry", "work")] == 2
        items = await _all(engine, handle.run_id, "progress")
        attempt = [{"done": 1, "total": 2}, {"done": 2, "total": 2}]
        assert [item.value for item in items] == [
            {"done": 0, "total": 2},
            *attempt,  # the first attempt, which failed
            *attempt,  # the retry: a new attempt, new entries
            {"done": 2, "total": 2, "finished": True},
        ]

    async def test_a_plain_task_writes_from_its_thread_and_its_steps(self, engine: Engine) -> None:
        handle = await engine.enqueue(sync_streams_task, Job(key="sync", n=2))
        async with engine.worker():
            assert await handle.result(timeout=15) == 2
        items = await _all(engine, handle.run_id, "progress")
        assert [item.value for item in items] == [0, 1, 2, "done"]
        entries = await _store(engine).read_stream(handle.run_id, "progress", after=0, limit=10)
        assert [e.key for e in entries] == ["run:0:0", "step:work:1:0", "step:work:1:1", "run:1:0"]

    async def test_what_a_stream_refuses(self, engine: Engine) -> None:
        handle = await engine.enqueue(refused_task, Job(key="refused"))
        async with engine.worker():
            assert await handle.result(timeout=15) == [
                "UsageError",
                "UsageError",
                "PayloadError",
                "PayloadError",
            ]
        last = await engine.stream_last(handle.run_id, "progress")
        assert last is not None
        assert last.value == "é" * (32 * 1024 - 1), "64 KiB is allowed"
        with pytest.raises(UsageError, match="stream name"):
            engine.stream(handle.run_id, "no spaces")
        with pytest.raises(UsageError, match="since"):
            engine.stream(handle.run_id, "progress", since=-1)
        with pytest.raises(UsageError, match="run id"):
            engine.stream("not-a-uuid", "progress")  # type: ignore[arg-type]

    async def test_an_unknown_run_or_stream(self, engine: Engine) -> None:
        missing = new_run_id()
        with pytest.raises(RunNotFoundError):
            await _all(engine, missing, "progress")
        with pytest.raises(RunNotFoundError):
            await engine.stream_last(missing, "progress")
        assert await engine.stream_heads([missing]) == {}
        handle = await engine.enqueue(streams_task, Job(key="quiet", n=0))
        assert await engine.stream_last(handle.run_id, "progress") is None
        assert await _all(engine, handle.run_id, "progress", follow=False) == []

    # -- the store at the seam -------------------------------------------------------------------

    async def test_the_store_numbers_each_stream_and_keeps_the_first_write_of_a_key(
        self, engine: Engine
    ) -> None:
        store = _store(engine)
        lease = await _held_run(engine)
        entries = await store.append_stream(
            lease,
            [
                StreamAppend(stream="s", key="a", value_json='{"x": 1}'),
                StreamAppend(stream="s", key="b", value_json="2"),
                StreamAppend(stream="t", key="a", value_json='"t"'),
            ],
        )
        assert [(e.stream, e.seq, e.key) for e in entries] == [
            ("s", 1, "a"),
            ("s", 2, "b"),
            ("t", 1, "a"),
        ]
        again = await store.append_stream(
            lease, [StreamAppend(stream="s", key="a", value_json='"another value"')]
        )
        assert [(e.seq, json.loads(e.value_json)) for e in again] == [(1, {"x": 1})]
        assert again[0].written_at == entries[0].written_at
        assert [e.seq for e in await store.read_stream(lease.run_id, "s", after=0, limit=10)] == [
            1,
            2,
        ]
        assert [e.seq for e in await store.read_stream(lease.run_id, "s", after=1, limit=10)] == [2]
        assert [e.seq for e in await store.read_stream(lease.run_id, "s", after=0, limit=1)] == [1]
        assert await store.read_stream(lease.run_id, "u", after=0, limit=10) == []
        newest = await store.last_stream_entries([lease.run_id, new_run_id()])
        assert sorted((e.stream, e.seq) for e in newest) == [("s", 2), ("t", 1)]
        only = await store.last_stream_entries([lease.run_id], "t")
        assert [(e.stream, e.seq, json.loads(e.value_json)) for e in only] == [("t", 1, "t")]

    async def test_the_store_refuses_a_write_of_a_run_no_longer_held(self, engine: Engine) -> None:
        store = _store(engine)
        lease = await _held_run(engine)
        await store.append_stream(lease, [StreamAppend(stream="s", key="a", value_json="1")])
        ended = await engine.backend.end_execution(
            lease, Ending(status="completed", outcome="completed", output_json="null")
        )
        assert ended == "ended"
        with pytest.raises(FencingError):
            await store.append_stream(lease, [StreamAppend(stream="s", key="b", value_json="2")])
        with pytest.raises(FencingError):  # even a key it stored: the fence comes first
            await store.append_stream(lease, [StreamAppend(stream="s", key="a", value_json="1")])
        assert [e.key for e in await store.read_stream(lease.run_id, "s", after=0, limit=10)] == [
            "a"
        ]
