"""procrastinate workload process (peers' virtualenv): a no-durability reference, 1-step runs.

    python procrastinate_worker.py enqueue --dsn URL --n N
    python procrastinate_worker.py work    --dsn URL --concurrency C

A pool of one connection per process (plus procrastinate's LISTEN connection), no-op task.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _proto import Control, send

FIRST_START: list[float] = []
HANDLED = [0]


def make_app(dsn: str, pool: int):  # type: ignore[no-untyped-def]  # runs in the peers venv; procrastinate types not here
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=dsn, min_size=1, max_size=pool)
    )

    @app.task(name="noop", queue="bench")
    async def noop() -> None:
        if not FIRST_START:
            FIRST_START.append(time.time())
        HANDLED[0] += 1

    return app, noop


async def enqueue(args: argparse.Namespace) -> None:
    app, noop = make_app(args.dsn, 2)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        t0 = time.perf_counter()
        done = 0
        while done < args.n:
            size = min(1000, args.n - done)
            await noop.batch_defer_async(*([{}] * size))
            done += size
        seconds = time.perf_counter() - t0
    send("RESULT", {"enqueue_s": seconds, "enqueue_per_s": args.n / seconds if seconds else 0})


async def work(args: argparse.Namespace) -> None:
    logging.getLogger("procrastinate").setLevel(logging.WARNING)
    control = Control()
    app, _ = make_app(args.dsn, args.pool)
    async with app.open_async():
        send("READY")
        await asyncio.to_thread(control.go.wait)
        await app.run_worker_async(
            queues=["bench"],
            concurrency=args.concurrency,
            wait=False,
            delete_jobs="never",
            install_signal_handlers=False,
            fetch_job_polling_interval=0.05,
        )
        await asyncio.to_thread(control.stop.wait)
        cpu = control.cpu_since_go()
    first = FIRST_START[0] if FIRST_START else None
    send("RESULT", {"count": HANDLED[0], "first_start": first, "cpu_s": cpu})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["enqueue", "work"])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--wid", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--pool", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(enqueue(args) if args.mode == "enqueue" else work(args))


if __name__ == "__main__":
    main()
