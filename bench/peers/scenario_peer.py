"""A peer's processes in a long-horizon scenario (peers' virtualenv; see bench/_scenario.py).

    python scenario_peer.py install --system S --dsn URL
    python scenario_peer.py produce --system S --dsn URL --rate R [--conns C] [--ids FILE]
    python scenario_peer.py work    --system S --dsn URL [--concurrency C] [--lease S]
                                    [--effect]

S is pgqueuer or procrastinate. The same protocol and the same EVENTs as
bench/_scenario_child.py (umt's), so the harness folds both alike: the producer enqueues 1-step
jobs open loop at --rate (the payload is the wall-clock time the enqueue began; `RATE x` on
stdin changes the rate) and writes each acknowledged job id to --ids; the worker takes the
pickup latency (handler start minus the payload) into a histogram and, with --effect, writes one
row `public.bench_effects (run_id bigint)` per execution, on its own autocommit connection
before the job is acknowledged. The peers have no fencing token: an execution a fault
interrupted after its effect and before its acknowledgement is run again, and its effect made
twice. That is what the chaos scenarios count.

Each peer is set up as its documentation says a fault-tolerant deployment should be:
- pgqueuer: `heartbeat_timeout` = --lease (a job whose heartbeat is older is picked again);
- procrastinate: worker heartbeat every --lease/4 s, and every second each worker retries the
  jobs of stalled workers (heartbeat older than --lease), the documented `retry_stalled_jobs`
  recipe.
A worker whose run loop fails (its session cut, the server restarted) is started again in the
same process after 0.2 s, as a supervisor would; `loop_restarts` in its RESULT counts them.
Effects are written with up to 50 attempts (a cut session, a server coming back), as an
application would retry its own write.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from _proto import send

from bench._hist import Histogram

QUEUE = "bench"
ENTRYPOINT = "bench_pickup"


class Stats:
    def __init__(self) -> None:
        self.hist = Histogram()
        self.started = 0
        self.finished = 0
        self.starts_total = 0
        self.finished_total = 0
        self.effect_errors = 0

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
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        send("EVENT", stats())


# -- the effect -------------------------------------------------------------------------------


class Effects:
    """One `bench_effects` row per execution, on a small autocommit pool, retried."""

    def __init__(self, dsn: str, size: int) -> None:
        from psycopg_pool import AsyncConnectionPool

        self.pool = AsyncConnectionPool(
            dsn, min_size=1, max_size=size, kwargs={"autocommit": True}, open=False
        )

    async def open(self) -> None:
        await self.pool.open()

    async def close(self) -> None:
        await self.pool.close()

    async def write(self, job_id: int) -> None:
        import psycopg

        for attempt in range(50):
            try:
                async with self.pool.connection(timeout=10) as conn:
                    await conn.execute(
                        "INSERT INTO public.bench_effects (run_id) VALUES (%s)", (job_id,)
                    )
                return
            except (psycopg.Error, OSError, TimeoutError) as exc:
                STATS.effect_errors += 1
                if attempt == 49:
                    raise
                print(f"effect {job_id}: {exc!r}", file=sys.stderr)
                await asyncio.sleep(0.2)


EFFECTS: list[Effects] = []


async def handle(job_id: int, enqueued_at: float) -> None:
    STATS.hist.add(max(0.0, (time.time() - enqueued_at) * 1000.0))
    STATS.started += 1
    STATS.starts_total += 1
    if EFFECTS:
        await EFFECTS[0].write(job_id)
    STATS.finished += 1
    STATS.finished_total += 1


# -- pgqueuer ---------------------------------------------------------------------------------


async def _pgq_queries(dsn: str):  # type: ignore[no-untyped-def]  # peers venv; no pgqueuer types here
    import psycopg
    from pgqueuer import PsycopgDriver, Queries

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    return conn, Queries(PsycopgDriver(conn))


async def pgq_install(dsn: str) -> None:
    conn, queries = await _pgq_queries(dsn)
    await queries.install()
    await conn.close()


class PgqProducer:
    """--conns connections, each its own `Queries`; a cut one is reconnected on next use."""

    def __init__(self, dsn: str, n: int) -> None:
        self.dsn = dsn
        self.free: asyncio.Queue[Any] = asyncio.Queue()
        for _ in range(n):
            self.free.put_nowait(None)

    async def enqueue(self, t: float) -> int:
        slot = await self.free.get()
        try:
            if slot is None or slot[0].closed or slot[0].broken:
                if slot is not None:
                    with contextlib.suppress(Exception):
                        await slot[0].close()
                slot = None
                slot = await _pgq_queries(self.dsn)
            ids = await slot[1].enqueue(ENTRYPOINT, json.dumps(t).encode(), 0)
            return int(ids[0])
        finally:
            self.free.put_nowait(slot)

    async def close(self) -> None:
        while not self.free.empty():
            slot = self.free.get_nowait()
            if slot is not None:
                with contextlib.suppress(Exception):
                    await slot[0].close()


async def pgq_work(args: argparse.Namespace, cmd: Commands) -> int:
    from pgqueuer import QueueManager

    restarts = 0
    while not cmd.stop.is_set():
        conn = None
        try:
            conn, queries = await _pgq_queries(args.dsn)
            qm = QueueManager(queries)

            @qm.entrypoint(ENTRYPOINT)
            async def bench_pickup(job: Any) -> None:
                await handle(int(job.id), float(json.loads(job.payload)))

            runner = asyncio.create_task(
                qm.run(
                    dequeue_timeout=timedelta(seconds=1),
                    batch_size=args.concurrency // 2,
                    max_concurrent_tasks=args.concurrency,
                    heartbeat_timeout=timedelta(seconds=args.lease),
                )
            )
            stopping = asyncio.create_task(cmd.stop.wait())
            await asyncio.wait((runner, stopping), return_when=asyncio.FIRST_COMPLETED)
            if cmd.stop.is_set():
                qm.shutdown.set()
                try:
                    await asyncio.wait_for(runner, 60)
                except Exception as exc:  # report, do not hang the harness
                    print(f"pgqueuer shutdown: {exc!r}", file=sys.stderr)
                break
            stopping.cancel()
            runner.result()  # raises what ended it
            raise RuntimeError("QueueManager.run returned")
        except Exception as exc:
            restarts += 1
            print(f"pgqueuer worker loop ended ({exc!r}); starting again", file=sys.stderr)
            await asyncio.sleep(0.2)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
    return restarts


# -- procrastinate ----------------------------------------------------------------------------


def _pro_app(dsn: str, pool: int):  # type: ignore[no-untyped-def]  # peers venv; no procrastinate types here
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=dsn, min_size=1, max_size=pool)
    )

    @app.task(name=ENTRYPOINT, queue=QUEUE, pass_context=True)
    async def bench_pickup(context: Any, t: float) -> None:
        await handle(int(context.job.id), float(t))

    return app, bench_pickup


async def pro_install(dsn: str) -> None:
    app, _ = _pro_app(dsn, 2)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


class ProProducer:
    def __init__(self, dsn: str, n: int) -> None:
        self.app, self.task = _pro_app(dsn, n)

    async def open(self) -> None:
        await self.app.open_async()

    async def enqueue(self, t: float) -> int:
        return int(await self.task.defer_async(t=t))

    async def close(self) -> None:
        await self.app.close_async()


async def _retry_stalled(app: Any, lease: float, stop: asyncio.Event) -> None:
    """procrastinate's documented recipe for jobs of dead workers, once a second."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        try:
            for job in await app.job_manager.get_stalled_jobs(
                queue=QUEUE, seconds_since_heartbeat=lease
            ):
                with contextlib.suppress(Exception):  # another worker retried it first
                    await app.job_manager.retry_job(job)
        except Exception as exc:  # the session was cut: next second
            print(f"retry_stalled: {exc!r}", file=sys.stderr)


async def pro_work(args: argparse.Namespace, cmd: Commands) -> int:
    logging.getLogger("procrastinate").setLevel(logging.CRITICAL)
    restarts = 0
    while not cmd.stop.is_set():
        app, _ = _pro_app(args.dsn, args.pool)
        try:
            await app.open_async()
            stalled = asyncio.create_task(_retry_stalled(app, args.lease, cmd.stop))
            runner = asyncio.create_task(
                app.run_worker_async(
                    queues=[QUEUE],
                    concurrency=args.concurrency,
                    wait=True,
                    delete_jobs="never",
                    install_signal_handlers=False,
                    fetch_job_polling_interval=1.0,
                    update_heartbeat_interval=args.lease / 4,
                    stalled_worker_timeout=args.lease * 3,
                )
            )
            stopping = asyncio.create_task(cmd.stop.wait())
            await asyncio.wait((runner, stopping), return_when=asyncio.FIRST_COMPLETED)
            if cmd.stop.is_set():
                runner.cancel()  # procrastinate's graceful stop: running jobs finish
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(runner, 60)
                await stalled
                break
            stopping.cancel()
            stalled.cancel()
            runner.result()
            raise RuntimeError("run_worker_async returned")
        except Exception as exc:
            restarts += 1
            print(f"procrastinate worker loop ended ({exc!r}); starting again", file=sys.stderr)
            await asyncio.sleep(0.2)
        finally:
            with contextlib.suppress(Exception):
                await app.close_async()
    return restarts


# -- the modes --------------------------------------------------------------------------------


async def produce(args: argparse.Namespace) -> None:
    cmd = Commands(asyncio.get_running_loop(), args.rate)
    producer: Any
    if args.system == "pgqueuer":
        producer = PgqProducer(args.dsn, args.conns)
    else:
        producer = ProProducer(args.dsn, args.conns)
        await producer.open()
    ids = open(args.ids, "w", buffering=1 << 16) if args.ids else None  # noqa: SIM115, ASYNC230 - closed below; buffered writes
    counts = {"ok": 0, "errors": 0, "ok_total": 0, "errors_total": 0, "lag_s": 0.0}
    last_error: list[str] = []
    inflight: set[asyncio.Task[None]] = set()

    async def one() -> None:
        try:
            job_id = await producer.enqueue(time.time())
        except Exception as exc:  # counted and reported; the schedule goes on
            counts["errors"] += 1
            counts["errors_total"] += 1
            last_error[:] = [repr(exc)[:300]]
            return
        counts["ok"] += 1
        counts["ok_total"] += 1
        if ids is not None:
            ids.write(f"{job_id}\n")

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
        if cmd.rate != rate:
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
    with contextlib.suppress(Exception):
        await producer.close()
    send("RESULT", {"enqueued": counts["ok_total"], "errors": counts["errors_total"]})


async def work(args: argparse.Namespace) -> None:
    cmd = Commands(asyncio.get_running_loop(), 0.0)
    if args.effect:
        EFFECTS.append(Effects(args.dsn, max(2, args.concurrency // 4)))
        await EFFECTS[0].open()
    send("READY")
    await cmd.go.wait()
    cpu0 = time.process_time()
    ticker = asyncio.create_task(_ticker(STATS.flush, cmd.stop))
    if args.system == "pgqueuer":
        restarts = await pgq_work(args, cmd)
    else:
        restarts = await pro_work(args, cmd)
    await ticker
    cpu = time.process_time() - cpu0
    if EFFECTS:
        await EFFECTS[0].close()
    send(
        "RESULT",
        {
            "starts": STATS.starts_total,
            "finished": STATS.finished_total,
            "cpu_s": cpu,
            "pid": os.getpid(),
            "loop_restarts": restarts,
            "effect_errors": STATS.effect_errors,
        },
    )


async def install(args: argparse.Namespace) -> None:
    if args.system == "pgqueuer":
        await pgq_install(args.dsn)
    else:
        await pro_install(args.dsn)
    send("RESULT", {})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["install", "produce", "work"])
    parser.add_argument("--system", choices=["pgqueuer", "procrastinate"], required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--conns", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--ids", default="")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--pool", type=int, default=8)
    parser.add_argument("--lease", type=float, default=10.0)
    parser.add_argument("--effect", action="store_true")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness stops us with STOP
    mode = {"install": install, "produce": produce, "work": work}[args.mode]
    asyncio.run(mode(args))


if __name__ == "__main__":
    main()
