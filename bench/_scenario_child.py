"""The processes of a long-horizon scenario (see bench/_scenario.py), over bench.peers._proto.

python -m bench._scenario_child produce --dsn URL --rate R [--conns C] [--ids FILE]
python -m bench._scenario_child work    --dsn URL [--concurrency C] [--conns C] [--lease S]
                                        [--effect]

The producer enqueues 1-step runs at a fixed offered rate (open loop: runs are due on a fixed
schedule whatever the database does; at most --inflight enqueues are outstanding, and the time
the schedule falls behind is reported as `lag_s`). Each run's input is the wall-clock time its
enqueue call began. `RATE x` on stdin changes the rate. Acknowledged run ids go to --ids, one a
line, so the harness can check that every one of them completed.

The worker's handler takes its pickup latency (handler start minus the input) into a
bounded-memory histogram; once a second both processes send an EVENT with what happened in
that second (counts, and the worker's latency histogram), which the harness folds into windows.

With --effect (the chaos scenarios) the step also makes a fenced side effect: a row in
`public.bench_effects` written through `with_attempt_token` (op key `effect:<run id>`), so the
harness can count effects made twice (a zombie attempt's) and effects missing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from bench._hist import Histogram
from bench.peers._proto import send
from umt_sdk import AttemptInfo, Registry, TaskContext, connect, task, with_attempt_token

TASK = "bench_pickup"


class Stats:
    def __init__(self) -> None:
        self.hist = Histogram()
        self.started = 0
        self.finished = 0
        self.starts_total = 0
        self.finished_total = 0

    def flush(self) -> dict[str, Any]:
        out = {
            "t": time.time(),
            "started": self.started,
            "finished": self.finished,
            "starts_total": self.starts_total,
            "finished_total": self.finished_total,
            "lat": self.hist.to_json(),
        }
        self.hist = Histogram()
        self.started = 0
        self.finished = 0
        return out


STATS = Stats()


async def _noop(i: int) -> int:
    return i


EFFECTS: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None


async def _effect(run_id: str) -> int:
    """The fenced side effect of --effect: one `bench_effects` row, committed with the result."""
    assert EFFECTS is not None

    def token(info: AttemptInfo) -> int:
        return info.attempt_token

    async def record(tx: psycopg.AsyncConnection[Any], attempt_token: int) -> None:
        await tx.execute(
            "INSERT INTO public.bench_effects (run_id, token) VALUES (%s, %s)",
            (run_id, attempt_token),
        )

    async with EFFECTS.connection() as conn:
        return await with_attempt_token(conn, f"effect:{run_id}", token, commit=record)


@task(TASK, version=1)
async def bench_pickup(ctx: TaskContext[float]) -> int:
    """One no-op step; the pickup latency is taken when the handler starts."""
    STATS.hist.add(max(0.0, (time.time() - float(ctx.input)) * 1000.0))
    STATS.started += 1
    STATS.starts_total += 1
    if EFFECTS is None:
        await ctx.step.run("s0", _noop, 0)
    else:
        await ctx.step.run("s0", _effect, str(ctx.run_id))
    STATS.finished += 1
    STATS.finished_total += 1
    return 0


REGISTRY = Registry([bench_pickup])


class Commands:
    """GO / STOP / RATE x from the harness (a closed stdin means STOP)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rate: float) -> None:
        self.loop = loop
        self.go = asyncio.Event()
        self.stop = asyncio.Event()
        self.rate = rate
        threading.Thread(target=self._read, name="scenario-control", daemon=True).start()

    def _set(self, event: asyncio.Event) -> None:
        self.loop.call_soon_threadsafe(event.set)

    def _read(self) -> None:
        for line in sys.stdin:
            command, _, arg = line.strip().partition(" ")
            if command == "GO":
                self._set(self.go)
            elif command == "STOP":
                self._set(self.stop)
            elif command == "RATE":
                with contextlib.suppress(ValueError):
                    self.rate = float(arg)
        self._set(self.go)
        self._set(self.stop)


async def _ticker(stats: Any, stop: asyncio.Event) -> None:
    """Send one EVENT a second with what happened since the last one."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        send("EVENT", stats())


async def produce(args: argparse.Namespace) -> None:
    cmd = Commands(asyncio.get_running_loop(), args.rate)
    engine = await connect(
        args.dsn,
        registry=REGISTRY,
        run_migrations=False,
        min_size=args.conns,
        max_size=args.conns,
        listen=False,
    )
    ids = open(args.ids, "w", buffering=1 << 16) if args.ids else None  # noqa: SIM115, ASYNC230 - closed below; buffered writes
    counts = {"ok": 0, "errors": 0, "ok_total": 0, "errors_total": 0, "lag_s": 0.0}
    last_error: list[str] = []
    inflight: set[asyncio.Task[None]] = set()

    async def one() -> None:
        try:
            handle = await engine.enqueue(bench_pickup, time.time())
        except Exception as exc:  # counted and reported; the schedule goes on
            counts["errors"] += 1
            counts["errors_total"] += 1
            last_error[:] = [repr(exc)[:300]]
            return
        counts["ok"] += 1
        counts["ok_total"] += 1
        if ids is not None:
            ids.write(f"{handle.run_id}\n")

    def stats() -> dict[str, Any]:
        out = {
            "t": time.time(),
            "enqueued": counts["ok"],
            "errors": counts["errors"],
            "enqueued_total": counts["ok_total"],
            "errors_total": counts["errors_total"],
            "lag_s": counts["lag_s"],
            "rate": cmd.rate,
            "inflight": len(inflight),
        }
        if last_error:
            out["last_error"] = last_error[0]
        counts["ok"] = 0
        counts["errors"] = 0
        return out

    send("READY")
    await cmd.go.wait()
    ticker = asyncio.create_task(_ticker(stats, cmd.stop))
    rate = cmd.rate
    due = time.perf_counter()
    while not cmd.stop.is_set():
        if cmd.rate != rate:  # a new phase: the new schedule starts now
            rate = cmd.rate
            due = max(due, time.perf_counter())
        now = time.perf_counter()
        while due <= now and len(inflight) < args.inflight:
            t = asyncio.create_task(one())
            inflight.add(t)
            t.add_done_callback(inflight.discard)
            due += 1.0 / max(rate, 1e-6)
        counts["lag_s"] = max(0.0, now - due)
        await asyncio.sleep(max(0.0005, min(due - time.perf_counter(), 0.01)))
    if inflight:
        await asyncio.gather(*inflight, return_exceptions=True)
    await ticker
    if ids is not None:
        ids.close()
    await engine.close()
    send("RESULT", {"enqueued": counts["ok_total"], "errors": counts["errors_total"]})


async def work(args: argparse.Namespace) -> None:
    global EFFECTS
    cmd = Commands(asyncio.get_running_loop(), 0.0)
    if args.effect:
        EFFECTS = AsyncConnectionPool(
            args.dsn,
            min_size=1,
            max_size=max(2, args.concurrency // 4),
            kwargs={"autocommit": True},
            open=False,
        )
        await EFFECTS.open()
    options: dict[str, Any] = {}
    if args.conns:
        options = {"min_size": args.conns, "max_size": args.conns}
    engine = await connect(
        args.dsn, registry=REGISTRY, run_migrations=False, listen=bool(args.listen), **options
    )
    worker = engine.worker(
        versions=[f"{TASK}@1"],
        concurrency=args.concurrency,
        lease=timedelta(seconds=args.lease),
        poll_interval=timedelta(seconds=args.poll),
    )
    send("READY")
    await cmd.go.wait()
    cpu0 = time.process_time()
    ticker = asyncio.create_task(_ticker(STATS.flush, cmd.stop))
    await worker.start()
    await cmd.stop.wait()
    await worker.stop()
    await ticker
    cpu = time.process_time() - cpu0
    await engine.close()
    if EFFECTS is not None:
        await EFFECTS.close()
    send(
        "RESULT",
        {
            "starts": STATS.starts_total,
            "finished": STATS.finished_total,
            "cpu_s": cpu,
            "pid": os.getpid(),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["produce", "work"])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--conns", type=int, default=0)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--ids", default="")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--listen", type=int, default=1)
    parser.add_argument("--lease", type=float, default=10.0)
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--effect", action="store_true")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness stops us with STOP
    if args.mode == "produce":
        args.conns = args.conns or 4
        asyncio.run(produce(args))
    else:
        asyncio.run(work(args))


if __name__ == "__main__":
    main()
