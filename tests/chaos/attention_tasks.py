"""The task of `test_attention_killed.py`: a card charge whose gateway call times out (its
outcome unknown), served by real worker processes (`tests/_procs/worker.py`) that SIGKILL
themselves once right after that failure was recorded, before the run is parked.

Imported by a worker process, this module watches the execution's points (`umt_sdk._probe`):
the first time the step `charge` is about to park its run (its uncertain attempt is recorded
by then), the process SIGKILLs itself; a file in the worker's `--workdir` marks that it
happened, so the next worker lets the run go on. Each call of the gateway appends a line to
`calls.log` in the workdir, the outside effect the test counts. The test process imports it
too, to enqueue; there the watch is never installed.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import attrs

from tests._procs.kill import kill_once_at
from tests._procs.worker import config, say
from umt_sdk import RetryPolicy, TaskContext, TaskDefinition, task

KILLED = "killed-after-the-uncertain-failure"
CALLS = "calls.log"


@attrs.frozen
class Receipt:
    ref: str
    cents: int


async def call_gateway(order_id: str) -> Receipt:
    """The first call times out; any later one answers (so a retry would be seen)."""
    log = config().workdir / CALLS
    with log.open("a") as file:
        file.write(f"{order_id} {os.getpid()}\n")
    say("CALLED", order_id, os.getpid())
    if len(log.read_text().splitlines()) == 1:
        raise TimeoutError("the card gateway did not answer within 30 s")
    return Receipt(ref=f"gw-{os.getpid()}", cents=1250)


@task(
    "attention.charge",
    version=1,
    retry=RetryPolicy(max_attempts=5, initial=timedelta(milliseconds=50), backoff=1.0),
)
async def charge(ctx: TaskContext[str]) -> str:
    receipt = await ctx.step.run("charge", call_gateway, ctx.input, uncertain_on=(TimeoutError,))
    return f"{receipt.ref} {receipt.cents}"


TASKS: list[TaskDefinition[Any, Any]] = [charge]


if os.environ.get("UMT_TEST_KILL_AFTER_UNCERTAIN") == "1":
    kill_once_at("park", "charge", marker=KILLED)
