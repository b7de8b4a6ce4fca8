"""Smoke check of `python -m bench.worker_curve --quick`: every workload at its process count
reports every figure, and every run was stored (enqueue) or completed (drains) exactly once.
Never a timing or cost assertion: the figures go to docs/performance.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = ("enqueue", "drain_1step", "drain_10step")
ALWAYS = (
    "runs_per_s",
    "client_cpu_ms_per_run",
    "xact_per_run",
    "wal_bytes_per_run",
    "cores_busy",
    "cores_ours",
)


@pytest.mark.slow
def test_worker_curve_reports_every_figure_and_runs_each_run_once(
    pg_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "curve.json"
    argv = [sys.executable, "-m", "bench.worker_curve", "--quick", "--database-url", pg_url]
    argv += ["--json", str(out)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())

    assert result["exactly_once"] is True, result["failures"]
    assert result["failures"] == []
    statements = result["settings"]["pg_stat_statements"]
    server_cpu = result["server_cpu_measured"]
    assert set(result["curve"]) == set(WORKLOADS)
    for workload in WORKLOADS:
        points = result["curve"][workload]
        assert list(points) == ["2"], points.keys()
        folded = points["2"]
        assert folded["exactly_once"] is True
        [point] = folded["repetitions"]
        assert point["processes"] == 2
        for figure in ALWAYS:
            assert isinstance(point[figure], float), (workload, figure, point[figure])
            assert point[figure] > 0, (workload, figure, point[figure])
            assert folded[figure]["median"] == point[figure]
        for figure, present in (
            ("statements_per_run", statements),
            ("buffers_per_run", statements),
            ("server_cpu_ms_per_run", server_cpu),
        ):
            assert (point[figure] is not None) is present, (workload, figure)
        check = point["check"]
        if workload == "enqueue":
            assert check == {"stored": 200, "distinct_inputs": 200}
        else:
            n, k = (200, 1) if workload == "drain_1step" else (40, 10)
            assert check == {
                "completed": n,
                "runs": n,
                "executions": n,
                "runs_executed": n,
                "steps": n * k,
                "handler_starts": n,
            }
    assert "| drain_10step | 2 |" in proc.stdout
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT count(*) FROM pg_database WHERE datname = 'bench_curve'")
        assert row.fetchone() == (0,)
