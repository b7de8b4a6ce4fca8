"""Smoke check of `python -m bench.parked`: one worker idles beside parked runs, and every run
that comes due in the window is picked up. It checks what the bench reports and that no due
run was missed, never a CPU, memory or latency figure (those go to docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_parked_bench_wakes_every_due_run_beside_parked_ones(pg_url: str, tmp_path: Path) -> None:
    out = tmp_path / "parked.json"
    argv = [sys.executable, "-m", "bench.parked", "--database-url", pg_url]
    argv += ["--parked", "2000", "--due", "12", "--seconds", "8", "--json", str(out)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())

    assert [p["parked"] for p in result["phases"]] == [0, 2000]
    for phase in result["phases"]:
        assert phase["due_started"] == phase["due"] == 12, phase
        assert phase["due_missed"] == 0, phase
        assert phase["wake_up_ms"]["n"] == 12, phase
        assert phase["worker_cpu_s_per_min"] > 0, phase
        assert phase["worker_rss_mb"] > 0, phase
        assert phase["db_transactions_per_min"] > 0, phase
    assert "wake-up p50/p99 ms" in proc.stdout
    # The bench's database is gone.
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT count(*) FROM pg_database WHERE datname = 'bench_parked'")
        assert row.fetchone() == (0,)
