"""Steps, a crash in the middle of one, and the replay that resumes the run by step name.

Run it: `python examples/02_steps_and_replay.py`. It prints what happened and exits 0.

An order task has named steps: `reserve`, `charge`, then `label` once per parcel. Worker 1
crashes (like `kill -9`) while `charge` runs. Once its lease expires, worker 2 runs the handler
again from the top: `reserve` is replayed from its record (its body does not run again),
`charge` runs again from its start, and the rest runs for the first time. The timeline shows
the attempt that the crash cut off as `interrupted`. A `FakeClock` stands in for the wall clock.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta

from umt_sdk import Registry, TaskContext, connect, step, task
from umt_sdk.testing import FakeClock, simulate_crash

BODIES: Counter[str] = Counter()  # how often each step body really ran
CHARGING = asyncio.Event()  # set when `charge` starts; it then hangs until the crash


@step("reserve")  # a step declared once, called like a function inside tasks
async def reserve(order_id: str) -> str:
    BODIES["reserve"] += 1
    return f"R-{order_id}"


async def charge(order_id: str) -> str:
    BODIES["charge"] += 1
    if BODIES["charge"] == 1:  # the first time, hang so that we can crash mid-step
        CHARGING.set()
        await asyncio.Event().wait()
    return f"C-{order_id}"


@task("ship_order", version=1)
async def ship_order(ctx: TaskContext[str]) -> list[str]:
    reservation = await reserve(ctx.input)
    payment = await ctx.step.run("charge", charge, ctx.input)  # an inline step
    # The same name in a loop is recorded as label, label#2, ...: keep the order stable.
    labels = [await ctx.step.run("label", lambda p=p: f"L-{p}") for p in ("box", "tube")]
    return [reservation, payment, *labels]


async def main() -> None:
    clock = FakeClock()
    engine = await connect("memory://", registry=Registry([ship_order]), clock=clock)
    run = await engine.enqueue(ship_order, "o-42")
    lease = timedelta(seconds=1)  # short, so heartbeats report the current step every 1/3 s

    worker_1 = engine.worker(lease=lease)
    await worker_1.start()
    await CHARGING.wait()
    info = await engine.get(run.run_id)
    while not any(s.status == "running" for s in info.timeline):
        await asyncio.sleep(0.05)  # wait for a heartbeat to report `charge` as running
        info = await engine.get(run.run_id)
    print("worker 1 is in `charge` ... and crashes: no more writes, its lease is left to expire")
    simulate_crash(worker_1)
    await worker_1.stop()

    clock.advance(lease * 2)  # virtual time: the lease expires
    async with engine.worker(lease=lease):  # worker 2 claims the run and replays it
        output = await run.result(timeout=5)

    info = await engine.get(run.run_id)
    print(f"result: {output}  status={info.status} attempts={info.attempts}")
    print("timeline (token = the attempt that wrote it):")
    for s in info.timeline:
        print(f"  {s.name:<8} {s.status:<12} token={s.fencing_token}")
    print(f"step bodies run: {dict(BODIES)}")

    assert output == ["R-o-42", "C-o-42", "L-box", "L-tube"]
    assert BODIES == {"reserve": 1, "charge": 2}, "reserve replayed, charge ran again"
    assert [(s.name, s.status) for s in info.timeline] == [
        ("reserve", "completed"),
        ("charge", "interrupted"),
        ("charge", "completed"),
        ("label", "completed"),
        ("label#2", "completed"),
    ]
    assert info.attempts == 2
    assert info.lease_expirations == 1
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
