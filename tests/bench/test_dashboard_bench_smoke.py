"""Smoke check of `python -m bench.dashboard`: with a few thousand runs in the session's
Postgres it serves the dashboard, asks for every scenario of the runs page and reports each
one's latency, the runs shown and the plan of the engine's list query. Never a timing
assertion: the figures of the million-run run go to docs/performance.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = [
    "first page",
    "deep page (90% in)",
    "live rows (poll)",
    "status=failed",
    "status=failed, deep",
    "task@version",
    "task@version, deep",
    "created in an hour 7 days ago",
    "created in an hour 28 days ago",
    "worker (1 run in 4)",
    "worker (1 run in 10,000)",
    "status=running",
    "status=waiting (100 old)",
    "run id",
]


@pytest.mark.slow
def test_dashboard_bench_reports_every_scenario(pg_url: str, tmp_path: Path) -> None:
    out = tmp_path / "dashboard.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.dashboard",
            "--runs",
            "3000",
            "--repeats",
            "2",
            "--database-url",
            pg_url,
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    try:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        report = json.loads(out.read_text())
        rows = {row["scenario"]: row for row in report["results"]}
        assert list(rows) == SCENARIOS
        for name, row in rows.items():
            assert row["ms"]["median"] > 0, name
            assert len(row["ms"]["reps"]) == 2, name
            if name != "run id":
                plan = row["list_query"]
                assert plan["scans"], name
                assert plan["rows_read"] >= plan["rows_returned"], name
            if report["settings"]["pg_stat_statements"]:
                assert row["statements"]["statements_per_request"] >= 1, name
        # The pages show what the filters select: a full first page, one run for its id.
        assert rows["first page"]["runs_shown"] == 50
        assert rows["deep page (90% in)"]["runs_shown"] == 50
        assert rows["live rows (poll)"]["runs_shown"] == 50
        assert rows["run id"]["runs_shown"] == 1
        assert 0 < rows["status=failed"]["runs_shown"] <= 50
        assert "the runs page over 3,000 runs" in proc.stdout
        with psycopg.connect(pg_url, autocommit=True) as conn:  # the bench drops its database
            left = conn.execute(
                "SELECT count(*) FROM pg_database WHERE datname = 'bench_dashboard'"
            ).fetchone()
        assert left == (0,)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS bench_dashboard WITH (FORCE)")
