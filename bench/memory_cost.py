"""What one run costs the SDK and the memory backend, in work the machine's load cannot move.

A run of `--steps` no-op steps, enqueued one at a time into the memory backend while a worker
of `--concurrency` slots in the same process runs them (the shape of `make bench`'s memory
figure). Two measures:

- runs/s: wall time from the first enqueue to the last completion recorded (noisy on a shared
  machine: repeat, interleave and take the median);
- instructions per run (`--instructions`): the process run under `valgrind --tool=callgrind`
  twice, with `--runs` and 3 x `--runs` runs, and the difference of the totals divided by the
  difference of the runs, so interpreter start-up and imports cancel out. Deterministic to a
  fraction of a percent whatever else the machine runs.

    python -m bench.memory_cost [--runs 2000] [--steps 3] [--concurrency 128] [--repeats 5]
    python -m bench.memory_cost --instructions [--runs 100] [--steps 10] [--tracer none|noop|sdk]

`--tracer sdk` installs an OpenTelemetry SDK tracer provider with a span processor that drops
every span (what a recording tracer costs the SDK itself, without an exporter's work).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

from umt_sdk import Registry, TaskContext, connect, task

_STEPS = [3]
_FINISHED = [0]
_TARGET = [0]
_ALL_DONE: list[asyncio.Event] = []


async def _noop(i: int) -> int:
    return i


@task("bench.memory_cost", version=1)
async def steps_run(ctx: TaskContext[int]) -> int:
    """`_STEPS[0]` no-op steps."""
    for i in range(_STEPS[0]):
        await ctx.step.run(f"s{i}", _noop, i)
    _FINISHED[0] += 1
    if _FINISHED[0] >= _TARGET[0] and _ALL_DONE:
        _ALL_DONE[0].set()
    return _STEPS[0]


def _tracer_provider(kind: str) -> Any:
    if kind == "none":
        return None
    if kind == "noop":
        from opentelemetry.trace import NoOpTracerProvider

        return NoOpTracerProvider()
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    provider = TracerProvider()
    provider.add_span_processor(SpanProcessor())  # the base class: drops every span
    return provider


async def _once(n: int, concurrency: int, tracer: str) -> float:
    _FINISHED[0], _TARGET[0] = 0, n
    done = asyncio.Event()
    _ALL_DONE[:] = [done]
    engine = await connect(
        "memory://", registry=Registry([steps_run]), tracer_provider=_tracer_provider(tracer)
    )
    worker = engine.worker(concurrency=concurrency, poll_interval=timedelta(milliseconds=50))
    await worker.start()
    t0 = time.perf_counter()
    for _ in range(n):
        await engine.enqueue(steps_run, 0)
    await done.wait()
    # The last handlers have returned; wait for their completions to be recorded.
    await asyncio.gather(*(e.task for e in worker._executions.values() if e.task is not None))
    seconds = time.perf_counter() - t0
    await engine.close()
    return n / seconds


def _callgrind_total(runs: int, args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-m",
                "bench.memory_cost",
                "--runs",
                str(runs),
                "--steps",
                str(args.steps),
                "--concurrency",
                str(args.concurrency),
                "--tracer",
                args.tracer,
                "--repeats",
                "1",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        with open(out, encoding="utf-8") as lines:
            for line in lines:
                found = re.match(r"(?:summary|totals): (\d+)", line)
                if found:
                    return int(found.group(1))
    raise RuntimeError("no total in callgrind's output")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tracer", choices=["none", "noop", "sdk"], default="none")
    parser.add_argument("--instructions", action="store_true")
    args = parser.parse_args()
    _STEPS[0] = args.steps
    if args.instructions:
        small = _callgrind_total(args.runs, args)
        large = _callgrind_total(3 * args.runs, args)
        per_run = (large - small) / (2 * args.runs)
        print(
            json.dumps(
                {
                    "instructions_per_run": round(per_run),
                    "instructions_per_step": round(per_run / max(1, args.steps)),
                    "steps": args.steps,
                    "tracer": args.tracer,
                    "runs": [args.runs, 3 * args.runs],
                }
            ),
            flush=True,
        )
        return
    rates = [
        asyncio.run(_once(args.runs, args.concurrency, args.tracer)) for _ in range(args.repeats)
    ]
    print(
        json.dumps(
            {
                "runs_per_s_median": round(statistics.median(rates)),
                "runs_per_s": [round(r) for r in rates],
                "steps": args.steps,
                "tracer": args.tracer,
                "loadavg": os.getloadavg(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
