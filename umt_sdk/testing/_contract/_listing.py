"""Listing that scales: tags stored and matched, filters by key, time range and parent, and a
cursor that pages whatever happened to the run it names."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from umt_sdk import Engine, TaskDefinition, UsageError
from umt_sdk._engine import new_run_id
from umt_sdk.testing._contract._base import Job, echo_task_v2, other_task
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["ListingContract"]

TASKS: tuple[TaskDefinition[Any, Any], ...] = ()
"""None of its own: these tests run the shared tasks of `_base`."""


class ListingContract:
    """`enqueue(..., tags=)` keeps the tags; `list` matches every filter at once, newest first,
    and pages with a cursor."""

    async def test_tags_are_stored_and_read_back(self, engine: Engine) -> None:
        handle = await engine.enqueue(
            echo_task_v2, Job(key="t"), tags={"tenant": "t7", "region": "eu-west"}
        )
        plain = await engine.enqueue(echo_task_v2, Job(key="p"))
        assert (await engine.get(handle.run_id)).tags == {"tenant": "t7", "region": "eu-west"}
        assert (await engine.get(plain.run_id)).tags == {}
        (listed,) = (await engine.list(tags={"tenant": "t7"})).runs
        assert listed.tags == {"tenant": "t7", "region": "eu-west"}

    async def test_list_by_tags_matches_all_of_them_and_pages(self, engine: Engine) -> None:
        t7 = [
            await engine.enqueue(echo_task_v2, Job(key=f"a{i}"), tags={"tenant": "t7"})
            for i in range(3)
        ]
        t7_eu = [
            await engine.enqueue(
                other_task, Job(key=f"b{i}"), tags={"tenant": "t7", "region": "eu"}
            )
            for i in range(2)
        ]
        await engine.enqueue(echo_task_v2, Job(key="c"), tags={"tenant": "t8", "region": "eu"})
        await engine.enqueue(echo_task_v2, Job(key="d"))
        everyone = [h.run_id for h in reversed(t7_eu)] + [h.run_id for h in reversed(t7)]
        first = await engine.list(tags={"tenant": "t7"}, limit=3)
        assert [r.run_id for r in first] == everyone[:3]
        assert first.next_cursor is not None
        rest = await engine.list(tags={"tenant": "t7"}, limit=3, before=first.next_cursor)
        assert [r.run_id for r in rest] == everyone[3:]
        assert rest.next_cursor is None
        both = await engine.list(tags={"tenant": "t7", "region": "eu"})
        assert [r.run_id for r in both] == [h.run_id for h in reversed(t7_eu)]
        mixed = await engine.list(tags={"tenant": "t7"}, task_name="contract.echo")
        assert [r.run_id for r in mixed] == [h.run_id for h in reversed(t7)]
        assert len(await engine.list(tags={"tenant": "nobody"})) == 0
        assert len(await engine.list(tags={"region": "eu", "tenant": "t9"})) == 0

    async def test_list_by_idempotency_key(self, engine: Engine) -> None:
        keyed = await engine.enqueue(echo_task_v2, Job(key="k"), idempotency_key="order-17")
        await engine.enqueue(other_task, Job(key="k"), idempotency_key="order-18")
        await engine.enqueue(echo_task_v2, Job(key="n"))
        page = await engine.list(idempotency_key="order-17", task_name="contract.echo")
        assert [r.run_id for r in page] == [keyed.run_id]
        page = await engine.list(idempotency_key="order-17", task_name="contract.other")
        assert len(page) == 0
        with pytest.raises(UsageError, match="needs task_name"):
            await engine.list(idempotency_key="order-17")

    async def test_list_by_created_and_finished_time(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        early = await engine.enqueue(echo_task_v2, Job(key="early"))
        async with engine.worker():
            await early.result(timeout=15)
        await harness.advance(timedelta(milliseconds=400))
        late = await engine.enqueue(echo_task_v2, Job(key="late"))
        pending = await engine.enqueue(other_task, Job(key="pending"), delay=timedelta(days=1))
        early_info, late_info = await engine.get(early.run_id), await engine.get(late.run_id)
        assert early_info.finished_at is not None
        split = late_info.created_at
        assert early_info.created_at < split

        def ids(page: Any) -> list[Any]:
            return [r.run_id for r in page]

        assert ids(await engine.list(created_after=split)) == [pending.run_id, late.run_id]
        assert ids(await engine.list(created_before=split)) == [early.run_id]
        assert ids(
            await engine.list(created_after=early_info.created_at, created_before=split)
        ) == [early.run_id]
        finished = early_info.finished_at
        assert ids(await engine.list(finished_after=finished)) == [early.run_id]
        assert ids(await engine.list(finished_before=finished)) == []
        assert ids(await engine.list(finished_before=finished + timedelta(microseconds=1))) == [
            early.run_id
        ]
        far = datetime(2000, 1, 1, tzinfo=UTC)
        assert ids(await engine.list(finished_after=far)) == [early.run_id], (
            "a run that has not finished never matches a finished_ filter"
        )

    async def test_a_cursor_pages_even_when_its_run_is_gone(self, engine: Engine) -> None:
        """The cursor is a position (run ids grow with time), not a lookup."""
        handles = [await engine.enqueue(echo_task_v2, Job(key=str(i))) for i in range(3)]
        below = await engine.list(before=new_run_id())
        assert [r.run_id for r in below] == [h.run_id for h in reversed(handles)]
        middle = await engine.list(before=handles[2].run_id)
        assert [r.run_id for r in middle] == [handles[1].run_id, handles[0].run_id]

    async def test_bad_tags_and_filters_are_refused(self, engine: Engine) -> None:
        bad: list[Any] = [
            ["tenant", "t7"],
            {"": "x"},
            {"tenant id": "x"},
            {"k" * 65: "x"},
            {"tenant": 7},
            {"tenant": None},
            {"tenant": "v" * 257},
            {"tenant": "nul\x00"},
            {f"k{i}": "v" for i in range(17)},
            {7: "x"},
        ]
        for tags in bad:
            with pytest.raises(UsageError, match="tag") as caught:
                await engine.enqueue(echo_task_v2, Job(key="bad"), tags=tags)
            assert caught.value.argument == "tags", tags
            with pytest.raises(UsageError, match="tag"):
                await engine.list(tags=tags)
        assert len(await engine.list()) == 0, "nothing was stored"
        with pytest.raises(UsageError, match="created_after"):
            await engine.list(created_after=datetime(2026, 1, 1))
        with pytest.raises(UsageError, match="finished_before"):
            await engine.list(finished_before="2026-01-01")  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="idempotency_key"):
            await engine.list(idempotency_key="", task_name="contract.echo")
