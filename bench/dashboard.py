"""The dashboard's runs page over a million runs: how long it takes to answer, and what the
engine's list query reads to answer it.

Fills its own database with `--runs` runs (default 1,000,000) created over the last 30 days,
as a busy month leaves them: 20 tasks, a seventh on version 2, one run in 50 failed, one in
100 canceled, the newest 200 pending or running, and 100 runs waiting for a fact spread over the
whole month (the filter that matches few runs, all of them old), and an execution for each run
a worker claimed (four busy workers, and one that ran one run in 10,000). Then serves the dashboard
(`umt_sdk.dashboard.create_app`) with uvicorn on a loopback port and asks for the runs page
(first page and a page 90% deep through the keyset cursor, with and without filters) and the
live-update rows, `--repeats` times each over one keep-alive connection, reporting:

- the median (and min, max) wall time of a request, from the request to the last byte;
- per request, the shared buffers and rows of every statement the page ran
  (pg_stat_statements, when the server preloads it: the embedded one does);
- the plan of the engine's list query for the same filter under EXPLAIN (ANALYZE, BUFFERS):
  the index it walks, the rows it reads (returned and filtered out) and its buffers.

The figures are reported (docs/performance.md), never asserted; `tests/bench/` runs it small.
Everything lives in its own database, dropped at the end.

    python -m bench.dashboard [--database-url URL] [--runs 1000000] [--repeats 30] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode
from uuid import UUID

import psycopg

from bench._infra import Server, summary, with_dbname

DB = "bench_dashboard"
SCHEMA = "umt"
SPAN = timedelta(days=30)
TASKS = (
    "orders.charge",
    "orders.refund",
    "orders.ship",
    "orders.invoice",
    "users.signup",
    "users.verify_email",
    "users.delete",
    "reports.daily",
    "reports.monthly",
    "media.transcode",
    "media.thumbnail",
    "search.reindex",
    "billing.renew",
    "billing.dunning",
    "crm.sync",
    "crm.enrich",
    "mail.digest",
    "mail.bounce",
    "etl.import",
    "etl.export",
)
BATCH = 200_000
RUN_LINK = re.compile(
    r'href="[^"]*/runs/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-'
    r'[0-9a-f]{12})"'
)

# Each statement of a batch: run `g` of `n` (the newest is g = n), created (n - g) / n of the
# span ago, with an id of that time (uuidv7 shifted back), so id order is creation order.
FILL = """
INSERT INTO umt.runs (id, task_name, task_version, status, available_at, lease_owner,
                      lease_expires_at, fencing_token, claims, failures, input_hash, input,
                      output, error, wait_for, created_at, updated_at, finished_at)
SELECT uuidv7(s.at - now()), (%(tasks)s::text[])[g %% 20 + 1],
       CASE WHEN g %% 7 = 0 THEN 2 ELSE 1 END,
       s.status,
       CASE WHEN s.status = 'pending' THEN s.at WHEN s.status = 'running' THEN now() END,
       CASE WHEN s.status = 'running' THEN 'bench-worker-' || g %% 4 END,
       CASE WHEN s.status = 'running' THEN now() + interval '1 hour' END,
       CASE WHEN s.status = 'pending' THEN 0 ELSE 1 END,
       CASE WHEN s.status = 'pending' THEN 0 ELSE 1 END,
       CASE WHEN s.status = 'failed' THEN 3 ELSE 0 END,
       'h', jsonb_build_object('order', g, 'customer', 'c-' || g %% 5000),
       CASE WHEN s.status = 'completed' THEN jsonb_build_object('ok', true) END,
       CASE WHEN s.status = 'failed' THEN jsonb_build_object(
           'type', 'PaymentDeclined', 'message', 'card declined for order ' || g,
           'traceback', '') END,
       CASE WHEN s.status = 'waiting' THEN 'approval' END,
       s.at, s.at + interval '2 seconds',
       CASE WHEN s.status IN ('completed', 'failed', 'canceled')
            THEN s.at + interval '2 seconds' END
FROM generate_series(%(lo)s::integer, %(hi)s::integer) AS g
CROSS JOIN LATERAL (
    SELECT now() - %(span)s::interval * ((%(n)s - g)::float8 / %(n)s) AS at,
           CASE WHEN g > %(n)s - 200 THEN (ARRAY['pending', 'running'])[g %% 2 + 1]
                WHEN g %% 10000 = 5 THEN 'waiting'
                WHEN g %% 50 = 0 THEN 'failed'
                WHEN g %% 100 = 1 THEN 'canceled'
                ELSE 'completed' END AS status
) AS s
"""


def _fill(url: str, runs: int) -> float:
    """`runs` runs in umt.runs (analyzed); returns the seconds taken."""
    started = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        for lo in range(1, runs + 1, BATCH):  # bounded memory and WAL each
            hi = min(runs, lo + BATCH - 1)
            params = {"tasks": list(TASKS), "lo": lo, "hi": hi, "n": runs, "span": SPAN}
            conn.execute(FILL, params)
        # One execution per run a worker claimed: four busy workers, and one that ran a run
        # in 10,000 (the worker filter that matches few runs).
        conn.execute(
            "INSERT INTO umt.executions (run_id, fencing_token, worker_id, claimed_at, ended_at, "
            "outcome) SELECT id, 1, CASE WHEN abs(hashtext(id::text)) % 10000 = 7 "
            "THEN 'bench-worker-rare' ELSE 'bench-worker-' || abs(hashtext(id::text)) % 4 END, "
            "created_at, finished_at, status FROM umt.runs WHERE status <> 'pending'"
        )
        conn.execute("VACUUM ANALYZE umt.runs")
        conn.execute("VACUUM ANALYZE umt.executions")
    return time.monotonic() - started


def _deep_cursor(url: str, runs: int) -> UUID:
    """The id of the run 90% of the way down the newest-first list."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT id FROM umt.runs ORDER BY id OFFSET %s LIMIT 1",
            (max(0, runs // 10 - 1),),
        ).fetchone()
    assert row is not None, "no runs to page through"
    return UUID(str(row[0]))


def _scenarios(deep: UUID) -> list[tuple[str, str, dict[str, str]]]:
    """(name, path, query) of each request measured."""

    def hour(days_ago: int) -> dict[str, str]:
        start = datetime.now(UTC) - timedelta(days=days_ago)
        return {
            "created_after": start.strftime("%Y-%m-%dT%H:%M"),
            "created_before": (start + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M"),
        }

    cursor = str(deep)
    return [
        ("first page", "/runs", {}),
        ("deep page (90% in)", "/runs", {"before": cursor}),
        ("live rows (poll)", "/runs/rows", {}),
        ("status=failed", "/runs", {"status": "failed"}),
        ("status=failed, deep", "/runs", {"status": "failed", "before": cursor}),
        ("task@version", "/runs", {"task": "orders.charge@1"}),
        ("task@version, deep", "/runs", {"task": "orders.charge@1", "before": cursor}),
        ("created in an hour 7 days ago", "/runs", hour(7)),
        ("created in an hour 28 days ago", "/runs", hour(28)),
        ("worker (1 run in 4)", "/runs", {"worker": "bench-worker-1"}),
        ("worker (1 run in 10,000)", "/runs", {"worker": "bench-worker-rare"}),
        ("status=running", "/runs", {"status": "running"}),
        ("status=waiting (100 old)", "/runs", {"status": "waiting"}),
        ("run id", "/runs", {"run_id": cursor}),
    ]


# -- the dashboard, served ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """The dashboard on a loopback port, served by uvicorn in a thread with its own loop (the
    engine's pool belongs to that loop)."""

    def __init__(self, url: str) -> None:
        self.port = _free_port()
        self._started = threading.Event()
        self._failed: BaseException | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=self._run, args=(url,), name="dashboard")
        self._thread.start()
        if not self._started.wait(60) or self._failed is not None:
            raise RuntimeError(f"the dashboard did not start: {self._failed!r}")

    def _run(self, url: str) -> None:
        try:
            asyncio.run(self._serve(url))
        except BaseException as exc:
            self._failed = exc
            self._started.set()

    async def _serve(self, url: str) -> None:
        import uvicorn

        from umt_sdk import connect
        from umt_sdk.dashboard import create_app

        engine = await connect(url, schema=SCHEMA, run_migrations=False, listen=False)
        try:
            config = uvicorn.Config(
                create_app(engine),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="off",
            )
            self._server = uvicorn.Server(config)
            serving = asyncio.create_task(self._server.serve())
            while not self._server.started and not serving.done():  # noqa: ASYNC110 - a flag is all uvicorn offers
                await asyncio.sleep(0.02)
            self._started.set()
            await serving
        finally:
            await engine.close()

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(60)


def _get(conn: http.client.HTTPConnection, target: str) -> tuple[float, int, str]:
    started = time.perf_counter()
    conn.request("GET", target, headers={"Accept": "text/html"})
    response = conn.getresponse()
    body = response.read().decode("utf-8", "replace")
    return (time.perf_counter() - started) * 1000.0, response.status, body


# -- what the database did ------------------------------------------------------------------------


def _reset(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")


def _statements(url: str, requests: int) -> dict[str, Any]:
    """Per request: the statements run, their shared buffers and rows (pg_stat_statements)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, shared_blks_hit + shared_blks_read, rows "
            "FROM pg_stat_statements WHERE dbid = "
            "(SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND query NOT LIKE '%%pg_stat_statements%%'"
        ).fetchall()
    statements = sum(int(r[1]) for r in rows)
    return {
        "statements_per_request": statements / requests,
        "buffers_per_request": sum(int(r[2]) for r in rows) / requests,
        "top": [
            {
                "query": " ".join(str(r[0]).split())[:90],
                "calls_per_request": int(r[1]) / requests,
                "buffers_per_call": int(r[2]) / max(1, int(r[1])),
                "rows_per_call": int(r[3]) / max(1, int(r[1])),
            }
            for r in sorted(rows, key=lambda r: -int(r[2]))[:3]
        ],
    }


def _list_params(query: dict[str, str], page: int) -> dict[str, Any] | None:
    """What the engine binds to its list query for the dashboard's filters (None: the page
    does not list, such as a run id lookup)."""
    if "run_id" in query:
        return None
    from umt_backend_pg._sql import queries

    # Every placeholder of the query, unset unless a filter sets it.
    params: dict[str, Any] = dict.fromkeys(re.findall(r"%\((\w+)\)s", queries()["list_runs"]))
    params["limit"] = page + 1
    params["needs_attention"] = False  # a flag, not a value: unset is False, as the engine binds
    if "status" in query:
        params["status"] = query["status"]
    if "task" in query:
        name, _, version = query["task"].partition("@")
        params["task_name"] = name
        params["task_version"] = int(version) if version else None
    if "worker" in query:
        params["worker_id"] = query["worker"]
    if "before" in query:
        params["before"] = UUID(query["before"])
    for name in ("created_after", "created_before"):
        if name in query:
            params[name] = datetime.fromisoformat(query[name]).replace(tzinfo=UTC)
    return params


def _scans(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if "Scan" in node["Node Type"]:
        yield node
    for child in node.get("Plans", ()):
        yield from _scans(child)


def _explain(url: str, params: dict[str, Any]) -> dict[str, Any]:
    """The engine's list query for these values under EXPLAIN (ANALYZE, BUFFERS)."""
    from psycopg import sql

    from umt_backend_pg._sql import queries, render

    text = render(queries()["list_runs"], SCHEMA)
    query = sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + sql.SQL(text)  # type: ignore[arg-type]
    with psycopg.connect(url, autocommit=True) as conn:
        plan = conn.execute(query, params, prepare=False).fetchone()[0][0]  # type: ignore[index]
    top = plan["Plan"]
    scans = list(_scans(top))
    return {
        "scans": [
            f"{s['Node Type']} {s.get('Index Name', s.get('Relation Name', ''))}".strip()
            for s in scans
        ],
        "rows_read": sum(
            s["Actual Rows"] * s.get("Actual Loops", 1) + s.get("Rows Removed by Filter", 0)
            for s in scans
        ),
        "rows_returned": top["Actual Rows"],
        "buffers": top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0),
        "execution_ms": plan["Execution Time"],
    }


# -- the run --------------------------------------------------------------------------------------


def _measure(url: str, args: argparse.Namespace, statements: bool) -> list[dict[str, Any]]:
    deep = _deep_cursor(url, args.runs)
    served = Served(url)
    results: list[dict[str, Any]] = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
        for name, path, query in _scenarios(deep):
            target = f"{path}?{urlencode(query)}" if query else path
            for _ in range(3):  # warm up: plans, caches, templates
                _get(conn, target)
            if statements:
                _reset(url)
            times: list[float] = []
            listed: set[str] = set()
            for _ in range(args.repeats):
                ms, status, body = _get(conn, target)
                if status != 200:
                    raise SystemExit(f"{target}: HTTP {status}\n{body[:2000]}")
                times.append(ms)
                listed = set(RUN_LINK.findall(body))
            row: dict[str, Any] = {
                "scenario": name,
                "target": target,
                "runs_shown": len(listed),
                "ms": summary(times),
            }
            if statements:
                row["statements"] = _statements(url, args.repeats)
            params = _list_params(query, args.page)
            if params is not None:
                row["list_query"] = _explain(url, params)
            results.append(row)
            print(json.dumps(row), flush=True)
        conn.close()
    finally:
        served.stop()
    return results


def _report(out: dict[str, Any]) -> None:
    print(f"\nthe runs page over {out['runs']:,} runs (median of {out['repeats']} requests):")
    print(
        f"{'':<32}{'ms':>8}{'runs':>6}{'stmts':>7}{'buffers':>9}"
        f"{'list: rows read':>17}{'buffers':>9}  index"
    )
    for row in out["results"]:
        st = row.get("statements", {})
        lq = row.get("list_query", {})
        print(
            f"{row['scenario']:<32}{row['ms']['median']:>8.1f}{row['runs_shown']:>6}"
            f"{st.get('statements_per_request', float('nan')):>7.1f}"
            f"{st.get('buffers_per_request', float('nan')):>9.0f}"
            f"{lq.get('rows_read', float('nan')):>17,.0f}{lq.get('buffers', float('nan')):>9.0f}"
            f"  {', '.join(lq.get('scans', ()))}"
        )


def _run(args: argparse.Namespace) -> dict[str, Any]:
    server = Server.start(args.database_url)
    with server.connect() as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {DB}")
    url = with_dbname(server.admin_url, DB)
    out: dict[str, Any] = {"runs": args.runs, "repeats": args.repeats, "page": args.page}
    try:
        from umt_backend_pg import migrate

        if server.statements:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        asyncio.run(migrate(url, schema=SCHEMA))
        out["fill_seconds"] = _fill(url, args.runs)
        print(json.dumps({"filled": args.runs, "seconds": out["fill_seconds"]}), flush=True)
        out["settings"] = {"pg_stat_statements": server.statements, "notes": server.notes}
        out["results"] = _measure(url, args, server.statements)
    finally:
        server.drop_db(DB)
    _report(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", help="use this server (default: embedded, temp dir)")
    p.add_argument("--runs", type=int, default=1_000_000, help="runs in the database")
    p.add_argument("--repeats", type=int, default=30, help="requests measured per scenario")
    p.add_argument("--page", type=int, default=50, help="the dashboard's page size")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    if args.runs < 1000:
        raise SystemExit("--runs: at least 1000 (the scenarios need failed and waiting runs)")
    result = _run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
