"""Postgres with real worker processes: SIGKILL and SIGSTOP mid-step, worker groups, cancel,
idempotent enqueue under concurrency and priority order under a backlog.

The workers serve tests/integration/tasks.py; its step bodies append to an append-only external
table (`ext_log`) before they do their (slow) work, so these tests count real body executions
per attempt token and compare them with what the engine recorded.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from typing import Any

import pytest

from tests._procs.support import Spawner, eventually, fetch, q
from tests.integration.checks import check_t_io_exactly_once, ext_rows
from tests.integration.tasks import Job, t_agent, t_cancel, t_io, t_io_v2, t_order
from umt_sdk import Engine, IdempotencyConflictError, Registry, connect
from umt_sdk.exceptions import RunCanceledError

pytestmark = pytest.mark.slow


async def _in_progress(
    url: str, schema: str, pid: int, *, event: str, fresh: float = 0.1
) -> dict[str, Any]:
    """A step body (`event="body"`) or fenced side effect (`"act"`) of worker `pid` that
    started less than `fresh` seconds ago and is not recorded yet: it is sleeping in its
    body (bodies here sleep 0.25 s or more), so a kill now lands mid-step."""
    rows = await fetch(
        url,
        q(
            "SELECT e.run_key, e.step, e.token FROM {schema}.ext_log e"
            " JOIN {schema}.runs r ON r.input->>'key' = e.run_key AND r.task_name = 't_io'"
            " WHERE e.pid = %s AND e.event = %s"
            "   AND e.at > clock_timestamp() - make_interval(secs => %s)"
            "   AND NOT EXISTS (SELECT 1 FROM {schema}.steps s WHERE s.run_id = r.id"
            "                   AND s.name = e.step AND s.fencing_token = e.token)"
            " ORDER BY e.seq DESC LIMIT 1",
            schema,
        ),
        (pid, event, fresh),
    )
    return rows[0] if rows else {}


async def _recorded(url: str, schema: str, victim: dict[str, Any]) -> bool:
    """Whether the step `victim` names was recorded under its attempt token after all."""
    rows = await fetch(
        url,
        q(
            "SELECT 1 FROM {schema}.steps s JOIN {schema}.runs r ON r.id = s.run_id"
            " WHERE r.input->>'key' = %s AND s.name = %s AND s.fencing_token = %s",
            schema,
        ),
        (victim["run_key"], victim["step"], victim["token"]),
    )
    return bool(rows)


async def test_sigkill_mid_step_resumes_without_rerunning_completed_steps(
    engine: Engine, spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    keys = [f"k{i:02d}" for i in range(20)]
    handles = [await engine.enqueue(t_io, Job(key=k, delay=0.25), version=1) for k in keys]
    run_ids = [h.run_id for h in handles]
    kills: list[dict[str, Any]] = []
    late = 0
    started = time.monotonic()
    for cycle in range(14):
        if len(kills) == 8:
            break
        # Every third kill lands inside the fenced side effect, the others in any step body.
        event = "act" if len(kills) % 3 == 1 else "body"
        worker = spawner.start(versions="t_io@1", lease=1.0, concurrency=4)
        await worker.wait_ready()
        await asyncio.sleep(rng.uniform(0.0, 0.5))  # a random kill point ...
        victim = await eventually(  # ... but always while a step body is running
            lambda w=worker, e=event: _in_progress(pg_url, pg_schema, w.pid, event=e),
            timeout=15,
            what=f"a {event} in progress in worker {worker.name} (cycle {cycle}, seed {seed})",
            interval=0.005,
            on_timeout=worker.describe,
        )
        worker.kill()
        if await _recorded(pg_url, pg_schema, victim):
            late += 1  # this test process stalled: the body finished before the kill
            continue
        kills.append({**victim, "event": event})
    final = spawner.start(versions="t_io@1", lease=1.0, concurrency=4)
    await final.wait_ready()
    infos = await engine.wait_idle(run_ids, timeout=40)
    statuses = Counter(i.status for i in infos)
    assert statuses == {"completed": len(keys)}, (
        f"seed {seed}: after {len(kills)} kills: {dict(statuses)}\n{final.describe()}"
    )
    report = await check_t_io_exactly_once(pg_url, pg_schema, "receipts", keys, spawner.workdir)
    elapsed = time.monotonic() - started
    assert len(kills) == 8, f"only {len(kills)} kills landed mid-step ({late} too late)"
    # Every kill landed in a step body (chosen that way), and that body ran again later.
    assert report.interrupted_bodies >= len(kills), (
        f"seed {seed}: {report.interrupted_bodies} interrupted bodies for {len(kills)} kills "
        f"mid-step: {kills}"
    )
    assert report.interrupted_executions >= len(kills), report
    side_kills = sum(1 for k in kills if k["event"] == "act")
    assert report.resumed_side_effects >= side_kills, (
        f"seed {seed}: {side_kills} kills inside the side effect but only "
        f"{report.resumed_side_effects} resumed attempts of it: {report}"
    )
    for victim in kills:
        rows = [
            r
            for r in await ext_rows(pg_url, pg_schema)
            if r["run_key"] == victim["run_key"]
            and r["step"] == victim["step"]
            and r["event"] == "body"
        ]
        assert any(r["token"] > victim["token"] for r in rows), (
            f"seed {seed}: the body killed at {victim} never re-ran: {rows}"
        )
    assert final.alive, final.describe()
    print(f"seed {seed}: {report}, {late} late kills, in {elapsed:.1f} s")


async def test_sigstop_past_the_lease_fences_the_stale_worker(
    engine: Engine, spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    handle = await engine.enqueue(t_io, Job(key="frozen", delay=0.5), version=1)
    stale = spawner.start(versions="t_io@1", lease=1.0, concurrency=1)
    await stale.wait_ready()
    act = await eventually(
        lambda: _in_progress(pg_url, pg_schema, stale.pid, event="act"),
        timeout=15,
        what="the first worker inside the fenced side effect",
        interval=0.005,
        on_timeout=stale.describe,
    )
    stale.signal(signal.SIGSTOP)  # frozen mid side effect, its lease running out
    stale_token = act["token"]
    await eventually(
        lambda: fetch(
            pg_url,
            q("SELECT 1 FROM {schema}.runs WHERE id = %s AND lease_expires_at < now()", pg_schema),
            (handle.run_id,),
        ),
        timeout=10,
        what="the frozen worker's lease to expire",
    )
    fresh = spawner.start(versions="t_io@1", lease=1.0, concurrency=1)
    await fresh.wait_ready()
    output = await handle.result(timeout=20)
    info = await engine.get(handle.run_id)
    fresh_token = info.executions[-1].fencing_token
    assert fresh_token > stale_token, info.executions
    assert output["receipt"] == f"receipt-{fresh_token}", output

    stale.signal(signal.SIGCONT)  # it wakes up inside the side effect, past its lease

    def rejected() -> str:
        text = stale.output() + stale.errors()
        if f"FENCED run={handle.run_id} token={stale_token}" in text:
            return "commit rejected with FencingError"
        if f"lost the lease of run {handle.run_id}: it expired" in text:
            return "stopped before writing: its lease expired unrenewed"
        if f"lost the lease of run {handle.run_id}" in text:
            return "heartbeat rejected: lease lost"
        return ""

    async def seen_rejected() -> str:
        return rejected()

    how = await eventually(
        seen_rejected,
        timeout=10,
        what="the resumed worker's writes to be rejected",
        on_timeout=stale.describe,
    )
    await asyncio.sleep(1.5)  # give the stale worker time to (wrongly) carry on
    assert stale.alive, f"the stale worker died instead of stopping the run\n{stale.describe()}"
    assert "Traceback" not in stale.errors(), stale.describe()

    info = await engine.get(handle.run_id)
    assert info.status == "completed", info
    assert [(e.fencing_token, e.outcome) for e in info.executions] == [
        (stale_token, "interrupted"),
        (fresh_token, "completed"),
    ], f"{how}: {info.executions}"
    recorded = [(s.name, s.fencing_token) for s in info.timeline if s.status == "completed"]
    assert recorded == [
        ("s1", stale_token),
        ("s2", stale_token),
        ("side", fresh_token),
        ("s3", fresh_token),
    ], f"{how}: {info.timeline}"
    business = await fetch(pg_url, q("SELECT * FROM {schema}.receipts", pg_schema))
    assert [(r["op_key"], r["token"], r["receipt"]) for r in business] == [
        ("pay-frozen", fresh_token, f"receipt-{fresh_token}")
    ], f"{how}: business rows {business}"
    ledger = await fetch(pg_url, q("SELECT * FROM {schema}.op_ledger", pg_schema))
    assert [(r["op_key"], r["fencing_token"], r["result"]) for r in ledger] == [
        ("pay-frozen", fresh_token, f"receipt-{fresh_token}")
    ], ledger
    rows = [r for r in await ext_rows(pg_url, pg_schema) if r["token"] == stale_token]
    assert [(r["step"], r["event"]) for r in rows] == [
        ("s1", "body"),
        ("s2", "body"),
        ("side", "body"),
        ("side", "act"),
    ], f"{how}: the stale attempt went on after its lease was lost: {rows}"
    receipt_file = spawner.workdir / "pay-frozen.receipt"
    assert receipt_file.read_text() == f"receipt-{fresh_token}"
    report = await check_t_io_exactly_once(
        pg_url, pg_schema, "receipts", ["frozen"], spawner.workdir
    )
    assert report.resumed_side_effects == 1, report

    # The thawed worker gave the slot back: alone now, it serves the next run.
    fresh.kill()
    after = await engine.enqueue(t_io, Job(key="after-thaw", delay=0.01), version=1)
    await after.result(timeout=15)
    (execution,) = (await engine.get(after.run_id)).executions
    assert execution.worker_id == f"default-{stale.pid}", execution


async def test_worker_groups_claim_only_their_pairs(
    engine: Engine, spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    io_keys = [f"io{i}" for i in range(8)]
    agent_keys = [f"agent{i}" for i in range(8)]
    handles = []
    for io_key, agent_key in zip(io_keys, agent_keys, strict=True):
        handles.append(await engine.enqueue(t_io, Job(key=io_key, delay=0.02), version=1))
        handles.append(await engine.enqueue(t_agent, Job(key=agent_key, delay=0.02)))
    unserved = await engine.enqueue(t_io_v2, Job(key="nobody"))
    io = spawner.start(versions="t_io@1", group="io", concurrency=3)
    agent = spawner.start(versions="t_agent@1", group="agent", concurrency=3)
    await io.wait_ready()
    await agent.wait_ready()
    infos = await engine.wait_idle([h.run_id for h in handles], timeout=30)
    statuses = Counter(i.status for i in infos)
    assert statuses == {"completed": len(handles)}, (
        f"{dict(statuses)}\n{io.describe()}\n{agent.describe()}"
    )
    await asyncio.sleep(1.5)  # more than a poll interval: the unserved run stays untouched

    groups: dict[str, set[str]] = {}
    for row in await ext_rows(pg_url, pg_schema):
        groups.setdefault(row["run_key"], set()).add(row["grp"])
    wrong = {k: g for k, g in groups.items() if g != {"io" if k.startswith("io") else "agent"}}
    assert not wrong, f"runs executed by the wrong worker group: {wrong}"
    assert sorted(groups) == sorted(io_keys + agent_keys), sorted(groups)
    for info in infos:
        expected = f"io-{io.pid}" if info.task_name == "t_io" else f"agent-{agent.pid}"
        owners = {e.worker_id for e in info.executions}
        assert owners == {expected}, f"{info.task_name} run {info.run_id} executed by {owners}"

    waiting = await engine.get(unserved.run_id)
    assert waiting.status == "pending", waiting
    assert waiting.attempts == 0, waiting
    assert waiting.failures == 0, waiting
    assert waiting.executions == (), waiting.executions
    assert "nobody" not in groups, "no worker serves t_io@2, yet its body ran"
    assert io.alive, io.describe()
    assert agent.alive, agent.describe()


async def test_idempotent_enqueue_from_concurrent_callers(pg_url: str, pg_schema: str) -> None:
    registry = Registry([t_agent])
    clients = [
        await connect(pg_url, registry=registry, schema=pg_schema, run_migrations=False)
        for _ in range(4)
    ]
    try:
        # 20 callers on 4 engines (each with its own pool) race on one key, same input.
        same = await asyncio.gather(
            *(
                clients[i % 4].enqueue(t_agent, Job(key="plan-1"), idempotency_key="plan:1")
                for i in range(20)
            )
        )
        ids = Counter(h.run_id for h in same)
        assert len(ids) == 1, f"20 callers, one key: {len(ids)} runs {dict(ids)}"
        created = sum(1 for h in same if h.created)
        assert created == 1, f"{created} callers were told they created the run"
        (run_id,) = ids

        # A different input under the key is refused, from any engine, even amid a race.
        mixed = await asyncio.gather(
            *(
                clients[i % 4].enqueue(
                    t_agent,
                    Job(key="plan-1" if i % 2 else "plan-other"),
                    idempotency_key="plan:1",
                )
                for i in range(20)
            ),
            return_exceptions=True,
        )
        conflicts = [r for r in mixed if isinstance(r, IdempotencyConflictError)]
        others = [r for r in mixed if isinstance(r, BaseException) and r not in conflicts]
        assert not others, others
        assert len(conflicts) == 10, f"{len(conflicts)} conflicts for 10 different inputs"
        assert all(c.run_id == run_id for c in conflicts), [c.run_id for c in conflicts]
        assert {r.run_id for r in mixed if not isinstance(r, BaseException)} == {run_id}

        # A second race on a fresh key where half the callers send another input: exactly
        # one run exists, and each caller either got it (same input) or a conflict.
        raced = await asyncio.gather(
            *(
                clients[i % 4].enqueue(t_agent, Job(key=f"input-{i % 2}"), idempotency_key="plan:2")
                for i in range(20)
            ),
            return_exceptions=True,
        )
        won = {r.run_id for r in raced if not isinstance(r, BaseException)}
        lost = [r for r in raced if isinstance(r, BaseException)]
        assert len(won) == 1, f"{len(won)} runs for one key: {won}"
        assert len(lost) == 10, f"{len(lost)} callers failed: {lost}"
        assert all(isinstance(r, IdempotencyConflictError) for r in lost), lost
    finally:
        for client in clients:
            await client.close()
    rows = await fetch(
        pg_url,
        q(
            "SELECT idempotency_key, count(*) AS n FROM {schema}.runs GROUP BY 1 ORDER BY 1",
            pg_schema,
        ),
    )
    assert [(r["idempotency_key"], r["n"]) for r in rows] == [("plan:1", 1), ("plan:2", 1)], rows


async def test_priority_order_over_a_backlog(
    engine: Engine, spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    rng = random.Random(7)
    priorities = [rng.choice([-5, 0, 0, 0, 1, 3, 3, 10, 200]) for _ in range(300)]
    keys = [f"o{i:03d}" for i in range(len(priorities))]
    for key, priority in zip(keys, priorities, strict=True):
        await engine.enqueue(t_order, Job(key=key), priority=priority)
    worker = spawner.start(versions="t_order@1", concurrency=1)
    await worker.wait_ready()

    async def executed() -> list[str]:
        rows = await ext_rows(pg_url, pg_schema)
        return [r["run_key"] for r in rows] if len(rows) >= len(keys) else []

    order = await eventually(
        executed, timeout=60, what="the backlog to drain", interval=0.2, on_timeout=worker.describe
    )
    expected = [keys[i] for i in sorted(range(len(keys)), key=lambda i: (-priorities[i], i))]
    assert len(order) == len(keys), f"{len(order)} executions for {len(keys)} runs"
    mismatch = next(
        (i for i, (a, b) in enumerate(zip(order, expected, strict=True)) if a != b), None
    )
    assert mismatch is None, (
        f"execution {mismatch} of {len(keys)} was {order[mismatch]} (priority "
        f"{priorities[keys.index(order[mismatch])]}), expected {expected[mismatch]} (priority "
        f"{priorities[keys.index(expected[mismatch])]})"
    )

    # The last run's outside write commits before its ending does: wait for the endings.
    async def all_ended() -> Counter[str]:
        statuses = Counter(r.status for r in await engine.list(limit=1000))
        return statuses if not statuses.keys() & {"pending", "running"} else Counter()

    statuses = await eventually(
        all_ended, timeout=30, what="every run to end", interval=0.1, on_timeout=worker.describe
    )
    assert statuses == {"completed": len(keys)}, dict(statuses)


async def test_cancel_of_a_running_run_fires_the_abort_within_a_second(
    engine: Engine, spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    worker = spawner.start(versions="t_cancel@1", concurrency=2, lease=5.0)
    await worker.wait_ready()
    handle = await engine.enqueue(t_cancel, Job(key="c", delay=0.05))

    async def in_long_step() -> bool:
        return any(r["step"] == "long" for r in await ext_rows(pg_url, pg_schema))

    await eventually(in_long_step, timeout=15, what="the long step", on_timeout=worker.describe)
    asked = time.monotonic()
    assert await engine.cancel(handle.run_id, reason="operator") == "requested"
    with pytest.raises(RunCanceledError) as caught:
        await handle.result(timeout=10)
    ended = time.monotonic() - asked
    assert caught.value.reason == "operator"
    assert ended < 2.0, f"the run took {ended:.2f} s to end canceled"
    rows = await fetch(
        pg_url,
        q(
            "SELECT e.step, e.event, e.at - r.cancel_requested_at AS after_cancel"
            " FROM {schema}.ext_log e JOIN {schema}.runs r ON r.id = %s ORDER BY e.seq",
            pg_schema,
        ),
        (handle.run_id,),
    )
    events = [(r["step"], r["event"]) for r in rows]
    assert events == [("started", "body"), ("long", "body"), ("long", "abort-seen")], events
    fired_after = rows[-1]["after_cancel"].total_seconds()
    assert 0 <= fired_after < 1.0, f"the abort fired {fired_after:.3f} s after the cancel"
    await asyncio.sleep(0.5)  # no later step starts, not even late
    assert [r["step"] for r in await ext_rows(pg_url, pg_schema)] == ["started", "long", "long"]
    info = await engine.get(handle.run_id)
    assert info.status == "canceled", info
    assert [(s.name, s.status) for s in info.timeline] == [
        ("started", "completed"),
        ("long", "canceled"),  # the step the cancel stopped stays in the timeline
    ], info.timeline
    assert [e.outcome for e in info.executions] == ["canceled"], info.executions
    assert worker.alive, worker.describe()
