"""Listing stays fast with many runs: each page reads an index in run-id order from the cursor
and stops after the page, whatever the number of runs behind it.

200,000 runs (a tenth tagged, a third keyed, some children, one in a thousand needing
attention), analyzed; each filter shape of `list_runs` / `list_runs_tagged` is run under EXPLAIN
(ANALYZE, BUFFERS) with a page of 51 and the values the backend would bind (the backend never
prepares listing statements, so each one is planned with its values). No sequential scan, and
the rows and buffers read are those of about one page (of the matching runs, for a filter that
matches one run in ten), not of the table.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from umt_backend_pg import migrate
from umt_backend_pg._sql import queries, render

RUNS = 200_000
PAGE = 51


@pytest.fixture(scope="module")
def many(pg_url: str) -> Iterator[str]:
    """One schema for the module (filling it is the slow part), dropped afterwards."""
    pg_schema = f"t_{uuid.uuid4().hex[:12]}"
    asyncio.run(migrate(pg_url, schema=pg_schema))
    s = sql.Identifier(pg_schema)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {s}.runs (id, task_name, task_version, status, input_hash, input, "
                "idempotency_key, created_at, finished_at, parent_run_id, tags, wait_for) "
                "SELECT uuidv7(-(g * interval '1 second')), 'task' || g %% 10, 1, "
                "CASE WHEN g %% 50 = 0 THEN 'failed' WHEN g %% 1000 = 7 THEN 'waiting' "
                "     ELSE 'completed' END, 'h', '{{}}', "
                "CASE WHEN g %% 3 = 0 THEN 'key-' || g END, "
                "now() - g * interval '1 second', "
                "CASE WHEN g %% 1000 <> 7 THEN now() - g * interval '1 second' END, "
                "CASE WHEN g %% 97 = 0 THEN '00000000-0000-7000-8000-000000000001'::uuid END, "
                "CASE WHEN g %% 10 = 0 THEN jsonb_build_object('tenant', 't' || g %% 7, "
                "                                              'region', 'r' || g %% 3) "
                "     ELSE '{{}}' END, "
                "CASE WHEN g %% 1000 = 7 THEN 'umt.attention:1:charge' END "
                "FROM generate_series(1, %s) AS g"
            ).format(s=s),
            (RUNS,),
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {s}.run_tags (run_id, key, value) "
                "SELECT r.id, t.key, t.value FROM {s}.runs r, jsonb_each_text(r.tags) AS t"
            ).format(s=s)
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}.runs").format(s))
        conn.execute(sql.SQL("VACUUM ANALYZE {}.run_tags").format(s))
    yield pg_schema
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(s))


def _params(**given: Any) -> dict[str, Any]:
    params: dict[str, Any] = dict.fromkeys(
        (
            "task_name",
            "task_version",
            "status",
            "parent_run_id",
            "concurrency_key",
            "idempotency_key",
            "created_after",
            "created_before",
            "finished_after",
            "finished_before",
            "worker_id",
            "before",
        )
    )
    params["limit"] = PAGE
    params["needs_attention"] = False
    params.update(given)
    tags = params.pop("tags", None)
    if tags:
        params["tag_key"], params["tag_value"] = min(tags.items())
        params["tags"] = Jsonb(tags)
    return params


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


NOW = datetime.now(UTC)
SHAPES: dict[str, dict[str, Any]] = {
    "newest": {},
    "task": {"task_name": "task3"},
    "task and status": {"task_name": "task3", "status": "completed"},
    "parent": {"parent_run_id": "00000000-0000-7000-8000-000000000001"},
    "key of a task": {"task_name": "task3", "idempotency_key": "key-3"},
    "one tag": {"tags": {"tenant": "t3"}},
    "two tags": {"tags": {"tenant": "t3", "region": "r1"}},
    "tag and task": {"tags": {"tenant": "t3"}, "task_name": "task0"},
    "created in the last day": {"created_after": NOW - timedelta(days=1)},
    "finished in the last hour": {"finished_after": NOW - timedelta(hours=1)},
    "needing attention": {"needs_attention": True},
}


# A time window is a filter on the scan in run-id order: its first pages (a window that ends
# now, as people page through it) read about a page; a cursor far below the window's runs
# would read on to the end of the table (docs/retention.md says so).
WINDOWS = {"created in the last day", "finished in the last hour"}
CASES = [(shape, False) for shape in sorted(SHAPES)] + [
    (shape, True) for shape in sorted(SHAPES) if shape not in WINDOWS
]


@pytest.mark.parametrize(
    ("shape", "deep"), CASES, ids=[f"{s} ({'deep' if d else 'first'} page)" for s, d in CASES]
)
def test_a_page_reads_about_one_page(shape: str, deep: bool, pg_url: str, many: str) -> None:
    given = dict(SHAPES[shape])
    with psycopg.connect(pg_url, autocommit=True) as conn:
        if deep:  # the cursor of a page half-way through the table
            row = conn.execute(
                sql.SQL("SELECT id FROM {}.runs ORDER BY id DESC OFFSET %s LIMIT 1").format(
                    sql.Identifier(many)
                ),
                (RUNS // 2,),
            ).fetchone()
            assert row is not None
            given["before"] = row[0]
        params = _params(**given)
        name = "list_runs_tagged" if "tag_key" in params else "list_runs"
        text = render(queries()[name], many)
        cur = psycopg.ClientCursor(conn)
        cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + text, params)
        row = cur.fetchone()
        assert row is not None
    (plan,) = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    nodes = _walk(plan["Plan"], [])
    kinds = {n["Node Type"] for n in nodes}
    assert "Seq Scan" not in kinds, f"{shape}: a sequential scan\n{json.dumps(plan, indent=1)}"
    read = max(
        n["Actual Rows"] * n.get("Actual Loops", 1) + n.get("Rows Removed by Filter", 0)
        for n in nodes
        if n["Node Type"].startswith("Index") or n["Node Type"].startswith("Bitmap")
    )
    buffers = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
    # A page of 51 that matches one run in ten (a task, a tag) reads ~510 entries.
    assert read <= 20 * PAGE, f"{shape}: read {read} rows for a page of {PAGE}"
    assert buffers <= 2_000, f"{shape}: {buffers} buffers for a page"
