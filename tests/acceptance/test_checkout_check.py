"""examples/checkout's CI step, `umt check --registry tasks:registry --against histories/`, run
as CI runs it (the real `umt` command, in the project's directory, no database): it passes
on the project's code, and fails, naming the run and the step, on copies of the project with
a change that breaks the recorded runs in flight."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from umt_sdk import RunHistory

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "checkout"
HISTORIES = RunHistory.from_jsonl(
    (PROJECT / "histories" / "in-flight.jsonl").read_text(encoding="utf-8")
)


def umt_check(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "umt_sdk.cli", "check", "--registry", "tasks:registry", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=project,
        env={k: v for k, v in os.environ.items() if k not in ("UMT_DATABASE_URL", "UMT_REGISTRY")},
    )


def changed_copy(tmp_path: Path, old: str, new: str) -> Path:
    """The project copied, with one change made to its tasks."""
    copy = tmp_path / "checkout"
    shutil.copytree(PROJECT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    tasks = copy / "tasks.py"
    text = tasks.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} is not once in tasks.py"
    tasks.write_text(text.replace(old, new), encoding="utf-8")
    return copy


def test_the_recorded_set_is_what_the_readme_says() -> None:
    assert len(HISTORIES) == 5
    assert [h.status for h in HISTORIES] == ["waiting"] * 4 + ["pending"]
    markers = [[s.name for s in h.steps if s.name.startswith("umt.patch:")] for h in HISTORIES]
    assert markers == [[], [], [], ["umt.patch:fraud-check"], []]


def test_the_project_passes_its_check() -> None:
    done = umt_check(PROJECT, "--against", "histories/")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "checked 5 run(s) of checkout@1 (5): every one replays on this code" in done.stdout


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        (
            'ctx.step.run("quote", price',
            'ctx.step.run("price-quote", price',
            "step 'price-quote'   <- differs",
        ),
        (
            "    amount_cents: int\n    currency: str",
            "    amount_cents: str\n    currency: str",
            "type drift in step 'quote': the recorded",
        ),
    ],
    ids=["renamed-step", "type-drift"],
)
def test_a_breaking_change_fails_the_check_naming_run_and_step(
    tmp_path: Path, old: str, new: str, says: str
) -> None:
    project = changed_copy(tmp_path, old, new)
    done = umt_check(project, "--against", "histories/in-flight.jsonl")
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"
    assert says in done.stdout, done.stdout
    for history in HISTORIES[:4]:  # every run that recorded its quote
        assert f"run {history.run_id}" in done.stdout, done.stdout
    assert str(HISTORIES[4].run_id) not in done.stdout  # pending: it records its quote anew
    assert "checked 5 run(s) of checkout@1 (5): 4 would break on this code" in done.stderr


def test_unpatched_lists_the_runs_past_the_patch_point() -> None:
    done = umt_check(PROJECT, "--against", "histories/", "--unpatched", "fraud-check")
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"
    listed = [line.split()[2] for line in done.stdout.splitlines()]
    assert listed == [str(h.run_id) for h in HISTORIES[:3]]
    assert "3 of 5 live run(s) in histories/ still take the old branch" in done.stderr
