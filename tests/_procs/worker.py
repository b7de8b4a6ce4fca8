"""The worker process of the tests that kill, freeze and restart workers.

    python -m tests._procs.worker --tasks tests.integration.tasks --url URL --schema S
        --workdir DIR [--versions t_io@1,t_agent@1] [--lease 1] [--group default]
        [--concurrency 4] [--poll 1] [--grace 1] [--max-size N] [--business TABLE]
        [--business-url URL] [--pooled [--listen-url URL]]

It imports the module `--tasks` (its list `TASKS` of task definitions, and its optional
`SCHEDULES` and `RETENTION`: the registry's schedules and `connect(retention=...)`, pruned
every `--prune` seconds) and serves those tasks
with `engine.worker(...)`, the pairs of `--versions` or all of them, as worker `<group>-<pid>`,
until SIGTERM stops it gracefully. It prints `READY pid=<pid> worker=<worker id>` once it
serves and `STOPPED` after a graceful stop, and exits at once when the test process that
started it is gone. `tests._procs.support.Spawner` starts it.

The tasks read what the test passed with `config()` (the engine's URL and schema, the group,
the folder of the test's switch and receipt files, the business table or database of their
side effects) and print the lines the test waits for with `say()`. The test process imports
the same task modules to enqueue; `config()` is only read where a task runs.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import attrs

from umt_sdk import Registry, connect

READY = "READY"
STOPPED = "STOPPED"


@attrs.frozen
class WorkerConfig:
    url: str
    schema: str
    group: str
    workdir: Path
    business: str
    """A business table in the schema, for tasks whose side effects write one."""
    business_url: str
    """A business database (another one), for tasks whose side effects write there."""


_CONFIG: list[WorkerConfig] = []


def config() -> WorkerConfig:
    """The worker's configuration; only inside a worker process."""
    if not _CONFIG:
        raise RuntimeError("these tasks read their configuration only inside tests._procs.worker")
    return _CONFIG[0]


def say(*words: object) -> None:
    """One line for the test, flushed at once (the test reads the output file as it grows)."""
    print(*words, flush=True)


async def until_file(name: str, *, limit: float | None = 60.0, interval: float = 0.02) -> bool:
    """Wait until the test creates the switch file `name` in the workdir (at most `limit`
    seconds; forever when None); whether it did."""
    path = config().workdir / name
    waited = 0.0
    while not path.exists():
        if limit is not None and waited >= limit:
            return False
        await asyncio.sleep(interval)
        waited += interval
    return True


def write_first(path: Path, content: str) -> str:
    """Create `path` with `content` unless it exists (atomically: the first write wins, in any
    process); return what the file holds."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    scratch.write_text(content)
    try:
        os.link(scratch, path)  # fails if another attempt created it first
    except FileExistsError:
        pass
    finally:
        scratch.unlink()
    return path.read_text()


def append_line(path: Path, line: str) -> None:
    """Append `line` with one small `write` (atomic among the processes appending to `path`)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def stop_on_sigterm() -> asyncio.Event:
    """An event SIGTERM sets (a graceful stop); the running loop's."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    return stop


async def exit_when_orphaned(parent: int) -> None:
    """Die with the test process: a process must not outlive a test run that was killed."""
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


def _pooler_options(args: argparse.Namespace) -> dict[str, object]:
    """`--pooled` (the URL goes through PgBouncer in transaction mode): poll, or LISTEN on
    `--listen-url`."""
    if not args.pooled:
        return {}
    if args.listen_url:
        return {"pooled": True, "listen_url": args.listen_url}
    return {"pooled": True, "listen": False}


async def serve(args: argparse.Namespace) -> None:
    module = importlib.import_module(args.tasks)
    tasks = module.TASKS
    _CONFIG.append(
        WorkerConfig(
            url=args.url,
            schema=args.schema,
            group=args.group,
            workdir=Path(args.workdir),
            business=args.business,
            business_url=args.business_url,
        )
    )
    stop = stop_on_sigterm()
    orphan_watch = asyncio.create_task(exit_when_orphaned(os.getppid()))
    engine = await connect(
        args.url,
        registry=Registry(tasks, schedules=getattr(module, "SCHEDULES", ())),
        schema=args.schema,
        run_migrations=False,
        max_size=args.max_size or args.concurrency + 4,
        retention=getattr(module, "RETENTION", None),
        **_pooler_options(args),
    )
    async with engine:
        worker = engine.worker(
            versions=args.versions.split(",") if args.versions else None,
            concurrency=args.concurrency,
            lease=timedelta(seconds=args.lease),
            worker_id=f"{args.group}-{os.getpid()}",
            poll_interval=timedelta(seconds=args.poll),
            shutdown_grace=timedelta(seconds=args.grace),
            prune_interval=timedelta(seconds=args.prune),
        )
        async with worker:
            say(f"{READY} pid={os.getpid()} worker={worker.worker_id}")
            await stop.wait()
    orphan_watch.cancel()
    say(STOPPED)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", required=True, help="module whose TASKS the worker serves")
    parser.add_argument("--url", required=True, help="the engine's database")
    parser.add_argument("--schema", required=True)
    parser.add_argument("--versions", default="", help="comma-separated name@version pairs")
    parser.add_argument("--lease", type=float, default=1.0, help="lease in seconds")
    parser.add_argument("--group", default="default", help="worker group: ids <group>-<pid>")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--poll", type=float, default=1.0, help="poll interval in seconds")
    parser.add_argument("--grace", type=float, default=1.0, help="shutdown grace in seconds")
    parser.add_argument("--prune", type=float, default=60.0, help="retention pass, seconds")
    parser.add_argument("--max-size", type=int, default=0, help="pool size (concurrency + 4)")
    parser.add_argument("--workdir", required=True, help="the test's switch and receipt files")
    parser.add_argument("--business", default="", help="business table in the schema")
    parser.add_argument("--business-url", default="", help="business database")
    parser.add_argument("--pooled", action="store_true", help="--url is through PgBouncer")
    parser.add_argument("--listen-url", default="", help="with --pooled: a direct URL to LISTEN")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(serve(args))


if __name__ == "__main__":
    # Run the importable copy of this module, not `__main__`: the task modules import
    # `tests._procs.worker`, and `config()` must read the configuration `serve` stored there.
    from tests._procs.worker import main as _main

    _main()
