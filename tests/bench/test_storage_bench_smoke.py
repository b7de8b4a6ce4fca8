"""Smoke check of `python -m bench.storage`: it drains its runs and reports the bytes each
engine table grew by and the WAL per step. It checks the report's shape and that the figures
are those of real rows (the steps table grew by at least the three 100-character outputs of
each run), never a size or WAL target (those go to docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_storage_bench_reports_the_bytes_of_finished_runs(pg_url: str, tmp_path: Path) -> None:
    out = tmp_path / "storage.json"
    argv = [sys.executable, "-m", "bench.storage", "--database-url", pg_url]
    argv += ["--runs", "60", "--steps", "3", "--payload", "100", "--json", str(out)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())

    assert (result["runs"], result["steps_per_run"], result["payload_chars"]) == (60, 3, 100)
    for phase in ("after_drain", "after_vacuum"):
        tables = result[phase]["by_table"]
        assert {"runs", "steps", "executions"} <= set(tables), tables
        steps = sum(tables["steps"].values())
        assert steps > 3 * 100, tables["steps"]
        assert tables["runs"]["heap"] > 0, tables
        assert result[phase]["bytes_per_run"] >= steps
    assert result["wal_bytes_per_step"] > 100
    assert result["wal_bytes_per_run"] > 3 * result["wal_bytes_per_step"]
    assert "bytes per finished run" in proc.stdout
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT count(*) FROM pg_database WHERE datname = 'bench_storage'")
        assert row.fetchone() == (0,)
