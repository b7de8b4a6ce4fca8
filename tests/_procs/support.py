"""The test process's side of real processes: workers (`tests/_procs/worker.py`) and any other
program a test runs as one (the outbox relay).

A `Spawner` belongs to one test (a fixture opens it with `Spawner.under(tmp_path, ...)`): it
starts the processes with their stdout and stderr in files under `<tmp>/logs`, hands them the
folder `<tmp>/files` for the test's switch and receipt files, and SIGKILLs and reaps every
one it started when the test ends (a stopped one too), before the fixture's schema or server
goes. A `Process` is read and signalled while it runs: `wait_ready()`, `wait_for(marker)`,
`events(event, key)`, `printed(event, key)`, `signal()`, `freeze()`, `stopped()`, `kill()`.

Also the reads these tests poll while the processes work: `eventually`, `fetch`, `q`,
`finished`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar, cast
from uuid import UUID

import attrs
import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from tests._procs.worker import READY
from umt_sdk import Engine, RunInfo

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests._procs.worker"


class Process:
    """One `python -m <module> ARGS` process in the repository root; its stdout and stderr go
    to `<logs>/<name>.out` and `.err`."""

    def __init__(
        self,
        module: str,
        args: Sequence[str],
        *,
        name: str,
        logs: Path,
        workdir: Path,
        prefix: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.workdir = workdir
        self.out_path = logs / f"{name}.out"
        self.err_path = logs / f"{name}.err"
        self._out: IO[bytes] = self.out_path.open("wb")
        self._err: IO[bytes] = self.err_path.open("wb")
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, *args],
            stdout=self._out,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT,
            env=env,
        )
        self.pid = self.popen.pid

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def errors(self) -> str:
        return self.err_path.read_text(errors="replace")

    def lines(self) -> list[str]:
        return self.output().splitlines()

    def describe(self) -> str:
        return (
            f"process {self.name} (pid {self.pid}, exit {self.popen.poll()})\n"
            f"--- stdout ---\n{self.output()[-3000:]}\n--- stderr ---\n{self.errors()[-6000:]}"
        )

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    async def wait_for(self, marker: str, *, timeout: float = 30.0) -> str:
        """The first line the process printed that starts with `marker`, once there is one;
        fails if the process exits without it or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            exited = not self.alive  # before the read: a line printed just before exit counts
            line = next((x for x in self.lines() if x.startswith(marker)), None)
            if line is not None:
                return line
            if exited:
                raise AssertionError(f"exited without a {marker!r} line\n{self.describe()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {marker!r} line after {timeout} s\n{self.describe()}")
            await asyncio.sleep(0.02)

    async def wait_ready(self, timeout: float = 20.0) -> None:
        """Until a worker serves (its `READY` line)."""
        await self.wait_for(READY, timeout=timeout)

    def events(self, event: str, key: str | None = None) -> list[list[str]]:
        """The `<event> <key> <token>` lines the process printed (for `key`, when given)."""
        found = []
        for line in self.lines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == event and (key is None or parts[1] == key):
                found.append(parts)
        return found

    async def printed(self, event: str, key: str, *, timeout: float = 30.0) -> int:
        """Wait for the process to print `<event> <key> <token>`; return the token."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.events(event, key)
            if found:
                return int(found[0][2])
            if time.monotonic() > deadline:
                raise AssertionError(f"no {event} {key} after {timeout} s\n{self.describe()}")
            await asyncio.sleep(0.02)

    def signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP), as the kernel says."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "T"

    async def freeze(self, timeout: float = 10.0) -> None:
        """SIGSTOP, and wait until the kernel has stopped the process (SIGCONT thaws it)."""
        self.signal(signal.SIGSTOP)
        await eventually(self.stopped, timeout=timeout, what=f"SIGSTOP to land on {self.name}")

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.alive:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def close(self) -> None:
        """Kill whatever is left (a stopped process too) and close the log files."""
        try:
            self.kill()
        finally:
            self._out.close()
            self._err.close()


@attrs.define
class Spawner:
    """Starts the processes of one test and kills every one of them at `close()`.

    Its fields are what the workers it starts share: the module of their tasks, the engine's
    database and schema, the business table or database of their side effects, their poll
    interval. `start()` takes what differs from one worker to the next."""

    logs: Path
    workdir: Path
    tasks: str = ""
    url: str = ""
    schema: str = ""
    business: str = ""
    business_url: str = ""
    poll: float = 1.0
    started: list[Process] = attrs.field(factory=list)

    @classmethod
    @contextlib.contextmanager
    def under(cls, tmp: Path, **fields: Any) -> Iterator[Spawner]:
        """A spawner with its folders in `tmp`, closed (every process killed) at exit."""
        logs, workdir = tmp / "logs", tmp / "files"
        logs.mkdir()
        workdir.mkdir()
        spawner = cls(logs=logs, workdir=workdir, **fields)
        try:
            yield spawner
        finally:
            spawner.close()

    def start(
        self,
        *,
        versions: str = "",
        lease: float = 1.0,
        group: str = "default",
        concurrency: int = 4,
        poll: float | None = None,
        grace: float = 1.0,
        max_size: int = 0,
        url: str | None = None,
        prune: float = 60.0,
        prefix: Sequence[str] = (),
        pooled: bool = False,
        listen_url: str = "",
    ) -> Process:
        """A worker process (`tests/_procs/worker.py`) serving `versions` (all when empty)
        as worker `<group>-<pid>`; its process is named `<group>-<n>`. A `prefix` runs it
        under another program (`ip netns exec NS`: in a network namespace)."""
        args = [
            *("--tasks", self.tasks, "--url", url or self.url, "--schema", self.schema),
            *("--lease", str(lease), "--group", group, "--concurrency", str(concurrency)),
            *("--poll", str(self.poll if poll is None else poll), "--grace", str(grace)),
            *("--workdir", str(self.workdir), "--prune", str(prune)),
        ]
        if versions:
            args += ["--versions", versions]
        if max_size:
            args += ["--max-size", str(max_size)]
        if self.business:
            args += ["--business", self.business]
        if self.business_url:
            args += ["--business-url", self.business_url]
        if pooled:  # `url` goes through PgBouncer: poll, or LISTEN on `listen_url`
            args += ["--pooled", *(["--listen-url", listen_url] if listen_url else [])]
        return self.run(WORKER, *args, name=f"{group}-{len(self.started)}", prefix=prefix)

    def run(self, module: str, *args: str, name: str, prefix: Sequence[str] = ()) -> Process:
        """Any program: `python -m <module> ARGS` (under `prefix`, when given)."""
        proc = Process(module, args, name=name, logs=self.logs, workdir=self.workdir, prefix=prefix)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        errors = []
        for proc in self.started:
            try:
                proc.close()
            except Exception as exc:  # keep killing the others
                errors.append(f"{proc.name}: {exc!r}")
        if errors:
            raise RuntimeError(f"could not stop processes: {errors}")


async def eventually(
    check: Callable[[], Awaitable[T] | T],
    *,
    timeout: float,
    what: str,
    interval: float = 0.02,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll `check()` (a coroutine function or a plain one) until it returns something
    truthy; return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return cast(T, value)  # what check() gave, awaited if it was awaitable
        if time.monotonic() > deadline:
            extra = f"\n{on_timeout()}" if on_timeout is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{extra}")
        await asyncio.sleep(interval)


async def fetch(url: str, query: sql.Composable | str, params: Any = None) -> list[dict[str, Any]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(query, params)
        return await cur.fetchall()


def q(text: str, schema: str, **tables: str) -> sql.Composed:
    """`text` with `{schema}` and other `{name}` placeholders filled with identifiers."""
    return sql.SQL(text).format(
        schema=sql.Identifier(schema), **{k: sql.Identifier(v) for k, v in tables.items()}
    )


async def finished(engine: Engine, run_id: UUID, *, timeout: float = 60.0) -> RunInfo:
    """The run once it has ended (`engine.wait_idle`)."""
    info: RunInfo = (await engine.wait_idle([run_id], timeout=timeout))[0]
    return info


async def killed_itself(process: Process, marker: Path, *, timeout: float = 60.0) -> None:
    """Wait until `process` is gone, and check that it was its own kill point
    (`tests._procs.kill`): SIGKILLed, after its `DYING` line, with the point's `marker` file
    written."""
    deadline = time.monotonic() + timeout
    while process.alive:
        assert time.monotonic() < deadline, process.describe()
        await asyncio.sleep(0.05)
    assert process.popen.returncode == -signal.SIGKILL, process.describe()
    assert process.events("DYING"), process.describe()
    assert marker.exists(), process.describe()  # noqa: ASYNC240  # one stat of a local file
