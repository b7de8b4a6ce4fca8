"""Smoke check of `python -m bench.explore`: it explores the ten-step workflow at both depths
and reports its figures. Never a timing assertion: the numbers are read, not judged here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_explorer_benchmark_reports_both_depths() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.explore", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    depth_1, depth_2 = results["depth_1"], results["depth_2"]
    # Ten steps, one of them fenced: 2 points a step, 5 for the fenced phases, 1 ending.
    assert depth_1["crash_points"] == 2 * 10 + 5 + 1
    assert depth_1["runs"] == depth_1["crash_points"] + 2
    assert depth_2["runs"] > depth_1["runs"] * 10
    for figures in (depth_1, depth_2):
        assert figures["wall_s"]["median"] > 0
        assert figures["cpu_s"]["median"] > 0
