"""Smoke check of `python -m bench.fairness_claim`, run small: every figure is written, each
claim takes its 16 runs, and acme's run starts behind the fair backlog while in enqueue order
it does not within the cut. Never a buffer or latency threshold (those go to
docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fairness_bench_writes_every_figure(pg_url: str, tmp_path: Path) -> None:
    out = tmp_path / "fairness.json"
    argv = [sys.executable, "-m", "bench.fairness_claim", "--database-url", pg_url]
    argv += ["--keys", "100", "--backlog", "1500", "--claims", "3", "--pickups", "2"]
    argv += ["--baseline-wait", "1", "--json", str(out)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())

    for scenario in ("unkeyed", "fair_keys", "unkeyed_backlog", "fair_backlog"):
        assert result[scenario]["buffers_per_claim_median"] > 0, scenario
        assert result[scenario]["runs_per_claim_median"] == 16, scenario
    fair = result["pickup_fair"]
    assert fair["started"] == fair["pickups"] == 2, fair
    assert fair["wait_ms"]["median"] > 0, fair
    # In enqueue order, acme's run waits for the backlog (1,500 runs, more than a second's
    # worth for 16 slots of one in-process worker is not assumed: only that it was measured).
    assert result["pickup_in_enqueue_order"]["pickups"] == 1
    assert result["machine"]["cpu_count"]
    with psycopg.connect(pg_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname = 'bench_fairness_claim'"
        )
        assert row.fetchone() == (0,)
