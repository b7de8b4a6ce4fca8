"""Smoke check of `python -m bench.deploy_check`: with a few live runs in the session's
Postgres it reports every figure, the in-process check and the `umt check` command both find
every run replaying. Never a timing assertion: the figures go to docs/performance.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg

REPO = Path(__file__).resolve().parents[2]


def test_the_deploy_check_bench_reports_every_figure(pg_url: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.deploy_check",
            "--runs",
            "40",
            "--repeats",
            "1",
            "--database-url",
            pg_url,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    try:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert rows[0] == {"seeded_runs": 40, "seed_s": rows[0]["seed_s"]}
        (repeat,) = [row for row in rows if "repeat" in row]
        assert repeat["runs"] == 40
        assert repeat["command_says"] == (
            "checked 40 run(s) of bench.checkout@1 (40): every one replays on this code"
        )
        for key in ("read_s", "replay_s", "total_s", "read_cpu_s", "replay_cpu_s", "command_s"):
            assert repeat[key] > 0, key
            assert key in rows[-1]["median"]
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS bench_deploy_check WITH (FORCE)")
