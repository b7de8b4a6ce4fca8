"""Hostile values through every page: task, step, worker and fact names, error messages,
inputs, tags and filters holding markup, quotes, control characters and very long strings
come out escaped (and control characters visible), never as markup.

The SDK refuses such names itself, so they are stored through the backend SPI directly, as a
buggy producer or another backend could store them: the dashboard must not trust its store.
"""

from __future__ import annotations

import json
from datetime import timedelta
from urllib.parse import quote
from uuid import UUID

import pytest

from tests.fixtures.dashboard import Browser
from umt_sdk import Engine
from umt_sdk.backend import (
    Ending,
    ErrorInfo,
    InsightStore,
    Lease,
    LifecycleStore,
    NewRun,
    RateLimitStore,
    StepRecord,
    TaskPair,
    WorkerState,
    new_run_id,
)

SCRIPT = '<script>alert("umt")</script>'
HOSTILE = f"{SCRIPT}'\"&<img src=x onerror=alert(1)>\x1b[31m\x07end"
LONG = "<b>" + "y" * 60_000 + "</b>"
TASK = "evil<script>alert(1)</script>'\""
WORKER = 'w"><svg onload=alert(2)>\x1b'
STEP = 'step"><script>alert(3)</script>'

RAW_MARKERS = ("<script>alert", "<img src=x", "<svg onload", "<b>yyy", "\x1b", "\x07")


async def _seed(engine: Engine) -> tuple[UUID, UUID]:
    """A failed run and a waiting one, everything in them hostile."""
    backend = engine.backend
    failed = NewRun(
        run_id=new_run_id(),
        task_name=TASK,
        task_version=1,
        input_json=json.dumps({"note": HOSTILE, "long": LONG, HOSTILE: 1}),
        input_hash="h1",
        idempotency_key=HOSTILE,
        tags={"tenant": HOSTILE[:200]},
    )
    waiting = NewRun(
        run_id=new_run_id(),
        task_name=TASK,
        task_version=1,
        input_json=json.dumps([HOSTILE]),
        input_hash="h2",
    )
    await backend.enqueue(failed)
    await backend.enqueue(waiting)
    pair = TaskPair(name=TASK, version=1)
    claimed = await backend.claim(
        worker_id=WORKER, pairs=[pair], limit=2, lease=timedelta(seconds=30)
    )
    assert {c.run_id for c in claimed} == {failed.run_id, waiting.run_id}
    for run in claimed:
        lease = Lease(
            run_id=run.run_id,
            fencing_token=run.fencing_token,
            worker_id=WORKER,
            duration=timedelta(seconds=30),
        )
        await backend.record_step(
            lease,
            StepRecord(
                name=STEP,
                kind="step",
                status="completed",
                output_json=json.dumps({"out": HOSTILE}),
                started_at=run.claimed_at,
                finished_at=run.claimed_at + timedelta(milliseconds=5),
            ),
        )
        if run.run_id == failed.run_id:
            ending = Ending(
                status="failed",
                outcome="failed",
                error=ErrorInfo(type=HOSTILE, message=HOSTILE + LONG, traceback=HOSTILE),
                count_failure=True,
            )
        else:
            ending = Ending(
                status="waiting",
                outcome="waiting",
                wait_for="approval",
                step=StepRecord(
                    name="approval",
                    kind="fact",
                    status="waiting",
                    started_at=run.claimed_at,
                ),
            )
        assert await backend.end_execution(lease, ending) == "ended"
    # A worker's report, a concurrency key and a pause, all hostile.
    assert isinstance(backend, InsightStore)
    await backend.record_worker(
        WorkerState(
            worker_id=WORKER,
            host=HOSTILE,
            pid=1,
            pairs=(pair,),
            concurrency=1,
            runs_held=0,
            started_at=claimed[0].claimed_at,
        )
    )
    await backend.enqueue(
        NewRun(
            run_id=new_run_id(),
            task_name=TASK,
            task_version=1,
            input_json="null",
            input_hash="h3",
            concurrency_key=HOSTILE[:200],
            concurrency_limit=1,
        )
    )
    assert isinstance(backend, LifecycleStore)
    await backend.pause_task(task_name=TASK, task_version=None)
    assert isinstance(backend, RateLimitStore)
    await backend.define_rate_limit(TASK, limit=1, per=timedelta(seconds=1))
    return failed.run_id, waiting.run_id


def _assert_escaped(html: str, path: str) -> None:
    for marker in RAW_MARKERS:
        assert marker not in html, (path, marker)


@pytest.fixture
async def seeded(dash_engine: Engine) -> tuple[UUID, UUID]:
    return await _seed(dash_engine)


def pages_for(failed: UUID, waiting: UUID) -> list[str]:
    hostile = quote(HOSTILE)
    return [
        "/runs",
        "/runs/rows",
        "/runs?status=failed",
        f"/runs?task={quote(TASK)}",
        f"/runs?task={hostile}&idempotency_key={hostile}",
        f"/runs?run_id={hostile}&created_after={hostile}&before={hostile}",
        f"/runs/cancel?task={quote(TASK)}",
        f"/runs/cancel?task={hostile}",
        f"/runs/{failed}",
        f"/runs/{failed}/live",
        f"/runs/{waiting}",
        f"/runs/{waiting}/live",
        f"/login?next={hostile}",
        f"/runs?worker={quote(WORKER)}",
        "/tasks",
        "/workers",
        "/concurrency",
        "/paused",
        "/schedules",
        "/rate-limits",
        f"/tasks/{quote(TASK, safe='')}/1/enqueue",
    ]


async def test_every_page_escapes_hostile_values(board: Browser, seeded: tuple[UUID, UUID]) -> None:
    failed, waiting = seeded
    for path in pages_for(failed, waiting):
        response = await board.get(path)
        assert response.status_code in (200, 400, 404), (path, response.status_code)
        _assert_escaped(response.text, path)


async def test_metrics_escape_labels_as_the_prometheus_format_says(
    board: Browser, seeded: tuple[UUID, UUID]
) -> None:
    response = await board.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")  # never rendered as HTML
    assert response.headers["x-content-type-options"] == "nosniff"
    assert 'task="evil<script>alert(1)</script>\'\\""' in response.text


async def test_hostile_values_are_shown_as_text(board: Browser, seeded: tuple[UUID, UUID]) -> None:
    failed, waiting = seeded
    listing = await board.page("/runs")
    assert "evil&lt;script&gt;alert(1)&lt;/script&gt;&#39;&#34;@1" in listing
    page = await board.page(f"/runs/{failed}")
    assert "&lt;script&gt;alert(&#34;umt&#34;)&lt;/script&gt;" in page  # the error message
    assert "w&#34;&gt;&lt;svg onload=alert(2)&gt;\\x1b" in page  # the worker, control shown
    assert "step&#34;&gt;&lt;script&gt;alert(3)&lt;/script&gt;" in page  # the step name
    assert "\\u001b[31m" in page  # inside the JSON input, as JSON writes it
    assert "&lt;b&gt;" + "y" * 1000 in page  # the long string, escaped, not cut at once
    waiting_page = await board.page(f"/runs/{waiting}")
    assert "fact wait approval" in waiting_page
    workers = await board.page("/workers")
    assert "w&#34;&gt;&lt;svg onload=alert(2)&gt;\\x1b" in workers
    assert "&lt;script&gt;alert(&#34;umt&#34;)&lt;/script&gt;" in workers  # the host
    assert "&lt;script&gt;alert(&#34;umt&#34;)&lt;/script&gt;" in await board.page("/concurrency")
    assert "evil&lt;script&gt;alert(1)&lt;/script&gt;" in await board.page("/paused")
    assert "evil&lt;script&gt;alert(1)&lt;/script&gt;" in await board.page("/tasks")
    assert "evil&lt;script&gt;alert(1)&lt;/script&gt;" in await board.page("/rate-limits")
    by_worker = await board.page(f"/runs?worker={quote(WORKER)}")
    assert str(failed) in by_worker


async def test_a_hostile_fact_and_reason_come_back_escaped(
    board: Browser, seeded: tuple[UUID, UUID]
) -> None:
    _, waiting = seeded
    response = await board.submit(
        f"/runs/{waiting}/signal", {"name": "not a name <script>", "payload": HOSTILE}
    )
    assert response.status_code == 400
    _assert_escaped(response.text, "signal form")
    assert "&lt;script&gt;" in response.text
    reason = HOSTILE.replace("\x1b", "").replace("\x07", "")
    canceled = await board.submit(f"/runs/{waiting}/cancel", {"reason": reason})
    assert canceled.status_code == 303
    page = await board.page(canceled.headers["location"])
    _assert_escaped(page, "after cancel")
    assert "cancel" in page
