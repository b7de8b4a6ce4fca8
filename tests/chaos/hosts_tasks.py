"""The tasks the worker hosts of `test_many_hosts.py` serve: the download example's, watched.

`tests/_procs/worker.py --tasks tests.chaos.hosts_tasks` serves the two worker groups of
`examples/download_approval` (`io`: `download_plan@2` and the housekeeping tick; `agent`:
`describe_asset@1`), with the example's own steps, business tables and fenced submission to
its fake download client. Each step of the example is wrapped to append, before it runs,

    BEGIN <run id> <step> <fencing token> <worker group> <unix time>

to `<workdir>/steps.log`: what the test reads to prove no completed step ran again and that a
host cut off from Postgres began no step once its leases were gone.

`hosts.tick@1` is started by the schedule `hosts.tick` every two seconds by whichever worker's
scheduler loop gets there (one run per tick: the tick's key), and its finished runs are
deleted by the workers' retention passes after a few seconds: the periodic work that must
happen once, with no leader (part 3 of issue 18).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs

from tests._procs.worker import append_line, config
from umt_sdk import Schedule, TaskContext, task
from umt_sdk._context import current_execution

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "download_approval"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

import app as dl_app  # noqa: E402 - the example's modules, from its folder
import tasks as dl_tasks  # noqa: E402

STEPS_LOG = "steps.log"
TICK_RETENTION = timedelta(seconds=3)
COPY_SECONDS = 2.0


def _configure_once() -> None:
    if not dl_tasks._SETTINGS:
        cfg = config()
        dl_tasks.configure(cfg.url, dl_app.app_schema(cfg.schema), cfg.workdir / "data")


def _note(step: str) -> None:
    runner = current_execution()
    run_id, token = (
        ("-", 0) if runner is None else (runner.claimed.run_id, runner.claimed.fencing_token)
    )
    append_line(
        config().workdir / STEPS_LOG,
        f"BEGIN {run_id} {step} {token} {config().group} {time.time():.3f}",
    )


def _watched(step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def watched_async(*args: Any, **kwargs: Any) -> Any:
            _configure_once()
            _note(step)
            if step == "copy":  # a real file takes a while: hosts hold runs when faults come
                await asyncio.sleep(COPY_SECONDS)
            return await fn(*args, **kwargs)

        return watched_async

    @functools.wraps(fn)
    def watched(*args: Any, **kwargs: Any) -> Any:
        _configure_once()
        _note(step)
        return fn(*args, **kwargs)

    return watched


# The example's flow looks its step functions up in its module at each call: wrap them there.
# Its reads (`_fetchone`, also in `describe_asset`'s step) configure the example first.
_example_fetchone = dl_tasks._fetchone


async def _fetchone(query: str, *params: Any) -> tuple[Any, ...] | None:
    _configure_once()
    return await _example_fetchone(query, *params)


dl_tasks._fetchone = _fetchone
for _step, _name in (
    ("load-plan", "load_plan"),
    ("submit", "submit"),
    ("copy", "copy"),
    ("verify", "sha256"),
    ("record-asset", "record_asset"),
):
    setattr(dl_tasks, _name, _watched(_step, getattr(dl_tasks, _name)))


@attrs.frozen
class Tick:
    pass


@task("hosts.tick", version=1, retention=TICK_RETENTION)
async def tick(ctx: TaskContext[Tick]) -> str:
    _configure_once()
    return ctx.scheduled_at.isoformat() if ctx.scheduled_at else "-"


TICK = Schedule(
    name="hosts.tick",
    task=tick,
    cron="*/2 * * * * *",
    input=Tick(),
    overlap="allow_all",
    catchup_window=timedelta(minutes=5),
)

download_plan = dl_tasks.download_plan_v2
describe_asset = dl_tasks.describe_asset

TASKS = [download_plan, describe_asset, tick]
SCHEDULES = [TICK]
GROUPS = {
    "io": "download_plan@2,hosts.tick@1",
    "agent": "describe_asset@1",
}
