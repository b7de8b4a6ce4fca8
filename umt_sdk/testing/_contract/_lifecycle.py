"""Pause and resume, rerun and fork: a paused pair's runs are never claimed and wait unharmed
until the resume; a rerun starts afresh; a fork keeps the records before its step (and the old
run's facts, and its completed children) and executes from there. For a backend that
implements `umt_sdk.backend.LifecycleStore`."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    Engine,
    RetryPolicy,
    RunFailedError,
    TaskContext,
    TaskDefinition,
    UsageError,
    task,
)
from umt_sdk._engine import new_run_id
from umt_sdk._spi import LifecycleStore, NewRun, StepRecord, TaskPair
from umt_sdk.exceptions import RunNotFoundError
from umt_sdk.testing._contract._base import (
    Job,
    Tally,
    current_tally,
    echo_task,
    echo_task_v2,
    eventually,
    holds,
    other_task,
    steps_task,
    wait_until,
)
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["LifecycleContract"]

_ONCE = RetryPolicy(max_attempts=1)


def _count(key: str, body: str) -> int:
    tally = current_tally()
    tally.body_runs[(key, body)] += 1
    return tally.body_runs[(key, body)]


async def _forkable(ctx: TaskContext[Job], *, fixed: bool) -> str:
    """prepare, a fact wait, submit (broken until the tally says it is fixed), finish."""
    key = ctx.input.key
    prepared = await ctx.step.run("prepare", lambda: f"prepared {_count(key, 'prepare')}")
    approval: str = await ctx.step.wait_for_fact(f"approval:{key}")

    def submit() -> str:
        _count(key, "submit")
        if not fixed and not current_tally().business.get(f"fixed:{key}"):
            raise RuntimeError("the submit is broken")
        return "submitted"

    submitted = await ctx.step.run("submit", submit, retry=_ONCE)
    finished = await ctx.step.run("finish", lambda: f"finished {_count(key, 'finish')}")
    return f"{prepared}, {approval}, {submitted}, {finished}, v{ctx.task_version}"


@task("contract.forkable", version=1, retry=_ONCE)
async def forkable_v1(ctx: TaskContext[Job]) -> str:
    return await _forkable(ctx, fixed=False)


@task("contract.forkable", version=2, retry=_ONCE)
async def forkable_v2(ctx: TaskContext[Job]) -> str:
    return await _forkable(ctx, fixed=True)


@task("contract.napper", version=1)
async def napper_task(ctx: TaskContext[Job]) -> str:
    await ctx.step.run("before", lambda: _count(ctx.input.key, "before"))
    await ctx.step.sleep("nap", timedelta(milliseconds=ctx.input.n))
    await ctx.step.run("after", lambda: _count(ctx.input.key, "after"))
    return "rested"


@task("contract.fork_child", version=1, retry=_ONCE)
async def fork_child_task(ctx: TaskContext[Job]) -> str:
    _count(ctx.input.key, "child")
    if ctx.input.n == 2 and not current_tally().business.get(f"fixed:{ctx.input.key}"):
        raise ValueError(f"child {ctx.input.key} is broken")
    return f"child {ctx.input.n}"


@task("contract.fork_parent", version=1, retry=_ONCE)
async def fork_parent_task(ctx: TaskContext[Job]) -> str:
    """Two children; the second fails until fixed, which fails the parent."""
    key = ctx.input.key
    one = await ctx.step.start_child("one", fork_child_task, Job(key=f"{key}-1", n=1))
    two = await ctx.step.start_child("two", fork_child_task, Job(key=key, n=2))
    first = await one.result()
    second = await two.result()
    return f"{first} + {second}"


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    forkable_v1,
    forkable_v2,
    napper_task,
    fork_child_task,
    fork_parent_task,
)
"""The tasks of this topic that the suite's engine registers."""


def _store(engine: Engine) -> LifecycleStore:
    backend = engine.backend
    if not isinstance(backend, LifecycleStore):
        pytest.skip(f"{type(backend).__name__} does not implement LifecycleStore (optional)")
    return backend


class LifecycleContract:
    """Pauses hold in the claim; reruns and forks start finished runs again, linked."""

    # -- pause and resume --------------------------------------------------------------------------

    async def test_a_paused_pair_is_not_claimed_and_its_runs_run_after_the_resume(
        self, engine: Engine, tally: Tally
    ) -> None:
        _store(engine)
        assert await engine.pause("contract.echo@1") is True
        assert await engine.pause("contract.echo@1") is False, "stored once"
        paused = await engine.enqueue(echo_task, Job(key="p1"), version=1, priority=5)
        newer = await engine.enqueue(echo_task_v2, Job(key="p2"))
        other = await engine.enqueue(other_task, Job(key="p3"))
        async with engine.worker(concurrency=4):
            # The paused run has the highest priority: a claim that did not skip its pair would
            # have taken it first.
            await newer.result(timeout=15)
            await other.result(timeout=15)
            later = await engine.enqueue(other_task, Job(key="p4"))
            await later.result(timeout=15)
            info = await engine.get(paused.run_id)
            assert (info.status, info.attempts) == ("pending", 0), "paused: never claimed"
            assert "p1" not in tally.order
            assert await engine.resume("contract.echo@1") is True
            assert await paused.result(timeout=15) == Job(key="P1", n=1)
        assert await engine.resume("contract.echo@1") is False, "nothing paused any more"
        assert await engine.paused() == []

    async def test_pausing_a_task_pauses_every_version_and_resumes_as_a_whole(
        self, engine: Engine
    ) -> None:
        _store(engine)
        assert await engine.pause("contract.echo") is True
        assert await engine.pause(TaskPair(name="contract.other", version=1)) is True
        listed = await engine.paused()
        assert [(p.task_name, p.task_version, str(p)) for p in listed] == [
            ("contract.echo", None, "contract.echo"),
            ("contract.other", 1, "contract.other@1"),
        ]
        assert all(p.paused_at.tzinfo is not None for p in listed)
        with pytest.raises(UsageError, match=r"paused as a whole .* resume\('contract.echo'\)"):
            await engine.resume("contract.echo@2")
        runs = [
            await engine.enqueue(echo_task, Job(key="w1"), version=1),
            await engine.enqueue(echo_task_v2, Job(key="w2")),
        ]
        async with engine.worker(concurrency=2):
            done = await engine.enqueue(steps_task, Job(key="w3"))
            await done.result(timeout=15)
            for handle in runs:
                assert (await engine.get(handle.run_id)).status == "pending"
            assert await engine.resume("contract.echo") is True
            for handle in runs:
                await handle.result(timeout=15)
        assert [str(p) for p in await engine.paused()] == ["contract.other@1"]
        for bad in ("", "a b@x", "x@0", 7):
            with pytest.raises(UsageError):
                await engine.pause(bad)  # type: ignore[arg-type]

    async def test_a_running_run_finishes_and_a_sleeping_one_waits_out_the_pause(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        _store(engine)
        held = await engine.enqueue(steps_task, Job(key="held"))
        tally.gate("held")  # `second` waits on it
        napper = await engine.enqueue(napper_task, Job(key="nap", n=300))
        async with engine.worker(concurrency=4):
            await eventually(lambda: holds(tally.body_runs[("held", "second")] == 1))
            await wait_until(engine, napper.run_id, lambda i: i.status == "waiting", what="nap")
            await engine.pause("contract.steps")
            await engine.pause("contract.napper")
            tally.gate("held").set()
            assert await held.result(timeout=15) == 6, "a run already held goes on"
            await harness.advance(timedelta(seconds=1))  # the nap is over
            await (await engine.enqueue(other_task, Job(key="after"))).result(timeout=15)
            info = await engine.get(napper.run_id)
            assert info.status == "waiting", "its timer came, but its pair is paused"
            assert tally.body_runs[("nap", "after")] == 0
            await engine.resume("contract.napper")
            assert await napper.result(timeout=15) == "rested"
        assert tally.body_runs[("nap", "before")] == 1, "resumed unharmed: replayed"

    async def test_the_store_skips_paused_pairs_in_the_claim(self, engine: Engine) -> None:
        store = _store(engine)
        handle = await engine.enqueue(echo_task, Job(key="spi"), version=1)
        pair = TaskPair(name="contract.echo", version=1)
        await store.pause_task(task_name="contract.echo", task_version=None)
        lease = timedelta(seconds=30)
        backend = engine.backend
        assert await backend.claim(worker_id="w", pairs=[pair], limit=5, lease=lease) == []
        assert await store.resume_task(task_name="contract.echo", task_version=None)
        claimed = await backend.claim(worker_id="w", pairs=[pair], limit=5, lease=lease)
        assert [c.run_id for c in claimed] == [handle.run_id]

    # -- rerun -------------------------------------------------------------------------------------

    async def test_a_rerun_starts_the_input_again_from_the_start(
        self, engine: Engine, tally: Tally
    ) -> None:
        _store(engine)
        first = await engine.enqueue(
            steps_task, Job(key="again"), idempotency_key="once:again", priority=3
        )
        with pytest.raises(UsageError, match="still pending; only a finished run"):
            await engine.rerun(first.run_id)
        async with engine.worker(concurrency=2):
            assert await first.result(timeout=15) == 6
            second = await engine.rerun(first.run_id)
            assert second.run_id != first.run_id
            assert (second.task_name, second.task_version, second.created) == (
                "contract.steps",
                1,
                True,
            )
            assert await second.result(timeout=15) == 6
        assert tally.body_runs[("again", "first")] == 2, "a rerun runs every step again"
        info = await engine.get(second.run_id)
        assert (info.rerun_of, info.forked_from, info.forked_at_step) == (first.run_id, None, None)
        assert (info.input, info.priority, info.idempotency_key) == (
            {"key": "again", "n": 0},
            3,
            None,
        )
        assert (await engine.get(first.run_id)).rerun_of is None
        with pytest.raises(RunNotFoundError):
            await engine.rerun(new_run_id())
        with pytest.raises(UsageError, match=r"not on version 0|>= 1"):
            await engine.rerun(first.run_id, version=0)

    async def test_a_rerun_can_run_on_a_newer_version_not_an_older_one(
        self, engine: Engine
    ) -> None:
        _store(engine)
        old = await engine.enqueue(echo_task, Job(key="up", n=1), version=1)
        async with engine.worker(concurrency=2):
            await old.result(timeout=15)
            newer = await engine.rerun(old.run_id, version=2)
            assert await newer.result(timeout=15) == Job(key="up", n=3)
            with pytest.raises(UsageError, match="not on version 1"):
                await engine.rerun(newer.run_id, version=1)

    # -- fork --------------------------------------------------------------------------------------

    async def test_a_fork_keeps_the_steps_before_its_step_and_runs_from_there(
        self, engine: Engine, tally: Tally
    ) -> None:
        _store(engine)
        broken = await engine.enqueue(forkable_v1, Job(key="f"), version=1)
        await engine.signal(broken.run_id, "approval:f", "yes")
        async with engine.worker(concurrency=2):
            with pytest.raises(RunFailedError, match="the submit is broken"):
                await broken.result(timeout=15)
            with pytest.raises(UsageError, match=r"never recorded a step 'nope' .*'prepare'"):
                await engine.fork(broken.run_id, "nope")
            tally.business["fixed:f"] = True
            fork = await engine.fork(broken.run_id, "submit")
            assert await fork.result(timeout=15) == "prepared 1, yes, submitted, finished 1, v1"
            # From the fact wait: the fork has the old run's facts, so it does not wait again.
            from_wait = await engine.fork(broken.run_id, "approval:f")
            assert await from_wait.result(timeout=15) == (
                "prepared 1, yes, submitted, finished 2, v1"
            )
        assert tally.body_runs[("f", "prepare")] == 1, "kept: replayed, never run again"
        assert tally.body_runs[("f", "submit")] == 3
        info = await engine.get(fork.run_id)
        assert (info.forked_from, info.forked_at_step, info.rerun_of) == (
            broken.run_id,
            "submit",
            None,
        )
        assert [(s.name, s.status) for s in info.timeline] == [
            ("prepare", "completed"),
            ("approval:f", "completed"),
            ("submit", "completed"),
            ("finish", "completed"),
        ]
        old = await engine.get(broken.run_id)
        assert [s.name for s in old.timeline] == ["prepare", "approval:f", "submit"]

    async def test_a_fork_onto_a_newer_version_replays_the_kept_steps_on_its_code(
        self, engine: Engine, tally: Tally
    ) -> None:
        _store(engine)
        broken = await engine.enqueue(forkable_v1, Job(key="v"), version=1)
        await engine.signal(broken.run_id, "approval:v", "ok")
        async with engine.worker(concurrency=2):
            with pytest.raises(RunFailedError):
                await broken.result(timeout=15)
            fork = await engine.fork(broken.run_id, "submit", version=2)
            assert fork.task_version == 2
            assert await fork.result(timeout=15) == "prepared 1, ok, submitted, finished 1, v2"
            with pytest.raises(UsageError, match="not on version 1"):
                await engine.fork(fork.run_id, "submit", version=1)
        assert tally.body_runs[("v", "prepare")] == 1

    async def test_a_fork_starts_again_the_children_that_did_not_complete(
        self, engine: Engine, tally: Tally
    ) -> None:
        _store(engine)
        parent = await engine.enqueue(fork_parent_task, Job(key="fam"))
        async with engine.worker(concurrency=4):
            with pytest.raises(RunFailedError, match="child fam is broken"):
                await parent.result(timeout=15)
            old_children = {c.run_id for c in (await engine.list(parent=parent.run_id)).runs}
            tally.business["fixed:fam"] = True
            # From the failed child's result: child one (completed) is kept with its result;
            # child two (failed) is started again, as the fork's own.
            fork = await engine.fork(parent.run_id, "two.result")
            assert await fork.result(timeout=15) == "child 1 + child 2"
            # From child one's result, not kept: it is read from the fact the fork copied.
            later = await engine.fork(parent.run_id, "one.result")
            assert await later.result(timeout=15) == "child 1 + child 2"
        assert tally.body_runs[("fam-1", "child")] == 1, "a completed child is never re-run"
        assert tally.body_runs[("fam", "child")] == 3
        for handle in (fork, later):
            own = (await engine.list(parent=handle.run_id)).runs
            assert [(c.task_name, c.status) for c in own] == [("contract.fork_child", "completed")]
            assert not {c.run_id for c in own} & old_children
        info = await engine.get(fork.run_id)
        assert [s.name for s in info.timeline] == ["one", "one.result", "two", "two.result"]

    async def test_the_store_copies_a_forks_records_and_facts_as_stored(
        self, engine: Engine
    ) -> None:
        """`NewRun.kept_steps` in the order given, payloads and tokens untouched; the old run's
        own facts, not broadcast ones; the first claim hands the records out."""
        _store(engine)
        backend = engine.backend
        old = await engine.enqueue(steps_task, Job(key="spi-fork"))
        async with engine.worker():
            await old.result(timeout=15)
        await engine.signal(old.run_id, "note", {"a": [1, 2]})
        await engine.broadcast("everyone", 1)
        record = await backend.get_run(old.run_id)
        assert record is not None
        by_name: dict[str, StepRecord] = {s.name: s for s in record.steps}
        kept = [("third", 1), ("first", 1)]
        new = NewRun(
            run_id=new_run_id(),
            task_name="contract.steps",
            task_version=1,
            input_json=record.input_json,
            input_hash="spi-fork",
            forked_from=old.run_id,
            forked_at_step="second",
            kept_steps=kept,
        )
        assert (await backend.enqueue(new)).created
        fork = await backend.get_run(new.run_id)
        assert fork is not None
        assert [(s.name, s.attempt) for s in fork.steps] == kept
        for copied in fork.steps:
            original = by_name[copied.name]
            assert json.loads(copied.output_json or "") == json.loads(original.output_json or "")
            assert (copied.fencing_token, copied.status, copied.finished_at) == (
                original.fencing_token,
                original.status,
                original.finished_at,
            )
        assert (fork.forked_from, fork.forked_at_step) == (old.run_id, "second")
        facts = await backend.get_facts(run_id=new.run_id, name="note")
        assert [(f.run_id, json.loads(f.payload_json)) for f in facts] == [
            (new.run_id, {"a": [1, 2]})
        ]
        shared = await backend.get_facts(run_id=new.run_id, name="everyone")
        assert [f.run_id for f in shared] == [None], "a broadcast fact is shared, not copied"
        pair = TaskPair(name="contract.steps", version=1)
        claimed = await backend.claim(
            worker_id="w", pairs=[pair], limit=1, lease=timedelta(seconds=30)
        )
        assert [c.run_id for c in claimed] == [new.run_id]
        assert [(s.name, s.attempt) for s in claimed[0].steps] == kept, "replayed at once"
        missing = NewRun(
            run_id=new_run_id(),
            task_name="contract.steps",
            task_version=1,
            input_json=record.input_json,
            input_hash="spi-fork",
            forked_from=new_run_id(),
            forked_at_step="second",
        )
        with pytest.raises(RunNotFoundError):
            await backend.enqueue(missing)
