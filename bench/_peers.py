"""The peers' virtualenv: created and filled by the harness, never the project's own."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench._infra import BENCH_DIR, REPO_ROOT

__all__ = ["PEERS", "REQUIREMENTS", "default_venv", "prepare"]

REQUIREMENTS = BENCH_DIR / "requirements-peers.txt"
PEERS = ("dbos", "pgqueuer", "procrastinate")


def default_venv() -> Path:
    return REPO_ROOT / ".venv-bench-peers"


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def prepare(venv: Path, *, install: bool = True) -> tuple[Path | None, dict[str, Any]]:
    """Make sure `venv` has the pinned peers; return its python and each peer's status.

    A peer that cannot be installed or imported is reported as {"missing": reason}.
    """
    python = venv / "bin" / "python"
    status: dict[str, Any] = {}
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    stamp = venv / ".bench-requirements"
    if install and (
        not python.exists() or not stamp.exists() or stamp.read_text().strip() != digest
    ):
        _log(f"installing peers into {venv} from {REQUIREMENTS.name} (one time) ...")
        try:
            if not python.exists():
                subprocess.run(
                    [sys.executable, "-m", "venv", str(venv)],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
            proc = subprocess.run(
                [
                    str(python),
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "-r",
                    str(REQUIREMENTS),
                ],
                capture_output=True,
                text=True,
                timeout=900,
            )
            if proc.returncode == 0:
                stamp.write_text(digest + "\n")
            else:
                reason = "pip install failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
                _log(reason)
                for peer in PEERS:
                    status[peer] = {"missing": reason}
        except (OSError, subprocess.SubprocessError) as exc:
            reason = f"could not create the peers' virtualenv: {exc}"
            _log(reason)
            return None, {peer: {"missing": reason} for peer in PEERS}
    if not python.exists():
        reason = f"no peers' virtualenv at {venv} (run without --no-install-peers)"
        return None, {peer: {"missing": reason} for peer in PEERS}
    for peer in PEERS:
        if peer in status:
            continue
        proc = subprocess.run(
            [
                str(python),
                "-c",
                f"import importlib.metadata as m, {peer}; print(m.version('{peer}'))",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode == 0:
            status[peer] = {"version": proc.stdout.strip()}
        else:
            tail = (proc.stderr.strip().splitlines() or ["import failed"])[-1]
            status[peer] = {"missing": f"cannot import {peer} in {venv}: {tail}"}
    return python, status
