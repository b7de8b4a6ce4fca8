"""Kill points of the task modules of the chaos tests: a worker process (`tests._procs.worker`)
SIGKILLs itself, after a `DYING ...` line for the test, at a point of its executions
(`umt_sdk._probe`) or of its own code. A kill meant once per test is marked by a file in the
worker's `--workdir`, so the next worker lets the run go on. Only inside a worker process."""

from __future__ import annotations

import os
import signal

from tests._procs.worker import config, say, write_first
from umt_sdk._probe import _OBSERVER, Point, PointKind

__all__ = ["die", "first_time", "kill_once_at"]


def die(*words: object) -> None:
    """Print `DYING <words>` and SIGKILL this process (as an OOM kill or a power cut would)."""
    say("DYING", *words)
    os.kill(os.getpid(), signal.SIGKILL)


def first_time(marker: str) -> bool:
    """Whether this process is the first of the test to get here: the one that creates the
    file `marker` in the workdir (atomically, whatever the other processes do)."""
    path = config().workdir / marker
    return not path.exists() and write_first(path, str(os.getpid())) == str(os.getpid())


def kill_once_at(kind: PointKind, name: str, *, marker: str) -> None:
    """Watch this process's executions: the first time in the test (`marker`) that one
    reaches the point `kind` of the step `name`, die there (`DYING <name> <pid>`)."""

    def watch(point: Point) -> bool:
        if point.kind == kind and point.name == name and first_time(marker):
            die(point.name, os.getpid())
        return False  # never a simulated crash: the kill is real

    _OBSERVER.set(watch)
