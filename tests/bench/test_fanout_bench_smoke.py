"""Smoke check of `python -m bench.fanout`: it runs against the session's Postgres and reports,
for each way of fanning out, the work per child and how often the parent was claimed. Never a
timing assertion: the figures go to docs/performance.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fanout_bench_reports_the_work_per_child(pg_url: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fanout", "--children", "12", "--database-url", pg_url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        ways = [row for row in rows if "way" in row]
        assert [row["way"] for row in ways] == [
            "each",
            "gather",
            "map",
            "map (max_concurrency=10)",
        ]
        settings = next(row["settings"] for row in rows if "settings" in row)
        for row in ways:
            assert row["children"] == 12
            assert row["transactions_per_child"] > 0
            if settings["pg_stat_statements"]:  # the session's server may not preload it
                assert row["statements_per_child"] > 0
                assert row["buffers_per_child"] > 0
                assert row["top_statements"], row
        # The parent of a gather or a map is claimed to start, and woken once.
        assert [row["parent_claims"] for row in ways[1:]] == [2, 2, 2]
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS bench_fanout WITH (FORCE)")
