"""A producer process of `bench.worker_curve`, driven over `bench.peers._proto`.

python -m bench._curve_child --dsn URL --first I --n N [--outstanding 64] [--conns 4]

Connects (its own engine, no migrations, no LISTEN), says READY, and on GO enqueues runs
`I .. I+N-1` of a no-op task one at a time with `--outstanding` enqueues in flight (as the
drain benchmark's setup does), then reports its wall window and CPU seconds (user + system of
this process, around the enqueues only), and closes on STOP.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time

from bench.peers._proto import Control, send
from umt_sdk import Registry, TaskContext, connect, task


@task("bench_curve_enqueued", version=1)
async def curve_enqueued(ctx: TaskContext[int]) -> int:
    """Never run: the enqueue curve stores runs and counts them."""
    return ctx.input


REGISTRY = Registry([curve_enqueued])


async def produce(args: argparse.Namespace) -> None:
    control = Control()
    engine = await connect(
        args.dsn,
        registry=REGISTRY,
        run_migrations=False,
        min_size=args.conns,
        max_size=args.conns,
        listen=False,
    )
    send("READY")
    await asyncio.to_thread(control.go.wait)
    t_start, cpu0 = time.time(), time.process_time()
    last = args.first + args.n
    for start in range(args.first, last, args.outstanding):
        stop = min(start + args.outstanding, last)
        await asyncio.gather(*(engine.enqueue(curve_enqueued, i) for i in range(start, stop)))
    t_end, cpu = time.time(), time.process_time() - cpu0
    send("RESULT", {"t_start": t_start, "t_end": t_end, "cpu_s": cpu, "pid": os.getpid()})
    # Our sessions stay until STOP: the harness reads the server's CPU while they live (the
    # times of a session that ended are in its postmaster's only once it has reaped it).
    await asyncio.to_thread(control.stop.wait)
    await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--outstanding", type=int, default=64)
    parser.add_argument("--conns", type=int, default=4)
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness ends us by closing stdin
    asyncio.run(produce(args))


if __name__ == "__main__":
    main()
