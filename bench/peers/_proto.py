"""The line protocol between the harness and one workload process (stdlib only).

The peers' scripts import this file too (they run in their own virtualenv, without umt).

    child -> harness (stdout):  READY | EVENT <json> | RESULT <json>
    harness -> child (stdin):   GO | STOP

Anything else the child or its libraries print on stdout is sent to stderr instead, so only
protocol lines reach the harness.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

__all__ = ["Control", "send"]

_OUT: list[Any] = []


def _out() -> Any:
    """The protocol stream: the original stdout; fd 1 itself is pointed at stderr."""
    if not _OUT:
        _OUT.append(os.fdopen(os.dup(1), "w", buffering=1))
        os.dup2(2, 1)
        sys.stdout = sys.stderr
    return _OUT[0]


def send(kind: str, payload: Any = None) -> None:
    """Write one protocol line."""
    line = kind if payload is None else f"{kind} {json.dumps(payload)}"
    out = _out()
    out.write(line + "\n")
    out.flush()


class Control:
    """GO / STOP from the harness, as threading events (a closed stdin means both)."""

    def __init__(self) -> None:
        _out()
        self.go = threading.Event()
        self.stop = threading.Event()
        self.t_go = 0.0
        self.cpu_go = 0.0
        threading.Thread(target=self._read, name="bench-control", daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            command = line.strip()
            if command == "GO":
                self.t_go = time.time()
                self.cpu_go = time.process_time()
                self.go.set()
            elif command == "STOP":
                self.stop.set()
        self.go.set()
        self.stop.set()

    def cpu_since_go(self) -> float:
        return time.process_time() - self.cpu_go
