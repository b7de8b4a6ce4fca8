"""pgqueuer workload process (peers' virtualenv): the no-durability reference for 1-step runs.

    python pgqueuer_worker.py enqueue --dsn URL --n N
    python pgqueuer_worker.py work    --dsn URL --batch B

One psycopg connection per process (pgqueuer's psycopg driver), no-op entrypoint.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _proto import Control, send

FIRST_START: list[float] = []
HANDLED = [0]


async def driver(dsn: str):  # type: ignore[no-untyped-def]  # runs in the peers venv; pgqueuer types not here
    import psycopg
    from pgqueuer import PsycopgDriver

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    return PsycopgDriver(conn)


async def enqueue(args: argparse.Namespace) -> None:
    from pgqueuer import Queries

    queries = Queries(await driver(args.dsn))
    if not args.installed:
        await queries.install()
    t0, cpu0 = time.perf_counter(), time.process_time()
    done = 0
    while done < args.n:
        size = min(args.enqueue_batch, args.n - done)
        await queries.enqueue(["noop"] * size, [None] * size, [0] * size)
        done += size
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    send(
        "RESULT",
        {
            "enqueue_s": seconds,
            "enqueue_per_s": args.n / seconds if seconds else 0,
            "enqueue_cpu_s": cpu,
        },
    )


async def work(args: argparse.Namespace) -> None:
    from pgqueuer import Queries, QueueManager

    control = Control()
    qm = QueueManager(Queries(await driver(args.dsn)))

    @qm.entrypoint("noop")
    async def noop(job: object) -> None:
        if not FIRST_START:
            FIRST_START.append(time.time())
        HANDLED[0] += 1

    send("READY")
    await asyncio.to_thread(control.go.wait)
    runner = asyncio.create_task(
        qm.run(batch_size=args.batch, dequeue_timeout=timedelta(seconds=1))
    )
    await asyncio.to_thread(control.stop.wait)
    cpu = control.cpu_since_go()
    qm.shutdown.set()
    try:
        await asyncio.wait_for(runner, 30)
    except Exception as exc:  # report, do not hang the harness
        print(f"pgqueuer shutdown: {exc!r}", file=sys.stderr)
    first = FIRST_START[0] if FIRST_START else None
    send("RESULT", {"count": HANDLED[0], "first_start": first, "cpu_s": cpu})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["enqueue", "work"])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--wid", type=int, default=1)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--enqueue-batch", type=int, default=1000)
    parser.add_argument("--installed", action="store_true", help="the schema is there")
    args = parser.parse_args()
    asyncio.run(enqueue(args) if args.mode == "enqueue" else work(args))


if __name__ == "__main__":
    main()
