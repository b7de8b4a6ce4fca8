"""Postgres crashed (`pg_ctl stop -m immediate`) while a write of each of the newer features is
in flight, and a worker frozen (SIGSTOP) inside a transactional step past its lease.

One private server, one crash. Before it, the test holds each feature at the moment its
promise spans a write, all at once:

- **updates**: run o1 accepted an update (stored, its handler ran and its step recorded) and
  is writing the result record; `update_with_start` of run o2 is storing its update. Both
  callers wait.
- **event triggers**: a worker has started 200 of the 210 events' runs of a subscriber the
  publisher does not know and is writing the last 10; a publish is storing its event with the
  run of the subscriber it knows.
- **transactional steps**: a step's transaction has written its business row and its step
  record and is committing.
- **settling**: `settle` of run A is storing its settlement; run B, settled as not done, is
  recording the settlement it was woken by.

Each write is held by a trigger of the test's own (`pgcrash_hold`) that waits for an advisory
lock the test holds: the test sees every one waiting in `pg_locks`, then crashes the server.
After the restart: each update caller gets exactly one result, and one update and one result
are stored per run; each subscriber has exactly one run per event, a retried publish stores
its event once and starts nothing twice; the transactional step's row and record are absent
for the crashed attempt and present once for the recording one; the interrupted `settle`,
retried, is stored once, and each run applies its settlement once (the gateway called once,
or once more for "not done").

Then a worker is frozen inside a transactional step's open transaction (its row written),
its lease lapses, another worker completes the step, and the frozen one is thawed: its late
commit is refused (by the fence in its record statement, or before that by its own lease
check, whichever comes first once it runs again: both end its transaction uncommitted), and
the step's row is there once, the recording attempt's.

The workers (`tests/_procs/worker.py --tasks` this module) write their effects to the table
`effects` of the engine's schema; nothing in the worker processes is instrumented.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import attrs
import psycopg
import pytest

from tests._procs.support import Process, Spawner, eventually, fetch, q
from tests._procs.worker import config, say, until_file, write_first
from tests.fixtures.private_pg import PrivatePostgres
from umt_backend_pg import migrate
from umt_sdk import (
    Engine,
    Registry,
    RetryPolicy,
    RunHandle,
    TaskContext,
    TaskDefinition,
    connect,
    task,
    update,
)
from umt_sdk.exceptions import BackendUnavailableError, ResultTimeoutError

pytestmark = pytest.mark.slow

T = TypeVar("T")

SCHEMA = "umt_pgcrash"
LEASE = 2.0
"""The workers' lease: a heartbeat waits behind the run row a committing transactional step
holds, and must not give up before the crash."""
BATCH_EVENT = "pgcrash.batch"
PLACED_EVENT = "pgcrash.placed"
BATCH = 210
"""Events of the subscriber only workers know: a pass starts 200 a write, so the second write
(10 runs) is the one in flight."""

# The advisory locks the test holds; each trigger waits for one (pg_locks shows which).
HELD_UPDATE_RESULT = 71001
HELD_UPDATE_STORE = 71002
HELD_FANOUT = 71003
HELD_PUBLISH = 71004
HELD_TX_COMMIT = 71005
HELD_SETTLE = 71006
HELD_SETTLED_RECORD = 71007
HOLDS = (
    HELD_UPDATE_RESULT,
    HELD_UPDATE_STORE,
    HELD_FANOUT,
    HELD_PUBLISH,
    HELD_TX_COMMIT,
    HELD_SETTLE,
    HELD_SETTLED_RECORD,
)


# -- the tasks (the worker processes import this module) ---------------------------------------


async def _effect(what: str, key: str, token: int = 0) -> int:
    """Add a row to `effects` (no unique key: a doubled effect shows); the rows of (what, key)."""
    async with await psycopg.AsyncConnection.connect(config().url, autocommit=True) as conn:
        await conn.execute(
            q("INSERT INTO {schema}.effects VALUES (%s, %s, %s, %s)", config().schema),
            (what, key, token, os.getpid()),
        )
        cur = await conn.execute(
            q(
                "SELECT count(*) FROM {schema}.effects WHERE what = %s AND key = %s",
                config().schema,
            ),
            (what, key),
        )
        row = await cur.fetchone()
    return int(row[0]) if row else 0


@attrs.frozen
class Order:
    order_id: str


@attrs.frozen
class Approval:
    by: str


async def reserve(order_id: str) -> str:
    await _effect("reserve", order_id)
    return f"slot-{order_id}"


@update("approve")
async def approve(ctx: TaskContext[Order], approval: Approval) -> str:
    slot = await ctx.step.run("reserve", reserve, ctx.input.order_id)
    return f"approved by {approval.by} ({slot})"


@task("pgcrash.order", version=1, updates=[approve])
async def order(ctx: TaskContext[Order]) -> str:
    applied = await ctx.step.wait_for_update("approve")
    return str(applied.result)


@attrs.frozen
class Receipt:
    ref: str
    cents: int


async def call_gateway(order_id: str) -> Receipt:
    """The first call for an order times out: whether it charged is unknown."""
    if await _effect("call", order_id) == 1:
        raise TimeoutError("the card gateway did not answer within 30 s")
    return Receipt(ref=f"gw-{os.getpid()}", cents=1250)


@task(
    "pgcrash.charge",
    version=1,
    retry=RetryPolicy(max_attempts=5, initial=timedelta(milliseconds=50), backoff=1.0),
)
async def charge(ctx: TaskContext[str]) -> str:
    receipt = await ctx.step.run("charge", call_gateway, ctx.input, uncertain_on=(TimeoutError,))
    return f"{receipt.ref} {receipt.cents}"


async def post(tx: Any, key: str, token: int) -> int:
    """A transactional step's body: its business row, in the step's transaction. The first
    attempt that posts `frozen` waits there, its transaction open, until the test releases it
    (the test freezes its worker meanwhile)."""
    await tx.execute(
        q("INSERT INTO {schema}.effects VALUES ('post', %s, %s, %s)", config().schema),
        (key, token, os.getpid()),
    )
    say("POSTED", key, token)
    me = str(os.getpid())
    if key == "frozen" and write_first(config().workdir / "held-frozen", me) == me:
        say("HELD", key, token)
        await until_file("release-frozen", limit=None)
        say("RESUMED", key, token)
    return token


_POSTING = RetryPolicy(max_attempts=10, initial=timedelta(milliseconds=100), backoff=1.0)


@task("pgcrash.post", version=1, retry=_POSTING)
async def post_once(ctx: TaskContext[str]) -> int:
    return int(await ctx.step.transaction("post", post, ctx.input, ctx.attempt_token))


@task("pgcrash.fence", version=1, retry=_POSTING)
async def post_fenced(ctx: TaskContext[str]) -> int:
    return int(await ctx.step.transaction("post", post, ctx.input, ctx.attempt_token))


@attrs.frozen
class Placed:
    n: int


@task("pgcrash.late", version=1, on_event=BATCH_EVENT)
async def late(ctx: TaskContext[Placed]) -> int:
    """A subscriber only the workers know: they start its runs."""
    return ctx.input.n


@task("pgcrash.known", version=1, on_event=PLACED_EVENT)
async def known(ctx: TaskContext[Placed]) -> int:
    """A subscriber the publisher knows: its run is stored with the event."""
    return ctx.input.n


TASKS: list[TaskDefinition[Any, Any]] = [order, charge, post_once, post_fenced, late, known]


# -- the test's side ----------------------------------------------------------------------------


def ddl(schema: str) -> str:
    """The effects table, and the triggers that hold each feature's write in flight while the
    test holds the write's advisory lock (shared here, exclusive in the test: once the test's
    session is gone, nothing waits)."""
    s = f'"{schema}"'
    return f"""
    CREATE TABLE {s}.effects (what text NOT NULL, key text NOT NULL, token bigint NOT NULL,
                              pid integer NOT NULL);
    CREATE FUNCTION {s}.pgcrash_hold() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock_shared(TG_ARGV[0]::bigint);
        RETURN NULL;
    END $$;
    CREATE TRIGGER hold_update_result AFTER INSERT ON {s}.steps FOR EACH ROW
        WHEN (NEW.name LIKE 'umt.update-result:%')
        EXECUTE FUNCTION {s}.pgcrash_hold({HELD_UPDATE_RESULT});
    CREATE TRIGGER hold_update_store AFTER INSERT ON {s}.facts FOR EACH ROW
        WHEN (NEW.name LIKE 'umt.update:%' AND NEW.payload->'arg'->>'by' = 'ops-crash')
        EXECUTE FUNCTION {s}.pgcrash_hold({HELD_UPDATE_STORE});
    CREATE TRIGGER hold_fanout AFTER INSERT ON {s}.runs FOR EACH ROW
        WHEN (NEW.task_name = 'pgcrash.late' AND (NEW.input->>'n')::int >= 200)
        EXECUTE FUNCTION {s}.pgcrash_hold({HELD_FANOUT});
    CREATE TRIGGER hold_publish AFTER INSERT ON {s}.runs FOR EACH ROW
        WHEN (NEW.task_name = 'pgcrash.known' AND (NEW.input->>'n')::int < 0)
        EXECUTE FUNCTION {s}.pgcrash_hold({HELD_PUBLISH});
    CREATE CONSTRAINT TRIGGER hold_tx_commit AFTER INSERT ON {s}.effects
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
        WHEN (NEW.what = 'post' AND NEW.key = 'crash')
        EXECUTE FUNCTION {s}.pgcrash_hold({HELD_TX_COMMIT});
    CREATE TRIGGER hold_settle AFTER INSERT ON {s}.facts FOR EACH ROW
        WHEN (NEW.name LIKE 'umt.attention:%'
              AND NEW.payload->'umt_settled'->>'by' = 'ops-crash')
        EXECUTE FUNCTION {s}.pgcrash_hold({HELD_SETTLE});
    CREATE TRIGGER hold_settled_record AFTER INSERT ON {s}.steps FOR EACH ROW
        WHEN (NEW.name LIKE 'umt.attention:%'
              AND NEW.output->'umt_settled'->>'by' = 'ops-apply')
        EXECUTE FUNCTION {s}.pgcrash_hold({HELD_SETTLED_RECORD});
    """


async def _held(url: str, key: int) -> bool:
    """Whether a session waits for the test's advisory lock `key` (its write is held)."""
    rows = await fetch(
        url,
        "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND classid = 0 AND objid = %s AND objsubid = 1",
        (key,),
    )
    return bool(rows)


async def _rows(url: str, text: str, *params: Any) -> list[dict[str, Any]]:
    return await fetch(url, q(text, SCHEMA), params)


async def _retried(call: Callable[[], Awaitable[T]], what: str, describe: Callable[[], str]) -> T:
    """`call()` once the restarted server answers (its pool reconnects meanwhile)."""
    outcome: list[T] = []

    async def attempt() -> bool:
        try:
            outcome.append(await call())
        except BackendUnavailableError:
            return False
        return True

    await eventually(attempt, timeout=60, what=what, interval=0.1, on_timeout=describe)
    return outcome[0]


async def _status(engine: Engine, handle: RunHandle[Any]) -> str:
    info = await engine.get(handle.run_id)
    return "needs_attention" if info.needs_attention else info.status


async def test_a_postgres_crash_amid_updates_events_transactions_and_settles_keeps_each_promise(
    private_pg: PrivatePostgres, tmp_path: Path
) -> None:
    url = private_pg.url
    await migrate(url, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(ddl(SCHEMA))  # type: ignore[arg-type]  # the test's own DDL
    engine = await connect(url, registry=Registry(TASKS), schema=SCHEMA, run_migrations=False)
    # The publisher knows `known` only: `late` is started by the workers.
    publisher = await connect(url, registry=Registry([known]), schema=SCHEMA, run_migrations=False)
    holder = await psycopg.AsyncConnection.connect(url, autocommit=True)
    fields = {"url": url, "schema": SCHEMA, "poll": 0.2}
    with Spawner.under(tmp_path, tasks=__name__, **fields) as spawner:
        try:
            await _crash_amid_writes(engine, publisher, holder, spawner, private_pg)
            await _frozen_in_a_transactional_step(engine, spawner, url)
        finally:
            await holder.close()
            await publisher.close()
            await engine.close()


async def _crash_amid_writes(
    engine: Engine,
    publisher: Engine,
    holder: psycopg.AsyncConnection[Any],
    spawner: Spawner,
    private_pg: PrivatePostgres,
) -> None:
    url = private_pg.url
    batch = [await publisher.publish(BATCH_EVENT, Placed(n), key=f"b{n}") for n in range(BATCH)]
    committed = await publisher.publish(PLACED_EVENT, Placed(1), key="committed")
    for key in HOLDS:
        await holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    o1 = await engine.enqueue(order, Order("o1"))
    a = await engine.enqueue(charge, "A")
    b = await engine.enqueue(charge, "B")
    workers = [
        spawner.start(group="upd", versions="pgcrash.order@1,pgcrash.fence@1", lease=LEASE),
        spawner.start(group="att", versions="pgcrash.charge@1", lease=LEASE),
        spawner.start(
            group="txe",
            versions="pgcrash.post@1,pgcrash.fence@1,pgcrash.late@1,pgcrash.known@1",
            lease=LEASE,
            concurrency=8,
        ),
    ]
    txe = workers[2]

    def describe() -> str:
        return "\n".join(w.describe() for w in workers)

    async def held(key: int, what: str) -> None:
        await eventually(lambda: _held(url, key), timeout=30, what=what, on_timeout=describe)

    async def parked() -> bool:
        return [await _status(engine, h) for h in (o1, a, b)] == [
            "waiting",
            "needs_attention",
            "needs_attention",
        ]

    await eventually(parked, timeout=60, what="o1 waiting, A and B parked", on_timeout=describe)
    # The fan-out's first write (200 runs) committed, its second is held.
    await held(HELD_FANOUT, "the fan-out held")
    assert (
        len(await _rows(url, "SELECT 1 FROM {schema}.runs WHERE task_name = 'pgcrash.late'")) == 200
    )

    # Settling: B's settlement stored, its run holding while recording it.
    await engine.settle(b.run_id, step="charge", done=False, by="ops-apply")
    await held(HELD_SETTLED_RECORD, "B's record held")
    # Updates: o1's result record held; o2's update held in its store.
    caller1 = asyncio.ensure_future(o1.update("approve", Approval("ops"), timeout=60))
    await held(HELD_UPDATE_RESULT, "o1's result held")
    caller2 = asyncio.ensure_future(
        engine.update_with_start(
            order,
            Order("o2"),
            key="order:o2",
            update="approve",
            arg=Approval("ops-crash"),
            timeout=60,
        )
    )
    await held(HELD_UPDATE_STORE, "o2's update held")
    # Settling: A's settlement held in its store.
    settling = asyncio.ensure_future(
        engine.settle(
            a.run_id, step="charge", done=True, output=Receipt("gw-by-hand", 990), by="ops-crash"
        )
    )
    await held(HELD_SETTLE, "A's settle held")
    # Events: a publish held while it stores its subscriber's run.
    publishing = asyncio.ensure_future(publisher.publish(PLACED_EVENT, Placed(-1), key="in-flight"))
    await held(HELD_PUBLISH, "the publish held")
    # Transactional step last (its commit holds the run row its worker's heartbeat needs).
    tx = await engine.enqueue(post_once, "crash")
    crashed_token = await txe.printed("POSTED", "crash")
    await held(HELD_TX_COMMIT, "the commit held")

    private_pg.crash()
    for interrupted in (settling, publishing):
        with pytest.raises(BackendUnavailableError):
            await interrupted
    assert not caller1.done(), "the update's caller waits the outage out"
    assert not caller2.done(), "so does update_with_start's, whose update was being stored"
    private_pg.start()

    # The callers retry what was cut off, with the same arguments.
    settled = await _retried(
        lambda: engine.settle(
            a.run_id, step="charge", done=True, output=Receipt("gw-by-hand", 990), by="ops-crash"
        ),
        "settle to be stored",
        describe,
    )
    assert settled.done
    again = await _retried(
        lambda: publisher.publish(PLACED_EVENT, Placed(-1), key="in-flight"),
        "the publish",
        describe,
    )
    assert again.created, "the held publish stored nothing"
    assert len(again.runs) == 1
    repeat = await _retried(
        lambda: publisher.publish(PLACED_EVENT, Placed(1), key="committed"),
        "a repeated publish",
        describe,
    )
    assert (repeat.created, repeat.runs, repeat.event_id) == (False, (), committed.event_id)

    # -- updates: one result for each caller, one update and one result stored per run
    assert await caller1 == "approved by ops (slot-o1)", describe()
    o2, result2 = await caller2
    assert result2 == "approved by ops-crash (slot-o2)"
    for handle, by, slot in ((o1, "ops", "slot-o1"), (o2, "ops-crash", "slot-o2")):
        assert await _result(engine, handle, describe) == f"approved by {by} ({slot})"
        requests = await _rows(
            url, "SELECT payload FROM {schema}.facts WHERE run_id = %s ORDER BY name", handle.run_id
        )
        assert [r["payload"]["arg"]["by"] for r in requests] == [by], requests
        records = await _rows(
            url,
            "SELECT name, status FROM {schema}.steps WHERE run_id = %s"
            " AND name LIKE 'umt.update-result:%%'",
            handle.run_id,
        )
        assert records == [{"name": "umt.update-result:1", "status": "completed"}]
    reserved = await _rows(
        url, "SELECT key FROM {schema}.effects WHERE what = 'reserve' ORDER BY key"
    )
    assert [r["key"] for r in reserved] == ["o1", "o2"], "each update's step ran once"

    # -- transactional step: the crashed attempt's row and record are gone, the next's are there
    info = await _finished(engine, tx, describe)
    assert info.status == "completed", f"{info.status} {info.error}\n{describe()}"
    recorded = [s for s in info.timeline if s.name == "post" and s.status == "completed"]
    assert len(recorded) == 1
    posted = await _rows(
        url, "SELECT token FROM {schema}.effects WHERE what = 'post' AND key = 'crash'"
    )
    assert [r["token"] for r in posted] == [recorded[0].fencing_token]
    assert recorded[0].fencing_token != crashed_token
    assert await engine.result(tx.run_id) == recorded[0].fencing_token
    stale = await _rows(
        url,
        "SELECT 1 FROM {schema}.steps WHERE run_id = %s AND fencing_token = %s",
        tx.run_id,
        crashed_token,
    )
    assert stale == [], "no record of the attempt whose commit the crash cut off"

    # -- settling: each settlement stored once and applied once
    assert await _result(engine, a, describe) == "gw-by-hand 990"
    assert str(await _result(engine, b, describe)).endswith(" 1250")
    for handle, by in ((a, "ops-crash"), (b, "ops-apply")):
        facts = await _rows(
            url, "SELECT payload FROM {schema}.facts WHERE run_id = %s", handle.run_id
        )
        assert [f["payload"]["umt_settled"]["by"] for f in facts] == [by]
        final = await engine.get(handle.run_id)
        settlements = [s for s in final.timeline if s.name == "umt.attention:1:charge"]
        assert len(settlements) == 1, final.timeline
    calls = Counter(
        r["key"] for r in await _rows(url, "SELECT key FROM {schema}.effects WHERE what = 'call'")
    )
    assert calls == {"A": 1, "B": 2}, "A settled done: never called again; B not done: once more"

    # -- events: one run per (event, subscriber)
    async def fanned_out() -> list[dict[str, Any]] | None:
        runs = await _rows(
            url,
            "SELECT idempotency_key, status FROM {schema}.runs WHERE task_name = 'pgcrash.late'",
        )
        return (
            runs if len(runs) >= BATCH and all(r["status"] == "completed" for r in runs) else None
        )

    late_runs = await eventually(
        fanned_out, timeout=60, what="every event's run", on_timeout=describe
    )
    keys = Counter(r["idempotency_key"] for r in late_runs)
    assert set(keys) == {f"umt.event:{p.event_id}" for p in batch}
    assert max(keys.values()) == 1
    known_runs = await _rows(
        url, "SELECT idempotency_key FROM {schema}.runs WHERE task_name = 'pgcrash.known'"
    )
    assert Counter(r["idempotency_key"] for r in known_runs) == {
        f"umt.event:{committed.event_id}": 1,
        f"umt.event:{again.event_id}": 1,
    }
    events = await _rows(url, "SELECT key FROM {schema}.events WHERE name = %s", PLACED_EVENT)
    assert sorted(r["key"] for r in events) == ["committed", "in-flight"]
    assert all(w.alive for w in workers), describe()
    # The crash cut off the executions whose writes were held; the next took the runs over.
    for handle in (o1, b, tx):
        outcomes = [e.outcome for e in (await engine.get(handle.run_id)).executions]
        assert "interrupted" in outcomes, outcomes
        assert outcomes[-1] == "completed", outcomes


async def _result(engine: Engine, handle: RunHandle[Any], describe: Callable[[], str]) -> Any:
    await _finished(engine, handle, describe)
    return await engine.result(handle.run_id)


async def _finished(engine: Engine, handle: RunHandle[Any], describe: Callable[[], str]) -> Any:
    try:
        return (await engine.wait_idle([handle.run_id], timeout=60))[0]
    except ResultTimeoutError as exc:
        info = await engine.get(handle.run_id)
        raise AssertionError(f"{info.display_status} {info.executions}\n{describe()}") from exc


async def _frozen_in_a_transactional_step(engine: Engine, spawner: Spawner, url: str) -> None:
    """A worker frozen inside a transactional step past its lease: the step is completed by
    another, and the frozen one's commit, once thawed, is refused."""
    workers = [p for p in spawner.started if p.name.split("-")[0] in ("upd", "txe")]
    run = await engine.enqueue(post_fenced, "frozen")

    def describe() -> str:
        return "\n".join(w.describe() for w in workers)

    async def holding() -> Process | None:
        return next((w for w in workers if w.events("HELD", "frozen")), None)

    frozen = await eventually(
        holding, timeout=30, what="a worker to hold the step", on_timeout=describe
    )
    stale_token = await frozen.printed("HELD", "frozen")
    await frozen.freeze()
    (rescuer,) = [w for w in workers if w is not frozen]
    info = await _finished(engine, run, describe)
    assert info.status == "completed", f"{info.status} {info.error}\n{rescuer.describe()}"
    new_token = await rescuer.printed("POSTED", "frozen")
    assert new_token > stale_token
    assert frozen.stopped(), "completed while the first worker was still frozen"

    (spawner.workdir / "release-frozen").touch()
    frozen.signal(signal.SIGCONT)

    async def frozen_tx_ended() -> bool:
        """No transaction but the test's own has the effects table open (the frozen
        transaction ended: its commit refused, or cut off at its lost lease)."""
        rows = await fetch(
            url,
            "SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
            " WHERE c.relname = 'effects' AND l.pid <> pg_backend_pid()",
        )
        return not rows

    await eventually(
        frozen_tx_ended, timeout=30, what="the frozen transaction to end", on_timeout=describe
    )
    posted = await _rows(
        url, "SELECT token, pid FROM {schema}.effects WHERE what = 'post' AND key = 'frozen'"
    )
    assert [(r["token"], r["pid"]) for r in posted] == [(new_token, rescuer.pid)]
    assert await engine.result(run.run_id) == new_token
    assert [e.outcome for e in info.executions] == ["interrupted", "completed"]
    assert frozen.alive, frozen.describe()
