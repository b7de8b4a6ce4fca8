"""Every example runs to completion as a user would run it.

The numbered examples are `examples/NN_*.py` and `examples/NN_*/run.py`. Those that use
Postgres (they import `umt_backend_pg`) get the session's test database as `UMT_DATABASE_URL`;
each makes and drops a schema of its own, so runs never collide.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = sorted(
    str(p.relative_to(EXAMPLES))
    for pattern in ("[0-9][0-9]_*.py", "[0-9][0-9]_*/run.py")
    for p in EXAMPLES.glob(pattern)
)


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
        cwd=EXAMPLES.parent,
    )


def test_the_examples_are_numbered_without_gaps() -> None:
    numbers = sorted({int(script[:2]) for script in SCRIPTS})
    assert numbers == list(range(len(numbers))), SCRIPTS
    assert len(numbers) >= 10, SCRIPTS  # 00 to 09, as README.md lists them


@pytest.mark.parametrize("script", SCRIPTS, ids=str)
def test_example_runs(script: str, request: pytest.FixtureRequest) -> None:
    env = dict(os.environ)
    if "umt_backend_pg" in (EXAMPLES / script).read_text(encoding="utf-8"):
        env["UMT_DATABASE_URL"] = request.getfixturevalue("pg_url")
    done = _run([str(EXAMPLES / script)], env)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{script} printed nothing"


@pytest.mark.parametrize(
    "script", ["07_testing_with_fakeclock.py", "09_explore_crashes.py"], ids=str
)
def test_the_testing_examples_are_pytest_modules(script: str) -> None:
    example = EXAMPLES / script
    done = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(example)], dict(os.environ))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "3 passed" in done.stdout, done.stdout
