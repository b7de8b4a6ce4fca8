"""The agent examples (`examples/agents/*.py`) run as a user runs them, offline: each prints
its story, and the refund is paid once after the crash and the two-day approval."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

AGENTS = Path(__file__).resolve().parents[2] / "examples" / "agents"
SCRIPTS = sorted(p.name for p in AGENTS.glob("*.py"))


def test_there_is_an_example_per_integration() -> None:
    assert SCRIPTS == ["openai_agents_refund.py", "pydantic_ai_refund.py"]


@pytest.mark.parametrize("script", SCRIPTS, ids=str)
def test_agent_example_runs(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI")}  # no key, no calls
    done = subprocess.run(
        [sys.executable, str(AGENTS / script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
        cwd=AGENTS.parents[1],
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    lines = done.stdout.splitlines()
    assert "crashes (like kill -9)" in lines[0], done.stdout
    assert "waits for 'support/approval/call-2'" in lines[1], done.stdout
    assert lines[3] == "answer: Done: refunded 49.99 EUR on A-17. Sorry for the trouble!"
    assert "refunds paid: {'A-17': 1}" in lines, done.stdout
