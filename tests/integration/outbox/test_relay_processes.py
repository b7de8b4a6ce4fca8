"""Relays in several processes: no row dispatched twice, no run enqueued twice, and a relay
SIGKILLed mid-batch loses nothing, in both layouts (same database, two databases)."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import psycopg

from tests._procs.support import Spawner
from tests.integration.outbox._support import (
    calls,
    eventually,
    insert_items,
    runs_per_key,
    start_relay,
    status_counts,
)
from umt_backend_pg import install_outbox

ROWS = 3000


def _args(business: str, engine_url: str, schema: str, *extra: str) -> list[str]:
    return [
        "--business-url",
        business,
        "--engine-url",
        engine_url,
        "--schema",
        schema,
        *extra,
    ]


async def _all_dispatched(url: str, schema: str, total: int) -> bool:
    return await status_counts(url, schema) == {"dispatched": total}


async def test_two_relay_processes_never_dispatch_a_row_twice(
    layout: str, pg_url: str, pg_schema: str, relays: Spawner
) -> None:
    async with await psycopg.AsyncConnection.connect(layout, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)
    expected_mode = "same" if layout == pg_url else "separate"
    started = [
        start_relay(relays, name, *_args(layout, pg_url, pg_schema, "--batch", "50"))
        for name in ("r1", "r2")
    ]
    for relay in started:
        ready = await relay.wait_for("READY")
        assert ready == f"READY {expected_mode}", relay.describe()
    # 10 transactions of 300 rows: each NOTIFY wakes both relays, which then compete
    await insert_items(layout, pg_schema, range(ROWS))
    await eventually(
        lambda: _all_dispatched(layout, pg_schema, ROWS),
        timeout=90,
        what=f"{ROWS} rows dispatched",
    )
    for relay in started:
        relay.signal(signal.SIGTERM)
    done = [(await relay.wait_for("DONE")).split() for relay in started]
    created = [int(d[1]) for d in done]
    dispatched = [int(d[2]) for d in done]

    routed = Counter(n for relay in started for n in calls(relay))
    twice = {n: c for n, c in routed.items() if c != 1}
    assert len(routed) == ROWS, f"{len(routed)} of {ROWS} rows routed"
    assert twice == {}, f"{len(twice)} rows routed more than once: {list(twice.items())[:10]}"
    assert sum(dispatched) == ROWS, f"dispatched per relay: {dispatched}"
    assert sum(created) == ROWS, f"runs created per relay: {created}"
    assert all(d > 0 for d in dispatched), f"one relay did all the work: {dispatched}"
    per_key = await runs_per_key(pg_url, pg_schema)
    assert len(per_key) == ROWS, f"{len(per_key)} idempotency keys for {ROWS} rows"
    assert set(per_key.values()) == {1}, f"keys with >1 run: {Counter(per_key.values())}"


async def test_a_relay_killed_mid_batch_loses_and_doubles_nothing(
    layout: str, pg_url: str, pg_schema: str, relays: Spawner
) -> None:
    total = 400
    async with await psycopg.AsyncConnection.connect(layout, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)
    await insert_items(layout, pg_schema, range(total))
    same = layout == pg_url
    # one row at a time (with two databases the relay may enqueue several rows at once)
    args = _args(layout, pg_url, pg_schema, "--batch", "100", "--concurrency", "1")
    # the victim blocks inside its 3rd batch, on the 250th row it routes
    victim = start_relay(relays, "victim", *args, "--pause-after", "250")
    await victim.wait_for("PAUSED")
    before = await status_counts(layout, pg_schema)
    runs_before = await runs_per_key(pg_url, pg_schema)
    victim.kill()
    # the 3rd batch was in flight: 200 rows committed, 49 routed in the open transaction
    assert before == {"dispatched": 200, "pending": total - 200}, before
    if same:
        # the run and the row's status commit together: no run for a pending row
        assert len(runs_before) == 200, f"{len(runs_before)} runs for 200 dispatched rows"
    else:
        # enqueued in the engine's database, not yet marked: the window the key covers
        assert len(runs_before) == 249, f"{len(runs_before)} runs before the kill"
    await asyncio.sleep(0.2)
    after_kill = await status_counts(layout, pg_schema)
    assert after_kill == before, f"the killed batch changed rows: {after_kill}"

    successor = start_relay(relays, "successor", *args)
    await successor.wait_for("READY")
    await eventually(
        lambda: _all_dispatched(layout, pg_schema, total),
        timeout=60,
        what=f"{total} rows dispatched after the restart",
    )
    successor.signal(signal.SIGTERM)
    created, dispatched = map(int, (await successor.wait_for("DONE")).split()[1:])
    assert dispatched == total - 200, f"the successor dispatched {dispatched}"
    # two databases: the 49 runs the victim enqueued are found under their keys, not redone
    assert created == (total - 200 if same else total - 249), f"the successor created {created}"
    per_key = await runs_per_key(pg_url, pg_schema)
    assert len(per_key) == total, f"{len(per_key)} idempotency keys for {total} rows"
    assert set(per_key.values()) == {1}, f"keys with >1 run: {Counter(per_key.values())}"
    # rows are claimed in id order: the victim routed 0..249, the successor the 200 rows of
    # the batch that died with it and after, each once
    assert sorted(calls(victim)) == list(range(250)), f"victim routed {len(calls(victim))}"
    assert sorted(calls(successor)) == list(range(200, total)), (
        f"successor routed {len(calls(successor))}"
    )
