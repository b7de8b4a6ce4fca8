"""Smoke check of the benchmark harness: `python -m bench --quick --umt-only` runs against the
session's Postgres and writes every figure. Never a timing assertion: numbers are reported by
`make bench`, not judged here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

KEYS = (
    "raw_ceiling",
    "drain_1step",
    "drain_10step",
    "db_work_per_step",
    "client_cpu_per_step_ms",
    "enqueue_to_start_ms",
    "claim_ms_foreign_backlog",
    "recovery_after_sigkill_s",
    "memory_backend_runs_per_s",
)

NUMERIC_PATHS = (
    ("raw_ceiling", "runs_per_s", "median"),
    ("raw_ceiling", "lifecycle", "runs_per_s", "median"),
    ("drain_1step", "umt", "runs_per_s", "median"),
    ("drain_1step", "umt", "steps_per_s", "median"),
    ("drain_1step", "ratio_vs_ceiling", "median"),
    ("drain_10step", "umt", "runs_per_s", "median"),
    ("drain_10step", "umt", "steps_per_s", "median"),
    ("db_work_per_step", "umt", "xact_per_step", "median"),
    ("db_work_per_step", "umt", "xact_per_run", "median"),
    ("db_work_per_step", "umt", "wal_bytes_per_step", "median"),
    ("db_work_per_step", "umt", "wal_bytes_per_run", "median"),
    ("client_cpu_per_step_ms", "umt", "median"),
    ("enqueue_to_start_ms", "listen", "p50"),
    ("enqueue_to_start_ms", "listen", "p99"),
    ("enqueue_to_start_ms", "poll", "p50"),
    ("enqueue_to_start_ms", "poll", "p99"),
    ("claim_ms_foreign_backlog", "umt", "p50"),
    ("claim_ms_foreign_backlog", "umt", "p99"),
    ("claim_ms_foreign_backlog", "legacy", "p50"),
    ("recovery_after_sigkill_s", "lease_2s", "recovery_s", "median"),
    ("recovery_after_sigkill_s", "lease_2s", "reexecuted_completed_steps"),
    ("recovery_after_sigkill_s", "lease_10s", "recovery_s", "median"),
    ("recovery_after_sigkill_s", "lease_10s", "reexecuted_completed_steps"),
    ("memory_backend_runs_per_s", "runs_per_s", "median"),
)


def _at(data: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        assert isinstance(data, dict), f"{'.'.join(path)}: not an object at {key!r}"
        assert key in data, f"missing {'.'.join(path)} (at {key!r})"
        data = data[key]
    return data


@pytest.mark.slow
def test_quick_umt_only_writes_every_figure(pg_url: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--umt-only",
            "--json",
            str(out),
            "--database-url",
            pg_url,
            "--results-dir",
            str(tmp_path / "results"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    for key in KEYS:
        assert key in data, f"missing key {key}"
    for path in NUMERIC_PATHS:
        value = _at(data, path)
        assert isinstance(value, int | float), (path, value)
        assert not isinstance(value, bool), (path, value)
        assert math.isfinite(value), (path, value)
    # Peers are skipped in this mode and reported as such, not dropped.
    assert "missing" in data["drain_1step"]["dbos"]
    assert "missing" in data["drain_10step"]["dbos"]
    assert "missing" in data["drain_1step"]["pgqueuer"]
    assert isinstance(data["claim_ms_foreign_backlog"]["explain_umt"], str)
    assert {t["target"] for t in data["targets"]}
    assert (tmp_path / "results" / "results.md").exists()
