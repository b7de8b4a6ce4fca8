"""`umt runs list --status needs_attention`, `umt runs show` and `umt runs settle` against the
test Postgres: a run whose step's outcome is unknown is listed and shown needing attention,
a settle that does not fit is refused with one line (exit 2) and stores nothing, and a right
one lets the run go on."""

from __future__ import annotations

import asyncio
import getpass
import json
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from tests.integration.cli import attention_tasks
from tests.integration.cli.test_cli import Umt, one_error_line
from umt_sdk import RunInfo, connect


@pytest.fixture(autouse=True)
def fresh_calls() -> Iterator[None]:
    attention_tasks.CALLS.clear()
    yield
    attention_tasks.CALLS.clear()


def serve_until(
    umt: Umt, run_id: str, done: Callable[[RunInfo], bool], timeout: float = 30.0
) -> None:
    """Serve the task in this process until the run is as `done` says."""

    async def go() -> None:
        engine = await connect(
            umt.url, registry=attention_tasks.registry, schema=umt.schema, run_migrations=False
        )
        try:
            async with engine.worker(shutdown_grace=timedelta(0)):
                deadline = time.monotonic() + timeout
                while not done(info := await engine.get(uuid.UUID(run_id))):
                    assert time.monotonic() < deadline, f"run is {info.display_status}"
                    await asyncio.sleep(0.05)
        finally:
            await engine.close()

    asyncio.run(go())


def enqueue(umt: Umt, order_id: str) -> str:
    async def go() -> str:
        engine = await connect(
            umt.url, registry=attention_tasks.registry, schema=umt.schema, run_migrations=False
        )
        try:
            handle = await engine.enqueue(attention_tasks.charge_card, order_id)
        finally:
            await engine.close()
        return str(handle.run_id)

    return asyncio.run(go())


def test_a_run_needing_attention_is_listed_shown_and_settled(umt: Umt) -> None:
    umt.ok("migrate")
    run_id = enqueue(umt, "o1")
    other = enqueue(umt, "o2")
    serve_until(umt, run_id, lambda i: i.needs_attention is not None)
    serve_until(umt, other, lambda i: i.needs_attention is not None)

    listed = json.loads(umt.ok("runs", "list", "--status", "needs_attention", "--json").stdout)
    assert sorted((r["run_id"], r["needs_attention"]) for r in listed) == sorted(
        [(run_id, "charge"), (other, "charge")]
    )
    table = umt.ok("runs", "list", "--status", "needs_attention").stdout
    assert "needs_attention" in table
    assert "step 'charge' needs settling" in table
    shown = umt.ok("runs", "show", run_id).stdout
    assert "needs_attention" in shown

    # Settles that do not fit: one line, exit 2, nothing stored.
    for args, message in [
        (["--step", "refund", "--as", "not-done"], "waits for step 'charge' to be settled, not"),
        (["--step", "charge", "--as", "done"], "--as done needs --output"),
        (["--step", "charge", "--as", "done", "--output", '{"ref": "x"}'], "does not decode"),
        (["--step", "charge", "--as", "done", "--output", "{nope"], "expected JSON"),
        (["--step", "charge", "--as", "maybe"], "'maybe' is not one of"),
    ]:
        refused = umt("runs", "settle", run_id, *args)
        assert refused.exit_code == 2, refused.output
        assert message in refused.stderr, refused.stderr
    assert umt.show(run_id)["needs_attention"] == "charge"

    done = umt.ok(
        "runs",
        "settle",
        run_id,
        "--step",
        "charge",
        "--as",
        "done",
        "--output",
        '{"ref": "gw-manual", "cents": 1250}',
        "--by",
        "dana",
    )
    assert done.stdout.strip() == f"settled step 'charge' of run {run_id} as done, by dana"
    again = umt("runs", "settle", run_id, "--step", "charge", "--as", "not-done")
    assert again.exit_code == 2
    assert "already settled" in one_error_line(again)
    not_done = umt.ok("runs", "settle", other, "--step", "charge", "--as", "not-done")
    assert f"by {getpass.getuser()}" in not_done.stdout

    serve_until(umt, run_id, lambda i: i.status == "completed")
    serve_until(umt, other, lambda i: i.status == "completed")
    assert umt.show(run_id)["output"] == "gw-manual 1250"
    assert umt.show(other)["output"] == "gw-o2 1250"
    assert attention_tasks.CALLS == {"o1": 1, "o2": 2}
    timeline = umt.show(run_id)["timeline"]
    settled = [s for s in timeline if s["name"] == "umt.attention:1:charge"]
    assert len(settled) == 1
    assert settled[0]["settled"] == "settled done by dana"
    assert "settled done by dana" in umt.ok("runs", "show", run_id).stdout
