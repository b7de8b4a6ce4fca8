"""The exact span tree of a run across a crash, a sleep and a fact, on real OTel SDK exporters."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from uuid import UUID

import attrs
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from umt_sdk import Engine, Registry, RetryPolicy, RunInfo, TaskContext, connect, task
from umt_sdk.testing import FakeClock, simulate_crash

GATE = asyncio.Event()
B_STARTED = asyncio.Event()
SEEN_TRACE_IDS: list[str] = []
BODIES: Counter[str] = Counter()


@attrs.frozen
class In:
    key: str


@task("traced", version=1)
async def traced(ctx: TaskContext[In]) -> str:
    SEEN_TRACE_IDS.append(ctx.trace_id)

    async def a() -> str:
        BODIES["a"] += 1
        return "a"

    async def b() -> str:
        BODIES["b"] += 1
        B_STARTED.set()
        await GATE.wait()
        return "b"

    await ctx.step.run("a", a)
    await ctx.step.run("b", b)
    await ctx.step.sleep("nap", timedelta(minutes=1))
    fact: dict[str, str] = await ctx.step.wait_for_fact("go")
    return fact["by"]


async def _until(engine: Engine, run_id: UUID, predicate: Callable[[RunInfo], bool]) -> None:
    for _ in range(2000):
        if predicate(await engine.get(run_id)):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"run {run_id} never reached the expected state")


def _by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


async def test_span_tree_across_crash_sleep_and_fact() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    clock = FakeClock(auto_advance=True)
    engine = await connect(
        "memory://",
        registry=Registry([traced]),
        clock=clock,
        tracer_provider=provider,
        meter_provider=meters,
    )
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("request") as request:
        handle = await engine.enqueue(traced, In("k"))
    first = engine.worker(lease=timedelta(seconds=5))
    await first.start()
    await asyncio.wait_for(B_STARTED.wait(), 5)
    simulate_crash(first)
    await first.stop()
    GATE.set()
    clock.advance(timedelta(seconds=6))
    async with engine.worker(lease=timedelta(seconds=5)):
        await _until(engine, handle.run_id, lambda i: i.status == "waiting")  # the nap
        clock.advance(timedelta(minutes=1))
        await _until(engine, handle.run_id, lambda i: i.waiting_for == "go")
        with tracer.start_as_current_span("operator"):
            await engine.signal(handle.run_id, "go", {"by": "ops"})
        assert await handle.result(timeout=5) == "ops"
    await engine.close()

    spans = list(exporter.get_finished_spans())
    trace_id = request.get_span_context().trace_id
    run_spans = [s for s in spans if s.name not in ("operator", "umt.signal go")]
    assert {s.context.trace_id for s in run_spans} == {trace_id}, "one trace from the request"
    assert set(SEEN_TRACE_IDS) == {format(trace_id, "032x")}, "ctx.trace_id is the trace's id"

    (enqueue,) = _by_name(spans, "umt.enqueue traced")
    assert enqueue.kind == SpanKind.PRODUCER
    assert enqueue.parent is not None
    assert enqueue.parent.span_id == request.get_span_context().span_id
    assert enqueue.attributes is not None
    assert enqueue.attributes["umt.run.id"] == str(handle.run_id)

    runs = sorted(_by_name(spans, "umt.run traced"), key=lambda s: s.start_time or 0)
    assert len(runs) == 4, [s.attributes for s in runs]
    for execution in runs:
        assert execution.kind == SpanKind.CONSUMER
        assert execution.parent is not None
        assert execution.parent.span_id == enqueue.context.span_id, "every execution is a child"
        assert execution.attributes is not None
        assert execution.attributes["umt.run.id"] == str(handle.run_id)
        assert execution.attributes["umt.task.name"] == "traced"
        assert execution.attributes["umt.task.version"] == 1
        assert execution.attributes["umt.priority"] == 0
        assert "umt.worker.id" in execution.attributes
    assert [s.attributes["umt.attempt"] for s in runs if s.attributes] == [1, 2, 3, 4]
    outcomes = [s.attributes["umt.outcome"] for s in runs if s.attributes]
    assert outcomes == ["stopped", "parked", "parked", "completed"]

    steps = [s for s in spans if s.name.startswith("umt.step ")]
    tree = sorted(
        (
            next(
                i for i, r in enumerate(runs) if s.parent and r.context.span_id == s.parent.span_id
            ),
            s.name,
            (s.attributes or {}).get("umt.step.outcome"),
        )
        for s in steps
    )
    assert tree == [
        (0, "umt.step a", "completed"),
        (0, "umt.step b", "interrupted"),
        (1, "umt.step b", "completed"),
    ], "only executed steps get spans; the replayed 'a' does not"

    def events(span: ReadableSpan) -> list[tuple[str, object]]:
        return [
            (
                e.name,
                (e.attributes or {}).get("umt.step.name")
                or (e.attributes or {}).get("umt.fact.name"),
            )
            for e in span.events
        ]

    assert events(runs[1]) == [
        ("umt.lease_taken_over", None),  # the crashed execution's lease, taken over
        ("umt.step.replayed", "a"),
        ("umt.sleep", "nap"),
    ]
    assert events(runs[2]) == [
        ("umt.step.replayed", "a"),
        ("umt.step.replayed", "b"),
        ("umt.sleep.done", "nap"),
        ("umt.wait_for_fact", "go"),
    ]
    assert events(runs[3]) == [
        ("umt.step.replayed", "a"),
        ("umt.step.replayed", "b"),
        ("umt.step.replayed", "nap"),
        ("umt.fact.received", "go"),
    ]
    (signal,) = _by_name(spans, "umt.signal go")
    (operator,) = _by_name(spans, "operator")
    assert signal.parent is not None
    assert signal.parent.span_id == operator.context.span_id
    assert BODIES == {"a": 1, "b": 2}

    data = reader.get_metrics_data()
    assert data is not None
    metrics = {
        m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    assert sum(p.value for p in metrics["umt.runs.enqueued"].data.data_points) == 1
    assert sum(p.value for p in metrics["umt.runs.started"].data.data_points) == 4
    assert sum(p.value for p in metrics["umt.runs.completed"].data.data_points) == 1
    assert sum(p.count for p in metrics["umt.step.duration"].data.data_points) == 3
    assert sum(p.count for p in metrics["umt.claim.latency"].data.data_points) == 4
    assert sum(p.value for p in metrics["umt.lease.expirations"].data.data_points) == 1


@task("failing", version=1)
async def failing(ctx: TaskContext[In]) -> None:
    raise ValueError(f"bad input {ctx.input.key}")


async def test_failed_run_records_the_exception_with_error_status() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = await connect(
        "memory://",
        registry=Registry([failing]),
        clock=FakeClock(auto_advance=True),
        tracer_provider=provider,
    )
    handle = await engine.enqueue(failing, In("x"))
    async with engine.worker():
        info = (await engine.wait_idle([handle.run_id], timeout=10))[0]
    await engine.close()
    assert info.status == "failed"
    runs = _by_name(list(exporter.get_finished_spans()), "umt.run failing")
    assert len(runs) == 3, "the default policy tries three times"
    for span in runs:
        assert span.status.status_code == StatusCode.ERROR
        assert any(e.name == "exception" for e in span.events)
    assert [(s.attributes or {})["umt.outcome"] for s in runs] == ["retrying", "retrying", "failed"]


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this error cannot be printed")


@task("unprintable.handler", version=1, retry=RetryPolicy.none())
async def unprintable_handler(ctx: TaskContext[In]) -> None:
    raise Unprintable


async def test_an_error_that_cannot_be_printed_is_recorded_on_the_run_span() -> None:
    """OpenTelemetry's own `record_exception` prints the error with `str()`, user code that
    may raise: the run's span still gets its exception event and its error status."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = await connect(
        "memory://",
        registry=Registry([unprintable_handler]),
        clock=FakeClock(auto_advance=True),
        tracer_provider=provider,
    )
    handle = await engine.enqueue(unprintable_handler, In("u"))
    async with engine.worker():
        info = (await engine.wait_idle([handle.run_id], timeout=10))[0]
    await engine.close()
    assert info.status == "failed"
    assert info.error is not None
    assert "unprintable Unprintable" in info.error.message
    (run,) = _by_name(list(exporter.get_finished_spans()), "umt.run unprintable.handler")
    assert run.status.status_code == StatusCode.ERROR
    assert "unprintable Unprintable" in (run.status.description or "")
    (event,) = [e for e in run.events if e.name == "exception"]
    attributes = event.attributes or {}
    assert str(attributes["exception.type"]).endswith("test_tracing.Unprintable")
    assert "unprintable Unprintable" in str(attributes["exception.message"])
