"""A publish joins the caller's trace, and the runs it starts (at the publish, or later for a
subscriber registered after it) are its children, as an enqueue's run is the enqueue's."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import attrs
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from umt_sdk import Engine, Registry, TaskContext, UsageError, connect, connect_sync, task
from umt_sdk.testing import FakeClock


@attrs.frozen
class Placed:
    order_id: str


@task("traced.receipt", version=1, on_event="traced.placed")
async def receipt(ctx: TaskContext[Placed]) -> str:
    return ctx.input.order_id


@task("traced.points", version=1, on_event="traced.placed")
async def points(ctx: TaskContext[Placed]) -> str:
    return ctx.input.order_id


async def test_the_publish_joins_the_trace_and_its_runs_are_its_children() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = await connect(
        "memory://",
        registry=Registry([receipt]),
        clock=FakeClock(auto_advance=True),
        tracer_provider=provider,
    )
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("request") as request:
        published = await engine.publish("traced.placed", Placed("o1"), key="o1")
    (known,) = published.runs
    async with engine.worker():
        assert await known.result(timeout=5) == "o1"
    # A subscriber deployed later, on the same store, with its own registry.
    later = Engine(engine.backend, Registry([points]), telemetry=engine.telemetry)
    async with later.worker():
        for _ in range(2000):
            found = list(await later.list(task_name="traced.points"))
            if found and found[0].status == "completed":
                break
            await asyncio.sleep(0.005)
        assert [r.status for r in found] == ["completed"]
    await engine.close()

    spans = list(exporter.get_finished_spans())
    (publish,) = [s for s in spans if s.name == "umt.publish traced.placed"]
    assert publish.kind == SpanKind.PRODUCER
    assert publish.parent is not None
    assert publish.parent.span_id == request.get_span_context().span_id
    assert publish.context.trace_id == request.get_span_context().trace_id
    assert publish.attributes is not None
    assert publish.attributes["umt.event.id"] == str(published.event_id)
    assert publish.attributes["umt.event.created"] is True
    executions = {
        s.name: s for s in spans if s.name in ("umt.run traced.receipt", "umt.run traced.points")
    }
    assert set(executions) == {"umt.run traced.receipt", "umt.run traced.points"}
    for execution in executions.values():
        assert execution.parent is not None
        assert execution.parent.span_id == publish.context.span_id, execution.name
        assert execution.context.trace_id == publish.context.trace_id


async def test_a_publish_without_a_subscriber_stores_the_event_for_later() -> None:
    clock = FakeClock(auto_advance=True)
    engine = await connect("memory://", registry=Registry(), clock=clock)
    published = await engine.publish("traced.placed", {"order_id": "o2"})
    assert published.created
    assert published.runs == ()
    clock.advance(timedelta(hours=1))
    later = Engine(engine.backend, Registry([receipt]))
    async with later.worker():
        for _ in range(2000):
            if list(await later.list(task_name="traced.receipt")):
                break
            await asyncio.sleep(0.005)
    (run,) = list(await later.list(task_name="traced.receipt"))
    assert run.idempotency_key == f"umt.event:{published.event_id}"
    await engine.close()


def test_plain_code_publishes_through_the_sync_facade() -> None:
    with connect_sync("memory://", registry=Registry([receipt])) as facade:
        event_id = facade.publish("traced.placed", Placed("o3"), key="o3")
        assert facade.publish("traced.placed", Placed("o3"), key="o3") == event_id
        (run,) = facade.list(task_name="traced.receipt")
        assert run.idempotency_key == f"umt.event:{event_id}"
        with pytest.raises(UsageError) as info:
            facade.publish("traced placed", Placed("o4"))
        assert info.value.argument == "name"
