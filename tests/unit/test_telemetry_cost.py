"""What telemetry costs: `enqueue_many` is one PRODUCER span for the batch."""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from tests.unit.test_telemetry_truth import Key, Otel, attrs_of
from umt_sdk import TaskContext, task
from umt_sdk.testing import FakeClock


@task("cost.noop", version=1)
async def noop(ctx: TaskContext[Key]) -> str:
    return ctx.input.key


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
