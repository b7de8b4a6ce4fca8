"""Event triggers: `engine.publish` starts every subscriber (`@task(on_event=...)`) once per
event; a repeat of (name, key) starts nothing; a rolled-back publish leaves nothing; a
subscriber registered later gets the events of the window and not older ones; a payload a
subscriber's input type refuses fails the publish (known subscriber) or is recorded as
refused (late subscriber)."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import pytest

from umt_sdk import (
    Engine,
    IdempotencyConflictError,
    PayloadError,
    Registry,
    TaskContext,
    TaskDefinition,
    UsageError,
    task,
)
from umt_sdk._codec_backend import CodecBackend, wrap_backend
from umt_sdk.backend import EventStore
from umt_sdk.testing._contract._base import current_tally, eventually
from umt_sdk.testing._contract._codecs import KEY_1, SECRET, _codec
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["EventsContract"]

PLACED = "contract.order.placed"
_LONG_AGO = datetime(2000, 1, 1, tzinfo=UTC)


@attrs.frozen
class Order:
    order_id: str
    amount: int = 0


@attrs.frozen
class Shipment:
    order_id: str
    address: str  # no default: a payload without it is refused


@task("contract.events.mail", version=1, on_event=PLACED)
async def mail_on_order(ctx: TaskContext[Order]) -> str:
    current_tally().order.append(f"mail:{ctx.input.order_id}")
    return f"mailed {ctx.input.order_id}"


@task("contract.events.stock", version=1, on_event=PLACED)
async def stock_on_order(ctx: TaskContext[dict[str, Any]]) -> int:
    current_tally().order.append(f"stock:{ctx.input['order_id']}")
    return int(ctx.input.get("amount", 0))


@task("contract.events.late", version=1, on_event="contract.late")
async def late_subscriber(ctx: TaskContext[Order]) -> str:
    return ctx.input.order_id


@task("contract.events.ship", version=1, on_event="contract.late")
async def picky_subscriber(ctx: TaskContext[Shipment]) -> str:
    return ctx.input.address


TASKS: tuple[TaskDefinition[Any, Any], ...] = (mail_on_order, stock_on_order)
"""The late subscribers are left out: a test registers them on a second engine."""


class _RollBack(Exception):
    """Raised inside the caller's transaction to roll it back."""


async def _runs_of(engine: Engine, task_name: str) -> list[Any]:
    return list(await engine.list(task_name=task_name, limit=100))


class EventsContract:
    """One durable event starts each subscriber once."""

    async def test_one_publish_starts_each_subscriber_once(self, engine: Engine) -> None:
        published = await engine.publish(PLACED, Order("o1", amount=3), key="o1")
        assert published.created
        assert published.key == "o1"
        assert sorted(h.task_name for h in published.runs) == [
            "contract.events.mail",
            "contract.events.stock",
        ]
        assert all(h.created for h in published.runs)
        async with engine.worker(concurrency=2):
            results = {h.task_name: await h.result(timeout=15) for h in published.runs}
        assert results == {"contract.events.mail": "mailed o1", "contract.events.stock": 3}
        for name in ("contract.events.mail", "contract.events.stock"):
            runs = await _runs_of(engine, name)
            assert len(runs) == 1, name
            assert runs[0].idempotency_key == f"umt.event:{published.event_id}"

    async def test_a_repeated_publish_starts_nothing_new(self, engine: Engine) -> None:
        first = await engine.publish(PLACED, {"order_id": "o2", "amount": 0}, key="o2")
        again = await engine.publish(PLACED, Order("o2"), key="o2")  # the same JSON
        assert (again.created, again.event_id, again.runs) == (False, first.event_id, ())
        with pytest.raises(IdempotencyConflictError):
            await engine.publish(PLACED, Order("o2", amount=9), key="o2")
        other = await engine.publish(PLACED, Order("o2"))  # no key: a new event
        assert other.created
        assert other.event_id != first.event_id
        for name in ("contract.events.mail", "contract.events.stock"):
            assert len(await _runs_of(engine, name)) == 2, name

    async def test_a_rolled_back_publish_starts_nothing(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        opener = getattr(harness, "engine_connection", None)
        if opener is None:  # a backend with no transaction to join refuses conn=
            with pytest.raises(UsageError) as info:
                await engine.publish(PLACED, Order("o3"), key="o3", conn=object())
            assert info.value.argument == "conn"
        else:
            conn = await opener()
            try:
                with contextlib.suppress(_RollBack):
                    async with conn.transaction():
                        inside = await engine.publish(PLACED, Order("o3"), key="o3", conn=conn)
                        assert inside.created
                        assert len(inside.runs) == 2
                        raise _RollBack
            finally:
                await conn.close()
        for name in ("contract.events.mail", "contract.events.stock"):
            assert await _runs_of(engine, name) == [], name
        after = await engine.publish(PLACED, Order("o3"), key="o3")
        assert after.created, "the rolled-back event was not stored"
        assert len(after.runs) == 2

    async def test_a_publish_committed_in_a_transaction_starts_its_runs(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        opener = getattr(harness, "engine_connection", None)
        if opener is None:
            published = await engine.publish(PLACED, Order("o4"), key="o4")
        else:
            conn = await opener()
            try:
                async with conn.transaction():
                    published = await engine.publish(PLACED, Order("o4"), key="o4", conn=conn)
            finally:
                await conn.close()
        async with engine.worker(concurrency=2):
            done = await engine.wait_idle([h.run_id for h in published.runs], timeout=15)
        assert [info.status for info in done] == ["completed", "completed"]

    async def test_bad_input_is_refused_and_nothing_stored(self, engine: Engine) -> None:
        for name in ("order placed", "", "order/placed", "é", 7):
            with pytest.raises(UsageError) as info:
                await engine.publish(name, Order("o5"), key="o5")  # type: ignore[arg-type]  # bad input under test
            assert info.value.argument == "name"
        with pytest.raises(UsageError) as info:
            await engine.publish(PLACED, Order("o5"), key=5)  # type: ignore[arg-type]  # bad input under test
        assert info.value.argument == "key"
        with pytest.raises(PayloadError, match="payload"):
            await engine.publish(PLACED, {"order_id": object()}, key="o5")
        with pytest.raises(PayloadError, match=r"contract\.events\.mail"):
            await engine.publish(PLACED, {"amount": 1}, key="o5")  # no order_id for Order
        for task_name in ("contract.events.mail", "contract.events.stock"):
            assert await _runs_of(engine, task_name) == []
        assert (await engine.publish(PLACED, Order("o5"), key="o5")).created

    async def test_a_late_subscriber_gets_the_events_of_the_window(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        window = timedelta(seconds=6)
        old = await engine.publish("contract.late", Order("old"), key="old")
        assert old.runs == (), "no subscriber known yet"
        await harness.advance(window + timedelta(seconds=1))
        new = await engine.publish("contract.late", {"order_id": "new"}, key="new")
        # A worker deployed later, whose registry subscribes, on the same store.
        later = Engine(
            engine.backend, Registry([late_subscriber, picky_subscriber]), event_window=window
        )
        async with later.worker(concurrency=2):

            async def started() -> bool:
                return len(await _runs_of(later, "contract.events.late")) == 1

            await eventually(started)
            runs = await _runs_of(later, "contract.events.late")
            assert runs[0].idempotency_key == f"umt.event:{new.event_id}"
            assert await later.result(runs[0].run_id, timeout=15) == "new"

            async def refused() -> bool:
                return len(await later.event_refusals()) == 1

            await eventually(refused)
        refusal = (await later.event_refusals())[0]
        assert (refusal.event_id, refusal.task_name) == (new.event_id, "contract.events.ship")
        assert "address" in refusal.reason
        assert await _runs_of(later, "contract.events.ship") == []
        assert len(await _runs_of(later, "contract.events.late")) == 1, "the old event expired"

    async def test_an_event_is_sealed_at_rest_under_a_codec(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        backend = wrap_backend(engine.backend, _codec({"k1": KEY_1}, "k1"))
        sealed = Engine(backend, engine.registry, telemetry=engine.telemetry)
        published = await sealed.publish(PLACED, Order(f"o-{SECRET}"), key="o6")
        assert len(published.runs) == 2
        again = await sealed.publish(PLACED, Order(f"o-{SECRET}"), key="o6")
        assert again.created is False, "the payload hash is the plaintext's"
        late = await sealed.publish("contract.late", Order(f"late-{SECRET}"), key="o6")
        assert isinstance(backend, CodecBackend)
        raw = backend.inner
        assert isinstance(raw, EventStore)
        stored = await raw.events_to_start(
            name="contract.late", task_name="contract.events.late", since=_LONG_AGO, limit=10
        )
        assert [e.event_id for e in stored] == [late.event_id]
        assert SECRET not in stored[0].payload_json, "the payload is sealed at rest"
        for handle in published.runs:
            run = await raw.get_run(handle.run_id)
            assert run is not None
            assert SECRET not in run.input_json
        later = Engine(backend, Registry([late_subscriber]), telemetry=engine.telemetry)
        async with later.worker(concurrency=1, lease=harness.lease):

            async def started() -> bool:
                return len(await _runs_of(later, "contract.events.late")) == 1

            await eventually(started)
            (run,) = await _runs_of(later, "contract.events.late")
            assert await later.result(run.run_id, timeout=15) == f"late-{SECRET}"

    async def test_events_are_listed_newest_first_with_the_runs_they_started(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        first = await engine.publish(PLACED, Order("l1", amount=1), key="l1")
        await harness.advance(timedelta(milliseconds=10))
        lonely = await engine.publish("contract.nobody", {"n": 1}, key="n1")
        await harness.advance(timedelta(milliseconds=10))
        second = await engine.publish(PLACED, Order("l2"))
        listed = await engine.events()
        assert [e.event_id for e in listed] == [second.event_id, lonely.event_id, first.event_id]
        newest = listed[0]
        assert (newest.name, newest.key) == (PLACED, str(second.event_id))
        assert newest.payload == {"order_id": "l2", "amount": 0}
        assert {(r.run_id, r.task_name, r.status) for r in newest.runs} == {
            (h.run_id, h.task_name, "pending") for h in second.runs
        }
        assert [r.task_name for r in newest.runs] == sorted(r.task_name for r in newest.runs)
        assert listed[1].runs == (), "an event no task subscribes to started nothing"
        assert listed[2].key == "l1"
        async with engine.worker(concurrency=2):
            await engine.wait_idle([h.run_id for h in first.runs], timeout=15)
        (done,) = await engine.events(name=PLACED, before=second.event_id)
        assert done.event_id == first.event_id
        assert {r.status for r in done.runs} == {"completed"}
        assert [e.event_id for e in await engine.events(name=PLACED, limit=1)] == [second.event_id]
        assert await engine.events(name="contract.none") == []

    async def test_listing_events_refuses_bad_arguments(self, engine: Engine) -> None:
        bad: list[tuple[str, dict[str, Any]]] = [
            ("name", {"name": "order placed"}),
            ("name", {"name": ""}),
            ("limit", {"limit": 0}),
            ("limit", {"limit": 501}),
            ("limit", {"limit": True}),
            ("before", {"before": "not-a-uuid"}),
        ]
        for argument, kwargs in bad:
            with pytest.raises(UsageError) as info:
                await engine.events(**kwargs)
            assert info.value.argument == argument, kwargs
