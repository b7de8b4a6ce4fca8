"""Smoke check of `python -m bench.codecs`: it runs against the session's Postgres and writes
every figure, for every codec. Never a timing assertion: `make bench` reports, nothing judges."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODECS = ("none", "zlib", "aes-gcm", "zlib+aes-gcm")
FIGURES = (
    "client_cpu_ms_per_run",
    "extra_cpu_ms_per_run",
    "payload_bytes_per_run",
    "bytes_vs_none",
    "wal_bytes_per_run",
    "runs_per_s",
)


def test_the_codec_bench_writes_every_figure(pg_url: str, tmp_path: Path) -> None:
    out = tmp_path / "codecs.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.codecs",
            "--database-url",
            pg_url,
            "--runs",
            "20",
            "--steps",
            "2",
            "--reps",
            "1",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert set(data["per_run"]) == set(CODECS)
    for codec in CODECS:
        for figure in FIGURES:
            assert data["per_run"][codec][figure] >= 0 or figure == "extra_cpu_ms_per_run"
    assert set(data["seal_open_us"]) == set(CODECS) - {"none"}
