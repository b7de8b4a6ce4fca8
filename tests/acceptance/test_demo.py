"""`make demo`'s story runs to the end and proves exactly-once (against the test Postgres)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo" / "demo.py"


def test_demo_tells_the_whole_story(pg_url: str) -> None:
    schema = f"demo_{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [sys.executable, str(DEMO), "--schema", schema],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "UMT_DATABASE_URL": pg_url},
    )
    out = done.stdout
    assert done.returncode == 0, f"demo failed:\n{out}\n{done.stderr}"
    for line in (
        "SIGKILL io-1",
        "took ubuntu-",
        "cancel ubuntu-6: ",
        "the urgent summary started #",
        "exactly-once: 5 submissions for 5 completed downloads (max 1 per item)",
        "0 completed steps run again",
        "transfer   step  interrupted",
        "on io-1: interrupted",
        "done; inspect with: umt --schema",
        f"see it in a browser: umt --schema {schema} dashboard",
    ):
        assert line in out, f"missing {line!r} in:\n{out}"
    assert "lost the lease" not in done.stderr, done.stderr
