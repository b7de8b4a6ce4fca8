"""`umt_sdk.agents` imports without either framework; each name says which extra it needs."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
sys.modules[{blocked!r}] = None  # as if the framework were not installed
import umt_sdk.agents
from umt_sdk.agents import FencedTool, current_attempt
try:
    from umt_sdk.agents import {name}
except ImportError as exc:
    print(exc)
else:
    print("imported")
"""


@pytest.mark.parametrize(
    ("blocked", "name", "extra"),
    [("pydantic_ai", "UmtAgent", "pydantic-ai"), ("agents", "UmtRunner", "openai-agents")],
)
def test_a_missing_framework_names_the_extra(blocked: str, name: str, extra: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(blocked=blocked, name=name)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert f"pip install 'umt-tasks[{extra}]'" in done.stdout, done.stdout + done.stderr
    assert f"umt_sdk.agents.{name} needs the {extra} extra" in done.stdout
