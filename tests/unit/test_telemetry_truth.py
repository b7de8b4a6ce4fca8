"""What the traces and metrics say, against what happened, on the real OpenTelemetry SDK's
in-memory exporters (the rows of the table in docs/operations.md, "Telemetry").

One rule for span status: a failure of the user's code is ERROR with an `exception` event,
retried or not; a cancel, a release or a lost lease is not an error, and the outcome says
which it was. An expired lease is counted once, by the process whose claim takes it over.
The Postgres-only rows (a SIGKILLed worker process, a rolled-back enqueue) are in
tests/integration/test_telemetry_pg.py.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import attrs
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from umt_sdk import (
    Engine,
    FactTimeoutError,
    RateLimit,
    Registry,
    RetryPolicy,
    RunInfo,
    TaskContext,
    connect,
    task,
    update,
)
from umt_sdk._telemetry import Telemetry
from umt_sdk.testing import FakeClock, freeze_heartbeats

REPO = Path(__file__).resolve().parents[2]
SIGNALS: dict[str, asyncio.Event] = {}
CALLS: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _fresh_signals() -> Iterator[None]:
    SIGNALS.clear()
    CALLS.clear()
    yield
    SIGNALS.clear()


def _signal(name: str) -> asyncio.Event:
    return SIGNALS.setdefault(name, asyncio.Event())


class Otel:
    """A process's telemetry: a tracer provider and a meter provider with in-memory readers."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def telemetry(self) -> Telemetry:
        return Telemetry(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider)

    async def engine(self, *tasks: Any, clock: FakeClock) -> Engine:
        return await connect(
            "memory://",
            registry=Registry(list(tasks)),
            clock=clock,
            tracer_provider=self.tracer_provider,
            meter_provider=self.meter_provider,
        )

    def spans(self, name: str) -> list[ReadableSpan]:
        found = [s for s in self.exporter.get_finished_spans() if s.name == name]
        return sorted(found, key=lambda s: s.start_time or 0)

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        if data is None:
            return []
        return [
            point
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]

    def total(self, name: str, **attributes: Any) -> float:
        """The sum of a counter (or the count of a histogram) over the points that carry
        `attributes`; 0 when nothing was recorded."""
        wanted = {k.replace("__", "."): v for k, v in attributes.items()}
        total = 0.0
        for point in self.points(name):
            if all(point.attributes.get(k) == v for k, v in wanted.items()):
                total += point.count if hasattr(point, "count") else point.value
        return total


def attrs_of(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def events(span: ReadableSpan, name: str) -> list[dict[str, Any]]:
    return [dict(e.attributes or {}) for e in span.events if e.name == name]


async def until(engine: Engine, run_id: UUID, predicate: Callable[[RunInfo], bool]) -> RunInfo:
    for _ in range(4000):
        info = await engine.get(run_id)
        if predicate(info):
            return info
        await asyncio.sleep(0.005)
    raise AssertionError(f"run {run_id} never reached the expected state")


@attrs.frozen
class Key:
    key: str


# -- a failed step attempt that is retried ---------------------------------------------------------


@task("tel.flaky", version=1)
async def flaky(ctx: TaskContext[Key]) -> str:
    await ctx.step.run("before", lambda: "ok")

    async def shaky() -> str:
        CALLS["shaky"] += 1
        if CALLS["shaky"] == 1:
            raise ValueError("flaky once")
        return "fine"

    value: str = await ctx.step.run("shaky", shaky)
    return value


async def test_a_retried_step_failure_is_an_error_in_the_trace() -> None:
    otel = Otel()
    engine = await otel.engine(flaky, clock=FakeClock(auto_advance=True))
    handle = await engine.enqueue(flaky, Key("k"))
    async with engine.worker():
        assert await handle.result(timeout=10) == "fine"
    await engine.close()

    first, second = otel.spans("umt.run tel.flaky")
    failed, retried = otel.spans("umt.step shaky")
    # The failed attempt: ERROR, its exception, and `retrying`.
    assert attrs_of(failed)["umt.step.outcome"] == "retrying"
    assert attrs_of(failed)["umt.step.attempt"] == 1
    assert failed.status.status_code == StatusCode.ERROR
    (exception,) = events(failed, "exception")
    assert str(exception["exception.type"]).endswith("ValueError")
    assert exception["exception.message"] == "flaky once"
    assert exception["exception.escaped"] is False
    assert "ValueError" in str(exception["exception.stacktrace"])
    # Its execution parked the run for the retry: ERROR too, as a handler's retried failure is.
    assert attrs_of(first)["umt.outcome"] == "retrying"
    assert first.status.status_code == StatusCode.ERROR
    assert [e["exception.message"] for e in events(first, "exception")] == ["flaky once"]
    (scheduled,) = events(first, "umt.step.retry_scheduled")
    assert scheduled["umt.step.name"] == "shaky"
    assert scheduled["umt.step.attempt"] == 1
    assert str(scheduled["exception.type"]).endswith("ValueError")
    assert scheduled["exception.message"] == "flaky once"
    assert "umt.retry_at" in scheduled
    # The retry: completed, no error; the step recorded before it is replayed, not run.
    assert attrs_of(retried)["umt.step.outcome"] == "completed"
    assert attrs_of(retried)["umt.step.attempt"] == 2
    assert retried.status.status_code == StatusCode.UNSET
    assert attrs_of(second)["umt.outcome"] == "completed"
    assert second.status.status_code == StatusCode.UNSET
    (replayed,) = events(second, "umt.step.replayed")
    assert (replayed["umt.step.name"], replayed["umt.step.kind"]) == ("before", "step")
    assert len(otel.spans("umt.step before")) == 1, "a replayed step gets no span"
    assert otel.total("umt.step.duration", umt__step__kind="step") == 3, "replays not counted"
    assert otel.total("umt.runs.started") == 2
    assert otel.total("umt.runs.completed") == 1
    assert otel.total("umt.runs.failed") == 0


@task("tel.doomed", version=1, retry=RetryPolicy(max_attempts=2, initial=timedelta(seconds=1)))
async def doomed(ctx: TaskContext[Key]) -> None:
    raise RuntimeError(f"no luck for {ctx.input.key}")


async def test_a_handler_failure_is_an_error_retried_or_not_and_the_run_counted_once() -> None:
    otel = Otel()
    engine = await otel.engine(doomed, clock=FakeClock(auto_advance=True))
    handle = await engine.enqueue(doomed, Key("d"))
    async with engine.worker():
        (info,) = await engine.wait_idle([handle.run_id], timeout=10)
    await engine.close()
    assert info.status == "failed"
    runs = otel.spans("umt.run tel.doomed")
    assert [attrs_of(s)["umt.outcome"] for s in runs] == ["retrying", "failed"]
    assert all(s.status.status_code == StatusCode.ERROR for s in runs)
    assert all(len(events(s, "exception")) == 1 for s in runs)
    assert otel.total("umt.runs.failed", umt__task__name="tel.doomed", umt__task__version=1) == 1
    assert otel.total("umt.runs.started") == 2


# -- a cancel, a release ---------------------------------------------------------------------------


@task("tel.cancelable", version=1)
async def cancelable(ctx: TaskContext[Key]) -> str:
    async def wait_for_cancel() -> str:
        _signal("started").set()
        await ctx.abort_event.wait()
        ctx.throw_if_canceled()
        return "never"

    value: str = await ctx.step.run("wait", wait_for_cancel)
    return value


async def test_a_step_stopped_by_a_cancel_is_canceled_not_failed() -> None:
    otel = Otel()
    engine = await otel.engine(cancelable, clock=FakeClock(auto_advance=True))
    handle = await engine.enqueue(cancelable, Key("c"))
    async with engine.worker():
        await asyncio.wait_for(_signal("started").wait(), 10)
        assert await engine.cancel(handle.run_id, reason="not needed") == "requested"
        (info,) = await engine.wait_idle([handle.run_id], timeout=10)
    await engine.close()
    assert info.status == "canceled"
    assert [(s.name, s.status) for s in info.timeline] == [("wait", "canceled")]

    (step,) = otel.spans("umt.step wait")
    assert attrs_of(step)["umt.step.outcome"] == "canceled"
    assert step.status.status_code == StatusCode.UNSET
    assert events(step, "exception") == []
    (execution,) = otel.spans("umt.run tel.cancelable")
    assert attrs_of(execution)["umt.outcome"] == "canceled"
    assert execution.status.status_code == StatusCode.UNSET
    assert events(execution, "exception") == [], "the cancel itself is no error"
    (requested,) = events(execution, "umt.cancel_requested")
    assert requested["umt.cancel.reason"] == "not needed"
    (cancel,) = otel.spans("umt.cancel")
    assert cancel.kind == SpanKind.CLIENT
    assert attrs_of(cancel)["umt.cancel.outcome"] == "requested"
    assert attrs_of(cancel)["umt.cancel.reason"] == "not needed"
    assert attrs_of(cancel)["umt.run.id"] == str(handle.run_id)
    assert otel.total("umt.runs.canceled", umt__task__name="tel.cancelable") == 1
    assert otel.total("umt.runs.failed") == 0


@task("tel.endless", version=1)
async def endless(ctx: TaskContext[Key]) -> None:
    async def forever() -> None:
        _signal("started").set()
        await asyncio.Event().wait()

    await ctx.step.run("forever", forever)


async def test_a_step_cut_off_by_a_shutdown_is_released_not_failed() -> None:
    otel = Otel()
    engine = await otel.engine(endless, clock=FakeClock(auto_advance=True))
    handle = await engine.enqueue(endless, Key("r"))
    worker = engine.worker()
    await worker.start()
    await asyncio.wait_for(_signal("started").wait(), 10)
    await worker.stop(grace=timedelta(0))
    info = await engine.get(handle.run_id)
    await engine.close()
    assert info.status == "pending", "handed back, uncharged"
    (step,) = otel.spans("umt.step forever")
    assert attrs_of(step)["umt.step.outcome"] == "released"
    assert step.status.status_code == StatusCode.UNSET
    assert events(step, "exception") == []
    (execution,) = otel.spans("umt.run tel.endless")
    assert attrs_of(execution)["umt.outcome"] == "released"
    assert execution.status.status_code == StatusCode.UNSET


@task("tel.late", version=1, timeout=timedelta(minutes=5))
async def late(ctx: TaskContext[Key]) -> None:
    async def forever() -> None:
        _signal("started").set()
        await asyncio.Event().wait()

    await ctx.step.run("forever", forever)


async def test_a_step_cut_off_by_the_run_deadline_is_a_deadline_and_the_run_fails() -> None:
    otel = Otel()
    clock = FakeClock()
    engine = await otel.engine(late, clock=clock)
    handle = await engine.enqueue(late, Key("d"))
    never = await engine.enqueue(late, Key("s"), start_within=timedelta(minutes=1))
    async with engine.worker(concurrency=1):
        await asyncio.wait_for(_signal("started").wait(), 10)
        clock.advance(timedelta(minutes=5))
        infos = await engine.wait_idle([handle.run_id, never.run_id], timeout=10)
    await engine.close()
    assert [i.status for i in infos] == ["failed", "failed"]
    (step,) = otel.spans("umt.step forever")
    assert attrs_of(step)["umt.step.outcome"] == "deadline"
    assert events(step, "exception") == []
    first, second = otel.spans("umt.run tel.late")
    assert attrs_of(first)["umt.outcome"] == "failed"
    (came,) = events(first, "umt.deadline")
    assert came["umt.deadline.kind"] == "run"
    assert came["umt.deadline.at"] == infos[0].deadline_at.isoformat()  # type: ignore[union-attr]
    (start,) = events(second, "umt.deadline")
    assert start["umt.deadline.kind"] == "start"
    assert otel.total("umt.runs.failed", umt__task__name="tel.late") == 2


# -- a lost lease: counted once, by each process for what it saw -----------------------------------


@task("tel.held", version=1)
async def held(ctx: TaskContext[Key]) -> str:
    async def hold() -> str:
        if ctx.attempt > 1:
            return "taken over"
        _signal("started").set()
        await _signal("let-go").wait()  # ignores its abort: a frozen process does not look
        return "too late"

    value: str = await ctx.step.run("hold", hold)
    return value


async def test_an_expired_lease_is_counted_by_the_claim_that_takes_it_over_once() -> None:
    """Two processes on one store, each with its own telemetry: A freezes (its heartbeats stop)
    and wakes up after B took the run over. B counts the expiration; A counts only that it
    lost its lease, and the write it tried (refused by fencing)."""
    clock = FakeClock()
    a, b = Otel(), Otel()
    engine_a = await a.engine(held, clock=clock)
    engine_b = Engine(engine_a.backend, engine_a.registry, telemetry=b.telemetry())
    handle = await engine_a.enqueue(held, Key("h"))
    lease = timedelta(minutes=1)  # never runs out on the monotonic clock during the test
    worker_a = engine_a.worker(lease=lease, poll_interval=timedelta(milliseconds=20))
    await worker_a.start()
    await asyncio.wait_for(_signal("started").wait(), 10)
    freeze_heartbeats(worker_a)
    clock.advance(lease + timedelta(seconds=1))
    async with engine_b.worker(lease=lease, poll_interval=timedelta(milliseconds=20)):
        assert await handle.result(timeout=10) == "taken over"
    _signal("let-go").set()  # A wakes up and tries to record its step
    await until(engine_a, handle.run_id, lambda _: not worker_a.running_runs)
    await worker_a.stop()
    info = await engine_a.get(handle.run_id)
    await engine_a.close()

    assert info.lease_expirations == 1
    # B took the lease over: the expiration is B's to count, and its execution says so.
    assert b.total("umt.lease.expirations", umt__task__name="tel.held") == 1
    assert b.total("umt.lease.lost") == 0
    (b_run,) = b.spans("umt.run tel.held")
    (taken,) = events(b_run, "umt.lease_taken_over")
    assert taken["umt.lease.lost_since_step"] == 1
    # A never counts the expiration again; it counts the lease it lost and its refused write.
    assert a.total("umt.lease.expirations") == 0
    assert a.total("umt.lease.lost", umt__task__name="tel.held") == 1
    assert a.total("umt.fencing.rejections", umt__task__name="tel.held") == 1
    (a_run,) = a.spans("umt.run tel.held")
    assert attrs_of(a_run)["umt.outcome"] == "stopped"
    assert a_run.status.status_code == StatusCode.UNSET
    (rejected,) = events(a_run, "umt.fencing_rejected")
    assert rejected["umt.step.name"] == "hold"
    (lost,) = events(a_run, "umt.lease_lost")
    assert "another attempt holds the run" in str(lost["umt.reason"])
    (a_step,) = a.spans("umt.step hold")
    assert attrs_of(a_step)["umt.step.outcome"] == "lease_lost"
    assert a_step.status.status_code == StatusCode.UNSET
    # No run id in a metric's attributes: one series per task, not per run.
    for otel in (a, b):
        for name in ("umt.lease.expirations", "umt.lease.lost", "umt.fencing.rejections"):
            assert all("umt.run.id" not in p.attributes for p in otel.points(name))


# -- enqueue, signal, broadcast --------------------------------------------------------------------


@task("tel.noop", version=1)
async def noop(ctx: TaskContext[Key]) -> str:
    return ctx.input.key


async def test_enqueue_counts_runs_it_committed_and_requests() -> None:
    otel = Otel()
    engine = await otel.engine(noop, clock=FakeClock(auto_advance=True))
    first = await engine.enqueue(noop, Key("a"), idempotency_key="one", priority=3)
    again = await engine.enqueue(noop, Key("a"), idempotency_key="one", priority=3)
    assert again.run_id == first.run_id
    stored = await engine.signal(first.run_id, "go", {"n": 1})
    ignored = await engine.signal(first.run_id, "go", {"n": 2})
    broadcast = await engine.broadcast("all", None)
    await engine.close()
    assert (stored, ignored, broadcast) == (True, False, True)

    created, existing = otel.spans("umt.enqueue tel.noop")
    for span in (created, existing):
        assert span.kind == SpanKind.PRODUCER
        attributes = attrs_of(span)
        assert attributes["messaging.system"] == "umt"
        assert attributes["messaging.operation.type"] == "send"
        assert attributes["messaging.destination.name"] == "tel.noop"
        assert attributes["messaging.message.id"] == str(first.run_id)
        assert attributes["umt.run.id"] == str(first.run_id)
        assert attributes["umt.priority"] == 3
        assert (attributes["umt.task.name"], attributes["umt.task.version"]) == ("tel.noop", 1)
        assert attributes["umt.enqueue.transaction"] == "own"
        assert "umt.run.created_if_committed" not in attributes
    assert attrs_of(created)["umt.run.created"] is True
    assert attrs_of(existing)["umt.run.created"] is False
    assert otel.total("umt.runs.enqueued", umt__task__name="tel.noop") == 1
    assert otel.total("umt.enqueue.requests", umt__enqueue__transaction="own") == 2

    signals = otel.spans("umt.signal go")
    assert [attrs_of(s)["umt.fact.stored"] for s in signals] == [True, False]
    assert all(attrs_of(s)["umt.fact.name"] == "go" for s in signals)
    (sent,) = otel.spans("umt.broadcast all")
    assert attrs_of(sent)["umt.fact.stored"] is True


# -- sleeps, facts, the queue ----------------------------------------------------------------------


@task("tel.patient", version=1)
async def patient(ctx: TaskContext[Key]) -> str:
    await ctx.step.sleep("nap", timedelta(minutes=1))
    got: dict[str, str] = await ctx.step.wait_for_fact("go", timeout=timedelta(hours=1))
    try:
        await ctx.step.wait_for_fact("never", timeout=timedelta(minutes=1))
    except FactTimeoutError:
        return f"{got['by']}, then timed out"
    return "unreachable"


async def test_sleeps_and_fact_waits_are_events_on_the_execution() -> None:
    otel = Otel()
    engine = await otel.engine(patient, clock=FakeClock(auto_advance=True))
    handle = await engine.enqueue(patient, Key("p"))
    await engine.signal(handle.run_id, "go", {"by": "ops"})  # kept until the wait reads it
    async with engine.worker():
        assert await handle.result(timeout=10) == "ops, then timed out"
    await engine.close()
    runs = otel.spans("umt.run tel.patient")
    assert [attrs_of(s)["umt.outcome"] for s in runs] == ["parked"] * (len(runs) - 1) + [
        "completed"
    ]
    everything = [(e.name, dict(e.attributes or {})) for s in runs for e in s.events]
    names = [name for name, _ in everything if name != "umt.step.replayed"]
    assert names == [
        "umt.sleep",
        "umt.sleep.done",
        "umt.fact.received",
        "umt.wait_for_fact",
        "umt.fact.timeout",
    ]
    by_name = dict(everything)
    assert by_name["umt.sleep"]["umt.step.name"] == "nap"
    assert "umt.sleep.until" in by_name["umt.sleep"]
    assert by_name["umt.fact.received"] == {"umt.fact.name": "go", "umt.fact.source": "signal"}
    assert by_name["umt.wait_for_fact"]["umt.fact.name"] == "never"
    assert "umt.fact.deadline" in by_name["umt.wait_for_fact"]
    assert by_name["umt.fact.timeout"] == {"umt.fact.name": "never"}
    assert all(s.status.status_code == StatusCode.UNSET for s in runs)
    for execution in runs:
        attributes = attrs_of(execution)
        assert execution.kind == SpanKind.CONSUMER
        assert attributes["messaging.operation.type"] == "process"
        assert attributes["messaging.destination.name"] == "tel.patient"
    assert otel.total("umt.claim.latency") == len(runs)


@task("tel.child", version=1)
async def tel_child(ctx: TaskContext[Key]) -> str:
    await ctx.step.sleep("nap", timedelta(minutes=5))
    return ctx.input.key.upper()


@task("tel.parent", version=1)
async def tel_parent(ctx: TaskContext[Key]) -> str:
    handle = await ctx.step.start_child("kid", tel_child, Key(ctx.input.key))
    value: str = await handle.result()
    return value


async def test_waiting_on_a_child_is_an_event_naming_the_child() -> None:
    otel = Otel()
    engine = await otel.engine(tel_parent, tel_child, clock=FakeClock(auto_advance=True))
    handle = await engine.enqueue(tel_parent, Key("c"))
    async with engine.worker():
        assert await handle.result(timeout=10) == "C"
    (child,) = (await engine.list(parent=handle.run_id)).runs
    await engine.close()
    runs = otel.spans("umt.run tel.parent")
    waits = [e for s in runs for e in events(s, "umt.child.wait")]
    assert waits == [{"umt.step.name": "kid.result", "umt.child.run_id": str(child.run_id)}]
    assert [attrs_of(s)["umt.outcome"] for s in runs] == ["parked", "completed"]


@task("tel.fan", version=1)
async def tel_fan(ctx: TaskContext[Key]) -> list[str]:
    return await ctx.step.map("kids", tel_child, [Key("a"), Key("b"), Key("c")])


async def test_waiting_on_a_fan_out_is_one_event_counting_the_children() -> None:
    otel = Otel()
    engine = await otel.engine(tel_fan, tel_child, clock=FakeClock(auto_advance=True))
    handle = await engine.enqueue(tel_fan, Key("f"))
    async with engine.worker():
        assert await handle.result(timeout=10) == ["A", "B", "C"]
    await engine.close()
    runs = otel.spans("umt.run tel.fan")
    waits = [e for s in runs for e in events(s, "umt.children.wait")]
    assert waits == [{"umt.step.name": "kids.result", "umt.children.count": 3}]
    assert [attrs_of(s)["umt.outcome"] for s in runs] == ["parked", "completed"]


async def test_pause_and_resume_are_client_spans_naming_the_task() -> None:
    otel = Otel()
    engine = await otel.engine(noop, clock=FakeClock())
    assert await engine.pause("tel.noop@1") is True
    assert await engine.pause("tel.noop@1") is False
    assert await engine.resume("tel.noop") is True
    await engine.close()
    pauses = otel.spans("umt.pause")
    assert [(s.kind, attrs_of(s)["umt.task.name"]) for s in pauses] == [
        (SpanKind.CLIENT, "tel.noop@1"),
        (SpanKind.CLIENT, "tel.noop@1"),
    ]
    (resume,) = otel.spans("umt.resume")
    assert (resume.kind, attrs_of(resume)["umt.task.name"]) == (SpanKind.CLIENT, "tel.noop")


async def test_the_queue_depth_gauge_counts_the_pending_runs_a_worker_serves() -> None:
    otel = Otel()
    engine = await otel.engine(noop, clock=FakeClock())
    for key in ("x", "y"):
        await engine.enqueue(noop, Key(key), delay=timedelta(hours=1))
    async with engine.worker():
        for _ in range(2000):
            if otel.points("umt.queue.depth"):
                break
            await asyncio.sleep(0.005)
    await engine.close()
    (point,) = otel.points("umt.queue.depth")
    assert point.value == 2
    assert dict(point.attributes) == {"umt.task.name": "tel.noop", "umt.task.version": 1}


LIMITED = RateLimit("tel.api", limit=1, per=timedelta(minutes=1))


@task("tel.limited", version=1)
async def tel_limited(ctx: TaskContext[Key]) -> str:
    first: str = await ctx.step.run(
        "ask", lambda: "a", rate_limit=LIMITED, rate_limit_key=ctx.input.key
    )
    second: str = await ctx.step.run(
        "again", lambda: "b", rate_limit="tel.api", rate_limit_key=ctx.input.key
    )
    return first + second


async def test_a_step_waiting_for_a_rate_limit_token_is_an_event_naming_the_limit() -> None:
    otel = Otel()
    clock = FakeClock(auto_advance=True)
    engine = await otel.engine(tel_limited, clock=clock)
    handle = await engine.enqueue(tel_limited, Key("t7"))
    async with engine.worker():
        assert await handle.result(timeout=10) == "ab"
    await engine.close()
    runs = otel.spans("umt.run tel.limited")
    assert [attrs_of(s)["umt.outcome"] for s in runs] == ["parked", "completed"]
    waits = [e for s in runs for e in events(s, "umt.rate_limit.wait")]
    # "ask" took the bucket's one token; "again" found none and parked its run until the next.
    (wait,) = waits
    until = wait.pop("umt.rate_limit.until")
    assert wait == {
        "umt.step.name": "again",
        "umt.step.attempt": 1,
        "umt.rate_limit.name": "tel.api",
        "umt.rate_limit.key": "t7",
        "umt.rate_limit.paused": False,
        "umt.rate_limit.parked": True,
    }
    (ask,) = otel.spans("umt.step ask")
    (again,) = otel.spans("umt.step again")
    assert ask.start_time is not None
    # The wait names the bucket's next token: one interval after "ask" took the first.
    parked_at = datetime.fromisoformat(until)
    assert parked_at > datetime.fromtimestamp(ask.start_time / 1e9, tz=UTC)
    assert again.parent is not None
    assert again.parent.span_id == runs[1].context.span_id


BRISK = RateLimit("tel.brisk", limit=1, per=timedelta(milliseconds=900))


@task("tel.brisk", version=1)
async def tel_brisk(ctx: TaskContext[Key]) -> str:
    for name in ("one", "two"):
        await ctx.step.run(name, lambda: None, rate_limit=BRISK, rate_limit_key=ctx.input.key)
    return "done"


async def test_a_short_wait_for_a_token_is_in_place_and_does_not_park_the_run() -> None:
    otel = Otel()
    engine = await connect(  # the real clock: a token due within a second is waited for here
        "memory://",
        registry=Registry([tel_brisk]),
        tracer_provider=otel.tracer_provider,
        meter_provider=otel.meter_provider,
    )
    handle = await engine.enqueue(tel_brisk, Key("b"))
    async with engine.worker():
        assert await handle.result(timeout=10) == "done"
    await engine.close()
    (run,) = otel.spans("umt.run tel.brisk")
    assert attrs_of(run)["umt.outcome"] == "completed"
    waits = events(run, "umt.rate_limit.wait")
    assert waits, "step 'two' came within 900 ms of 'one' and found the bucket empty"
    assert {
        (w["umt.step.name"], w["umt.rate_limit.key"], w["umt.rate_limit.parked"]) for w in waits
    } == {("two", "b", False)}


@task("tel.unkeyed", version=1)
async def tel_unkeyed(ctx: TaskContext[Key]) -> str:
    value: str = await ctx.step.run("call", lambda: ctx.input.key, rate_limit=LIMITED)
    return value


async def test_a_step_waiting_on_a_paused_limit_says_so_and_names_no_key() -> None:
    otel = Otel()
    engine = await otel.engine(tel_unkeyed, clock=FakeClock(auto_advance=True))
    await engine.rate_limits.set(LIMITED)
    await engine.rate_limits.pause("tel.api")
    handle = await engine.enqueue(tel_unkeyed, Key("u"))
    async with engine.worker():
        await until(engine, handle.run_id, lambda info: info.status == "waiting")
        assert await engine.rate_limits.resume("tel.api") is True
        assert await handle.result(timeout=10) == "u"
    await engine.close()
    runs = otel.spans("umt.run tel.unkeyed")
    waits = [e for s in runs for e in events(s, "umt.rate_limit.wait")]
    assert waits, "the paused limit made the step wait"
    for wait in waits:
        assert "umt.rate_limit.key" not in wait  # the limit's one bucket
        assert "umt.rate_limit.until" in wait
        assert (wait["umt.rate_limit.name"], wait["umt.rate_limit.paused"]) == ("tel.api", True)
        assert (wait["umt.step.name"], wait["umt.rate_limit.parked"]) == ("call", True)
    assert attrs_of(runs[-1])["umt.outcome"] == "completed"


# -- callback tokens ----------------------------------------------------------------------------

TOKENS: list[str] = []


@task("tel.callback", version=1)
async def calls_back(ctx: TaskContext[Key]) -> str:
    token = await ctx.step.callback_token("pay", timeout=timedelta(hours=1))
    TOKENS.append(token)
    got: str = await ctx.step.wait_for_callback(token)
    return got


async def test_a_callback_mints_once_and_its_completion_is_a_span() -> None:
    TOKENS.clear()
    otel = Otel()
    engine = await otel.engine(calls_back, clock=FakeClock(auto_advance=True))
    handle = await engine.enqueue(calls_back, Key("c"))
    async with engine.worker():
        await until(engine, handle.run_id, lambda i: i.status == "waiting")
        await engine.complete_callback(TOKENS[0], "ok")
        assert await handle.result(timeout=10) == "ok"
    await engine.close()
    runs = otel.spans("umt.run tel.callback")
    minted = [e for s in runs for e in events(s, "umt.callback.minted")]
    assert minted == [{"umt.step.name": "pay"}], "minted once, not again on replay"
    (completed,) = otel.spans("umt.complete_callback pay")
    assert completed.kind == SpanKind.PRODUCER
    assert attrs_of(completed)["umt.run.id"] == str(handle.run_id)
    assert attrs_of(completed)["umt.step.name"] == "pay"
    spans = otel.exporter.get_finished_spans()
    everything = [str(v) for s in spans for v in attrs_of(s).values()]
    everything += [str(v) for s in spans for e in s.events for v in (e.attributes or {}).values()]
    assert not any(TOKENS[0] in v for v in everything), "the token is never an attribute"


# -- updates ------------------------------------------------------------------------------------


@update("tel.approve")
async def tel_approve(ctx: TaskContext[Key], by: str) -> str:
    return f"approved by {by}"


@task("tel.update", version=1, updates=[tel_approve])
async def updated(ctx: TaskContext[Key]) -> str:
    applied = await ctx.step.wait_for_update("tel.approve")
    return str(applied.result)


async def test_an_update_is_a_span_naming_the_update() -> None:
    otel = Otel()
    engine = await otel.engine(updated, clock=FakeClock(auto_advance=True))
    handle = await engine.enqueue(updated, Key("u"))
    async with engine.worker():
        await until(engine, handle.run_id, lambda i: i.status == "waiting")
        assert await handle.update("tel.approve", "ops", timeout=10) == "approved by ops"
        assert await handle.result(timeout=10) == "approved by ops"
    await engine.close()
    (sent,) = otel.spans("umt.update tel.approve")
    assert sent.kind == SpanKind.PRODUCER
    assert attrs_of(sent)["umt.run.id"] == str(handle.run_id)
    assert attrs_of(sent)["umt.update.name"] == "tel.approve"


# -- patches ------------------------------------------------------------------------------------


@task("tel.patched", version=1)
async def patched_task(ctx: TaskContext[Key]) -> bool:
    decided = await ctx.patched("tel-patch")
    await ctx.step.sleep("nap", timedelta(seconds=1))  # a second execution replays the marker
    return decided


async def test_a_patch_marker_is_an_event_when_recorded_only() -> None:
    otel = Otel()
    engine = await otel.engine(patched_task, clock=FakeClock(auto_advance=True))
    handle = await engine.enqueue(patched_task, Key("p"))
    async with engine.worker():
        assert await handle.result(timeout=10) is True
    await engine.close()
    runs = otel.spans("umt.run tel.patched")
    assert len(runs) == 2
    recorded = [e for s in runs for e in events(s, "umt.patch.recorded")]
    assert recorded == [{"umt.patch.id": "tel-patch", "umt.patch.call": "patched"}]
    (replayed,) = events(runs[1], "umt.step.replayed")
    assert replayed["umt.step.name"] == "umt.patch:tel-patch"


# -- the table -------------------------------------------------------------------------------------

_EMITTERS = [
    "umt_sdk/_telemetry.py",
    "umt_sdk/_engine.py",
    "umt_sdk/_execution.py",
    "umt_sdk/_steps.py",
    "umt_backend_pg/outbox/_dispatch.py",
]
_NAME = re.compile(r'"((?:umt|messaging|exception)\.[a-z_.]+)"')
_NOT_TELEMETRY = {"umt.outbox", "umt.task", "umt.worker", "umt.cli", "umt.pg", "umt.fencing"}


def _table_names() -> set[str]:
    """Every name in the tables of the "Telemetry" section of docs/operations.md."""
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("## Telemetry", 1)[1].split("\n## ", 1)[0]
    rows = "\n".join(row for row in section.splitlines() if row.startswith("|"))
    return set(re.findall(r"`((?:umt|messaging|exception)\.[a-z_.]+)`", rows)) - _NOT_TELEMETRY


def test_the_docs_table_lists_every_metric_span_attribute_and_event_emitted() -> None:
    emitted = {
        name
        for path in _EMITTERS
        for name in _NAME.findall((REPO / path).read_text())
        if name not in _NOT_TELEMETRY
    }
    assert emitted, "expected the emitters to name what they emit"
    table = _table_names()
    assert sorted(emitted - table) == [], "emitted but not in docs/operations.md"
    assert sorted(table - emitted) == [], "in docs/operations.md but emitted nowhere"


def test_every_row_of_the_table_is_asserted_by_a_test() -> None:
    here = Path(__file__).resolve()
    texts = [p.read_text() for p in (REPO / "tests").rglob("*.py") if p.resolve() != here]
    texts.append(here.read_text().split("# -- the table", 1)[0])  # not the lists below
    unasserted = sorted(n for n in _table_names() if not any(f'"{n}"' in t for t in texts))
    assert unasserted == []
