"""`umt check --against <database URL>` on the session's Postgres: the live runs' histories
read from the store and replayed against candidate releases. A compatible release (a patch
for new runs) passes; a renamed step, a step whose return type drifted and a dropped version
fail with exit 1, naming each run and step; finished runs are not checked."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta

from tests.integration import check_tasks
from tests.integration.cli.test_cli import Umt
from umt_sdk import RunHistory, connect
from umt_sdk.testing import check_deploy, live_histories

TASKS = "tests.integration.check_tasks"


async def _record(umt: Umt) -> tuple[list[uuid.UUID], uuid.UUID, uuid.UUID]:
    """Two runs parked on their payment, one completed, one pending: (parked, completed,
    pending) ids."""
    engine = await connect(
        umt.url, registry=check_tasks.recorded_registry, schema=umt.schema, run_migrations=False
    )
    try:
        handles = [await engine.enqueue(check_tasks.recorded, f"o-{n}") for n in range(3)]
        async with engine.worker(lease=timedelta(seconds=5), shutdown_grace=timedelta(0)):
            deadline = time.monotonic() + 30
            for handle in handles:
                info = await engine.get(handle.run_id)
                while info.status != "waiting":
                    assert time.monotonic() < deadline, "the runs never parked on their payment"
                    await asyncio.sleep(0.05)
                    info = await engine.get(handle.run_id)
            await engine.signal(handles[0].run_id, "paid", {"by": "card"})
            assert await handles[0].result(timeout=30) == "shipped o-0"
        pending = await engine.enqueue(check_tasks.recorded, "o-3")
    finally:
        await engine.close()
    return [h.run_id for h in handles[1:]], handles[0].run_id, pending.run_id


def test_umt_check_against_the_database(umt: Umt) -> None:
    parked, completed, pending = asyncio.run(_record(umt))
    live = sorted([*parked, pending])

    def check(registry: str, *args: str) -> tuple[int, str, str]:
        result = umt("check", "--registry", f"{TASKS}:{registry}", "--against", umt.url, *args)
        return result.exit_code, result.stdout, result.stderr

    code, out, err = check("patched_registry")
    assert code == 0, out + err
    assert out.strip() == "checked 3 run(s) of check.order@1 (3): every one replays on this code"
    assert str(completed) not in out + err

    code, out, err = check("patched_registry", "--unpatched", "fraud")
    assert code == 1, out + err
    assert out.splitlines() == [f"unpatched run {run_id} (check.order@1)" for run_id in parked]

    code, out, err = check("renamed_registry")
    assert code == 1, out + err
    assert out.count("FAILED run ") == 2  # the pending run records its quote anew: fine
    assert "step 'price'   <- differs" in out
    for run_id in parked:
        assert f"run {run_id}: the code no longer replays its history" in out
    assert "3 run(s) of check.order@1 (3): 2 would break on this code" in err

    code, out, err = check("drifted_registry")
    assert code == 1, out + err
    for run_id in parked:
        assert f"run {run_id}" in out
    assert out.count("type drift in step 'quote': the recorded") == 2
    assert "no longer decodes into TextQuote" in out

    code, out, err = check("dropped_registry")
    assert code == 1, out + err
    assert out.count("task check.order@1 is not registered (registered: check.order@2)") == 3
    assert "3 would break" in err

    # The global --database-url is the default; --task narrows the runs.
    result = umt("check", "--registry", f"{TASKS}:patched_registry", "--task", "check.order@2")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "checked 0 run(s): every one replays on this code"
    assert check_tasks.RAN == []

    # In Python: the same histories, read with live_histories.
    async def in_python() -> list[RunHistory]:
        engine = await connect(umt.url, schema=umt.schema, run_migrations=False)
        try:
            return await live_histories(engine)
        finally:
            await engine.close()

    histories = asyncio.run(in_python())
    assert sorted(h.run_id for h in histories) == live
    report = asyncio.run(check_deploy(check_tasks.renamed_registry, histories))
    assert sorted(r.run_id for r in report.failures) == parked


def test_umt_check_refuses_what_is_neither_a_file_nor_a_url(umt: Umt) -> None:
    result = umt("check", "--registry", f"{TASKS}:patched_registry", "--against", "nowhere")
    assert result.exit_code == 2
    assert "neither an existing history file or directory nor a database URL" in result.stderr
