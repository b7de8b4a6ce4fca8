"""Smoke check of the long-horizon scenario harness: `python -m bench --scenario NAME --quick`
runs each phase for a few seconds against the session's Postgres. It checks what the harness
records and that no run was lost, never a latency or throughput figure. The chaos scenarios
(backends terminated, the server crashed and restarted, workers SIGKILLed) must also show the
fault happened and every completed run's fenced effect made exactly once."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PHASES = {
    "clean": ["warmup", "clean", "drain"],
    "idle-in-tx": ["warmup", "clean", "idle-in-tx", "recovery", "drain"],
    "active-readers": ["warmup", "clean", "active-readers", "recovery", "drain"],
    "high-load": ["warmup", "clean", "high-load", "recovery", "drain"],
    "pg-backend-kill": ["warmup", "clean", "backend-kill", "recovery", "drain"],
    "postgres-restart": ["warmup", "clean", "postgres-restart", "recovery", "drain"],
    "repeated-kill": ["warmup", "clean", "worker-kill", "recovery", "drain"],
}
CHAOS = {"pg-backend-kill", "postgres-restart", "repeated-kill"}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(PHASES))
def test_quick_scenario_records_windows_and_loses_nothing(
    scenario: str, pg_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "scenario.json"
    argv = [
        sys.executable,
        "-m",
        "bench",
        "--scenario",
        scenario,
        "--quick",
        # postgres-restart crashes the server: the bench's own embedded one, not the suite's.
        *(["--database-url", pg_url] if scenario != "postgres-restart" else []),
        "--results-dir",
        str(tmp_path / "results"),
        "--json",
        str(out),
    ]
    if scenario in CHAOS:  # long enough for the faults and a lease to lapse after them, and for
        # a clean phase that sees a pickup on a loaded 2-core machine (2 s saw none once)
        argv += ["--rate", "50", "--phase-seconds", "6", "--clean-seconds", "4"]
    elif scenario != "idle-in-tx":  # one of them measures the drain rate first, as by default
        argv += ["--rate", "50", "--phase-seconds", "2", "--clean-seconds", "2"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())

    assert [p["phase"] for p in data["phases"]] == PHASES[scenario]
    runs = data["runs"]
    assert runs["acknowledged"] > 0
    assert runs["runs_lost"] == 0, runs
    assert runs["found"] == runs["acknowledged"] == runs["completed"], runs
    if scenario in CHAOS:
        # Every completed run made its fenced effect, and none made it twice. Counted over all
        # the task's runs: an enqueue that committed just before a crash or a cut session is a
        # run that completes although the producer never heard back (not acknowledged).
        assert runs["effects"] == runs["statuses"]["completed"], runs
        assert runs["effects_doubled"] == 0, runs
        assert runs["effects_missing"] == 0, runs
    else:  # a cut session or a crashed server may fail an enqueue: counted, never acknowledged
        assert runs["producer_errors"] == 0
    if scenario == "idle-in-tx":
        assert data["calibration"]["drain_runs_per_s"] > 0

    windows = data["windows"]
    for phase in PHASES[scenario][:-1]:
        mine = [w for w in windows if w["phase"] == phase]
        assert mine, f"no window recorded for {phase}"
        assert sum(w["pickup"]["n"] for w in mine) > 0, phase
        for w in mine:
            if w["unreachable_samples"]:  # the server was down for this window's samples
                assert scenario == "postgres-restart", w
                continue
            assert w["wait_samples"] >= 1, w
            for table in ("runs", "steps", "executions"):
                assert isinstance(w["tables"][table]["dead"], int), (phase, table)
                assert w["tables"][table]["total_bytes"] > 0, (phase, table)
    total = sum(w["pickup"]["n"] for w in windows)
    if scenario != "repeated-kill":  # a SIGKILLed worker's last second of pickups dies with it
        assert total >= runs["acknowledged"]  # every completed run's pickup is in some window

    by_phase = {p["phase"]: p for p in data["phases"]}
    for phase in PHASES[scenario][1:-1]:
        p = by_phase[phase]
        pk = p["pickup"]
        assert pk["p50_ms"] <= pk["p95_ms"] <= pk["p99_ms"] <= pk["max_ms"], pk
        assert "Execution Time" in p["explain_claim"], phase
    if scenario == "idle-in-tx":
        assert isinstance(by_phase["idle-in-tx"]["xid"], int)
        held = [w for w in windows if w["phase"] == "idle-in-tx"]
        assert all(w["oldest_xmin_age"] and w["oldest_xmin_age"] > 0 for w in held)
    if scenario == "active-readers":
        assert by_phase["active-readers"]["scans"] > 0
        assert by_phase["active-readers"]["errors"] == []
    if scenario == "pg-backend-kill":
        assert by_phase["backend-kill"]["backend_kills"] > 0
        assert by_phase["backend-kill"]["errors"] == []
    if scenario == "postgres-restart":
        assert by_phase["postgres-restart"]["restarts"] == 1
        assert by_phase["postgres-restart"]["errors"] == []
    if scenario == "repeated-kill":
        assert by_phase["worker-kill"]["worker_kills"] >= 2
    if scenario == "high-load":
        assert by_phase["high-load"]["offered_per_s"] == pytest.approx(
            1.5 * by_phase["clean"]["offered_per_s"]
        )

    stem = "scenario_" + scenario.replace("-", "_")
    results = tmp_path / "results"
    assert (results / f"{stem}.json").exists()
    assert "per window:" in (results / f"{stem}.txt").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (results / f"{stem}.png").exists()
