"""examples/download_approval runs end to end against the test Postgres and proves its checks:
outbox rows dispatched once, a lost client reply reconciled, @1 and @2 served across a deploy,
and the nightly schedule fanning out one child per deferred plan, woken once."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "download_approval" / "run.py"


def test_download_approval_end_to_end(pg_url: str, tmp_path: Path) -> None:
    schema = f"dl_{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--schema", schema, "--data", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "UMT_DATABASE_URL": pg_url},
    )
    out = done.stdout
    assert done.returncode == 0, f"the example failed:\n{out}\n{done.stderr[-5000:]}"
    for line in (
        "the relay started their runs; all three wait for an operator's approval",
        "deployed release 2 (io-r2 serves @1 and @2); the old relay stopped (relay dispatched 3)",
        "they start download_plan@2",
        "the retry was told info.resumed and found the job by its tag",
        "exactly-once: 5 client jobs for 5 plans (max 1 per plan) despite the lost reply",
        "outbox: {'dispatched': 10}",
        "download_plan@1 runs in flight: 0",
        "triggered the nightly_downloads schedule (0 2 * * *, Europe/Paris) by hand",
        "the night fanned out 3 download_plan@2 children for 3 deferred plans (two at once), "
        "3 assets recorded; its run was woken 1 time(s) for all of them",
        "] done",
    ):
        assert line in out, f"missing {line!r} in:\n{out}"
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("plan-")]
    assert len(rows) == 5, out
    assert sorted(r[1] for r in rows) == ["1", "1", "1", "2", "2"], rows
    assert all(r[2:5] == ["done", "1", "1"] for r in rows), rows
    assert (tmp_path / "library").is_dir()
    assert len(list((tmp_path / "library").glob("plan-*.bin"))) == 5 + 3  # 3 in the night
    assert "Traceback" not in done.stderr, done.stderr[-5000:]
