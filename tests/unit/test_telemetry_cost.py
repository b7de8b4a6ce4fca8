"""What telemetry costs: `enqueue_many` is one PRODUCER span for the batch, and with no tracer
that records (none installed, a no-op provider) an enqueue or a step makes no span at all;
with one that records, every executed step still has its span
(tests/unit/test_telemetry_truth.py)."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import NoOpTracer, NoOpTracerProvider, SpanKind

from tests.unit.test_telemetry_truth import Key, Otel, attrs_of
from umt_sdk import Registry, TaskContext, connect, task
from umt_sdk.testing import FakeClock


@task("cost.noop", version=1)
async def noop(ctx: TaskContext[Key]) -> str:
    return ctx.input.key


async def _one(i: int) -> int:
    return i


@task("cost.steps", version=1)
async def five_steps(ctx: TaskContext[Key]) -> int:
    return sum([await ctx.step.run(f"s{i}", _one, i) for i in range(5)])


async def test_a_batch_is_one_producer_span_and_counts_each_input() -> None:
    otel = Otel()
    engine = await otel.engine(noop, clock=FakeClock(auto_advance=True))
    stored = await engine.enqueue(noop, Key("a"), idempotency_key="a")
    handles = await engine.enqueue_many(
        noop, [Key("a"), Key("b"), Key("c")], idempotency_keys=["a", None, None], priority=2
    )
    await engine.close()
    assert handles[0].run_id == stored.run_id
    _, batch = otel.spans("umt.enqueue cost.noop")
    assert batch.kind == SpanKind.PRODUCER
    attributes = attrs_of(batch)
    assert attributes["messaging.batch.message_count"] == 3
    assert attributes["umt.runs.created"] == 2
    assert "umt.runs.created_if_committed" not in attributes
    assert attributes["umt.enqueue.transaction"] == "own"
    assert attributes["umt.priority"] == 2
    assert otel.total("umt.runs.enqueued", umt__task__name="cost.noop") == 3
    assert otel.total("umt.enqueue.requests", umt__enqueue__transaction="own") == 4


class _CountingTracer(NoOpTracer):
    """A no-op tracer (as `NoOpTracerProvider` gives) that counts the spans asked of it
    (`start_as_current_span` starts its span with `start_span`)."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def start_span(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.started.append(name)
        return super().start_span(name, *args, **kwargs)


class _CountingProvider(NoOpTracerProvider):
    def __init__(self) -> None:
        self.tracer = _CountingTracer()

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return self.tracer


async def test_without_a_recording_tracer_a_step_makes_no_span() -> None:
    provider = _CountingProvider()
    engine = await connect(
        "memory://",
        registry=Registry([five_steps]),
        clock=FakeClock(auto_advance=True),
        tracer_provider=provider,
    )
    try:
        handle = await engine.enqueue(five_steps, Key("k"))
        async with engine.worker(concurrency=1):
            assert await handle.result(timeout=15) == 10
    finally:
        await engine.close()
    assert provider.tracer.started == ["umt.run cost.steps"], (
        "one (no-op) span per execution, none per enqueue or step"
    )


async def test_with_a_recording_tracer_every_step_has_its_span() -> None:
    otel = Otel()
    engine = await otel.engine(five_steps, clock=FakeClock(auto_advance=True))
    try:
        handle = await engine.enqueue(five_steps, Key("k"))
        async with engine.worker(concurrency=1):
            assert await handle.result(timeout=15) == 10
    finally:
        await engine.close()
    assert [len(otel.spans(f"umt.step s{i}")) for i in range(5)] == [1] * 5
    assert otel.total("umt.step.duration", umt__task__name="cost.steps") == 5
