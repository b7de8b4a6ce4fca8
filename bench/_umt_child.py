"""umt workload processes, driven by the harness over `bench.peers._proto`.

python -m bench._umt_child enqueue  --dsn URL --n N --k K
python -m bench._umt_child work     --dsn URL [--listen 0|1] [--conns C] [--concurrency C]
python -m bench._umt_child latency  --dsn URL --listen 0|1
python -m bench._umt_child recovery --dsn URL --role victim|rescuer --lease S
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from datetime import timedelta

from bench.peers._proto import Control, send
from umt_sdk import Registry, TaskContext, connect, task

FIRST_START: list[float] = []
HANDLED = [0]
S1_BODIES = [0]
ROLE = {"name": "worker"}


async def _noop(i: int) -> int:
    return i


@task("bench_drain", version=1)
async def bench_drain(ctx: TaskContext[int]) -> int:
    """`ctx.input` no-op steps, then complete."""
    if not FIRST_START:
        FIRST_START.append(time.time())
    HANDLED[0] += 1
    for i in range(ctx.input):
        await ctx.step.run(f"s{i}", _noop, i)
    return ctx.input


@task("bench_latency", version=1)
async def bench_latency(ctx: TaskContext[int]) -> float:
    """Returns the wall-clock time its handler started."""
    return time.time()


async def _s1() -> int:
    S1_BODIES[0] += 1
    return 1


async def _s2() -> float:
    started = time.time()
    if ROLE["name"] == "victim":
        send("EVENT", {"in_s2": started})
        await asyncio.sleep(3600)  # SIGKILLed here
    send("EVENT", {"s2_started": started, "s1_bodies": S1_BODIES[0]})
    return started


@task("bench_recovery", version=1)
async def bench_recovery(ctx: TaskContext[int]) -> dict[str, float]:
    """Three steps; the victim hangs in s2 and is SIGKILLed, the rescuer finishes the run."""
    await ctx.step.run("s1", _s1)
    started = await ctx.step.run("s2", _s2)
    await ctx.step.run("s3", _noop, 3)
    return {"s2_started": started, "s1_bodies_here": float(S1_BODIES[0])}


REGISTRY = Registry([bench_drain, bench_latency, bench_recovery])


async def _wait(event: object) -> None:
    await asyncio.to_thread(event.wait)  # type: ignore[attr-defined]  # set by the stdin reader before use


async def enqueue(args: argparse.Namespace) -> None:
    engine = await connect(args.dsn, registry=REGISTRY, max_size=4, listen=False)
    t0 = time.perf_counter()
    chunk = 64
    for start in range(0, args.n, chunk):
        await asyncio.gather(
            *(engine.enqueue(bench_drain, args.k) for _ in range(min(chunk, args.n - start)))
        )
    seconds = time.perf_counter() - t0
    await engine.close()
    send("RESULT", {"enqueue_s": seconds, "enqueue_per_s": args.n / seconds if seconds else 0})


async def work(args: argparse.Namespace, versions: list[str]) -> None:
    control = Control()
    engine = await connect(
        args.dsn,
        registry=REGISTRY,
        run_migrations=False,
        min_size=args.conns,
        max_size=args.conns,
        listen=bool(args.listen),
    )
    send("READY")
    await _wait(control.go)
    worker = engine.worker(
        versions=versions,
        concurrency=args.concurrency,
        lease=timedelta(seconds=args.lease),
        poll_interval=timedelta(seconds=args.poll),
    )
    await worker.start()
    await _wait(control.stop)
    cpu = control.cpu_since_go()
    await engine.close()
    send(
        "RESULT",
        {
            "count": HANDLED[0],
            "first_start": FIRST_START[0] if FIRST_START else None,
            "cpu_s": cpu,
            "pid": os.getpid(),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["enqueue", "work", "latency", "recovery"])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--listen", type=int, default=1)
    parser.add_argument("--conns", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--lease", type=float, default=10.0)
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--role", default="worker")
    parser.add_argument("--wid", type=int, default=1)
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness stops us with STOP
    ROLE["name"] = args.role
    if args.mode == "enqueue":
        asyncio.run(enqueue(args))
    elif args.mode == "work":
        asyncio.run(work(args, ["bench_drain@1"]))
    elif args.mode == "latency":
        asyncio.run(work(args, ["bench_latency@1"]))
    else:
        asyncio.run(work(args, ["bench_recovery@1"]))


if __name__ == "__main__":
    main()
