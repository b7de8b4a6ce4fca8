"""How long the crash explorer takes on a ten-step workflow with one `with_attempt_token`.

It explores every single crash point (depth 1) and every pair (depth 2) of a task of ten steps,
the fifth of which charges through `with_attempt_token`, on the memory backend, and reports
the median wall time and CPU time of `--repeats` explorations, the number of crash points and
of runs, and the time per run. Nothing is asserted: the issue's goal (depth 1 in under a
second) is read off the output.

    python -m bench.explore [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from typing import Any

from umt_backend_memory import MemoryStore
from umt_sdk import AttemptInfo, TaskContext, task, with_attempt_token
from umt_sdk.testing import explore_crashes

STORE = MemoryStore()
PAYMENTS: list[str] = []


def _fresh() -> list[str]:
    global STORE
    STORE = MemoryStore()
    PAYMENTS.clear()
    return PAYMENTS


def _add(value: int, step: int) -> int:
    return value + step


async def _charge(order: str) -> str:
    async def act(info: AttemptInfo) -> str:
        if not (info.resumed and order in PAYMENTS):
            PAYMENTS.append(order)
        return f"receipt-{order}"

    async def commit(tx: Any, receipt: str) -> None:
        tx.put("receipts", order, receipt)

    return await with_attempt_token(STORE, f"charge:{order}", act, commit=commit)


@task("bench.ten_steps")
async def ten_steps(ctx: TaskContext[str]) -> int:
    total = 0
    for step in range(10):
        if step == 4:
            await ctx.step.run("charge", _charge, ctx.input)
        else:
            total = await ctx.step.run(f"step-{step}", _add, total, step)
    return total


def _one_payment(payments: list[str]) -> None:
    assert len(payments) == 1, f"{len(payments)} payments"


async def _measure(depth: int, repeats: int) -> dict[str, Any]:
    walls: list[float] = []
    cpus: list[float] = []
    points = runs = 0
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        report = await explore_crashes(
            ten_steps, "o-1", setup=_fresh, invariant=_one_payment, depth=depth
        )
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        assert report.ok, report.explain()
        points, runs = len(report.points), len(report.explorations) + 2
    wall_median = statistics.median(walls)
    return {
        "depth": depth,
        "crash_points": points,
        "runs": runs,
        "wall_s": {"median": wall_median, "min": min(walls), "max": max(walls)},
        "cpu_s": {"median": statistics.median(cpus)},
        "ms_per_run": {"median": 1000 * wall_median / runs},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    results = {
        "machine": f"{platform.machine()} {platform.python_version()}",
        "depth_1": asyncio.run(_measure(1, args.repeats)),
        "depth_2": asyncio.run(_measure(2, max(1, args.repeats // 2))),
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
