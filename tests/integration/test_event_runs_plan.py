"""`engine.events()` finds an event's runs through the partial index `runs_event_key`
(migration 0026), not by reading the runs: the runs table keys idempotency by task name first,
so without it a lookup by key alone would scan every run."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import psycopg
from psycopg import sql

from umt_backend_pg import migrate
from umt_backend_pg._events import _queries

RUNS = 20_000


def _walk(plan: Any, nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(plan, dict):
        if "Node Type" in plan:
            nodes.append(plan)
        for value in plan.values():
            _walk(value, nodes)
    elif isinstance(plan, list):
        for value in plan:
            _walk(value, nodes)
    return nodes


def test_an_events_runs_are_read_through_their_index(pg_url: str) -> None:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    asyncio.run(migrate(pg_url, schema=schema))
    s = sql.Identifier(schema)
    try:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            # Runs of ten tasks; one in a hundred started by an event (key umt.event:<n>), a
            # third with another idempotency key.
            conn.execute(
                sql.SQL(
                    "INSERT INTO {s}.runs (id, task_name, task_version, status, input_hash, "
                    "input, idempotency_key) "
                    "SELECT uuidv7(-(g * interval '1 second')), 'task' || g %% 10, 1, "
                    "'completed', 'h', '{{}}', "
                    "CASE WHEN g %% 100 = 0 THEN 'umt.event:' || (g / 100) "
                    "     WHEN g %% 3 = 0 THEN 'key-' || g END "
                    "FROM generate_series(1, %s) AS g"
                ).format(s=s),
                (RUNS,),
            )
            conn.execute(sql.SQL("VACUUM ANALYZE {}.runs").format(s))
            cur = psycopg.ClientCursor(conn)
            cur.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + _queries(schema)["event_runs"],
                {"keys": ["umt.event:7", "umt.event:8", "umt.event:9"]},
            )
            row = cur.fetchone()
            assert row is not None
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(s))
    (plan,) = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    nodes = _walk(plan["Plan"], [])
    assert "Seq Scan" not in {n["Node Type"] for n in nodes}, json.dumps(plan, indent=1)
    assert any(n.get("Index Name") == "runs_event_key" for n in nodes), json.dumps(plan, indent=1)
    assert plan["Plan"]["Actual Rows"] == 3
