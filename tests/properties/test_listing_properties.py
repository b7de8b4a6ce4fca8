"""Listing: whatever the filters and the page size, paging through `engine.list` to the end
gives exactly the runs a brute-force filter of all runs gives, newest first, on both backends.

The runs are made once per backend (two tasks, tags, keys, parents, pending and canceled runs
created at several times); Hypothesis draws the queries.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

import attrs
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from umt_backend_pg import migrate
from umt_sdk import Engine, RunInfo, connect
from umt_sdk.backend import NewRun, new_run_id
from umt_sdk.testing import FakeClock

TAG_VALUES = {"tenant": ["t1", "t2", "t3"], "region": ["eu", "us"]}
KEYS = [f"k{i}" for i in range(5)]


@attrs.define(repr=False)
class World:
    """An engine with its runs, on its own event loop (Hypothesis examples are sync)."""

    runner: asyncio.Runner
    engine: Engine
    runs: list[RunInfo]
    parents: list[uuid.UUID]

    def __repr__(self) -> str:
        return f"<World of {len(self.runs)} runs>"

    def times(self, field: str) -> list[datetime]:
        return sorted({getattr(r, field) for r in self.runs if getattr(r, field) is not None})


async def _populate(engine: Engine, advance: Any) -> tuple[list[RunInfo], list[uuid.UUID]]:
    rng = random.Random(16)
    parents: list[uuid.UUID] = []
    keys = iter(KEYS)
    for group in range(4):
        for i in range(12):
            tags = {
                name: rng.choice(values)
                for name, values in TAG_VALUES.items()
                if rng.random() < 0.6
            }
            key = next(keys, None) if rng.random() < 0.3 else None
            new = NewRun(
                run_id=new_run_id(),
                task_name=rng.choice(["prop.a", "prop.b"]),
                task_version=1,
                input_json=f'{{"n": {group * 100 + i}}}',
                input_hash=str(i),
                idempotency_key=key,
                delay=timedelta(days=1),
                parent_run_id=rng.choice(parents) if parents and rng.random() < 0.3 else None,
                tags=tags,
            )
            await engine.backend.enqueue(new)
            if group == 0 and i < 3:
                parents.append(new.run_id)
            if rng.random() < 0.4:
                await engine.cancel(new.run_id)
        await advance()
    page = await engine.list(limit=10_000)
    assert len(page) == 48
    assert page.next_cursor is None
    return list(page.runs), parents


def _memory_world() -> World:
    runner = asyncio.Runner()
    clock = FakeClock()

    async def advance() -> None:
        clock.advance(timedelta(seconds=1))

    async def make() -> World:
        engine = await connect("memory://", clock=clock)
        runs, parents = await _populate(engine, advance)
        return World(runner=runner, engine=engine, runs=runs, parents=parents)

    return runner.run(make())


@pytest.fixture(scope="module")
def memory_world() -> Iterator[World]:
    world = _memory_world()
    yield world
    world.runner.run(world.engine.close())
    world.runner.close()


@pytest.fixture(scope="module")
def pg_world(pg_url: str) -> Iterator[World]:
    runner = asyncio.Runner()
    schema = f"t_{uuid.uuid4().hex[:12]}"

    async def advance() -> None:
        await asyncio.sleep(0.02)

    async def make() -> World:
        await migrate(pg_url, schema=schema)
        engine = await connect(pg_url, schema=schema, run_migrations=False)
        runs, parents = await _populate(engine, advance)
        return World(runner=runner, engine=engine, runs=runs, parents=parents)

    world = runner.run(make())
    yield world
    runner.run(world.engine.close())
    runner.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@st.composite
def queries(draw: st.DrawFn) -> dict[str, Any]:
    """A query; times and parents are drawn as indexes, resolved against the world by
    `_resolve` (the strategy depends on nothing outside it)."""
    # Each filter in about one query of four, so that most queries match several runs and a
    # bound that is off by one run shows.
    query: dict[str, Any] = {}
    if draw(st.integers(0, 3)) == 0:
        query["task_name"] = draw(st.sampled_from(["prop.a", "prop.b", "prop.none"]))
    if draw(st.integers(0, 3)) == 0:
        query["status"] = draw(st.sampled_from(["pending", "canceled", "completed"]))
    if draw(st.integers(0, 3)) == 0:
        query["tags"] = draw(
            st.dictionaries(
                st.sampled_from(sorted(TAG_VALUES)),
                st.sampled_from(["t1", "t2", "t3", "eu", "us"]),
                min_size=1,
            )
        )
    if draw(st.integers(0, 3)) == 0:  # a key names a run of one task: it goes with one
        query["idempotency_key"] = draw(st.sampled_from([*KEYS, "k-none"]))
        query["task_name"] = draw(st.sampled_from(["prop.a", "prop.b"]))
    if draw(st.integers(0, 3)) == 0:
        query["parent"] = draw(st.integers(0, 2))
    for name in TIME_FILTERS:
        if draw(st.integers(0, 3)) == 0:
            query[name] = draw(st.integers(0, 100))
    query["limit"] = draw(st.integers(1, 7))
    return query


TIME_FILTERS = {
    "created_after": "created_at",
    "created_before": "created_at",
    "finished_after": "finished_at",
    "finished_before": "finished_at",
}


def _resolve(world: World, drawn: dict[str, Any]) -> dict[str, Any]:
    query = dict(drawn)
    if "parent" in query:
        query["parent"] = world.parents[query["parent"] % len(world.parents)]
    for name, field in TIME_FILTERS.items():
        if name in query:
            times = world.times(field)
            query[name] = times[query[name] % len(times)]
    return query


def _brute(runs: Sequence[RunInfo], query: dict[str, Any]) -> list[uuid.UUID]:
    def keep(r: RunInfo) -> bool:
        checks = [
            "task_name" not in query or r.task_name == query["task_name"],
            "status" not in query or r.status == query["status"],
            all(r.tags.get(k) == v for k, v in query.get("tags", {}).items()),
            "idempotency_key" not in query or r.idempotency_key == query["idempotency_key"],
            "parent" not in query or r.parent_run_id == query["parent"],
            "created_after" not in query or r.created_at >= query["created_after"],
            "created_before" not in query or r.created_at < query["created_before"],
            "finished_after" not in query
            or (r.finished_at is not None and r.finished_at >= query["finished_after"]),
            "finished_before" not in query
            or (r.finished_at is not None and r.finished_at < query["finished_before"]),
        ]
        return all(checks)

    return sorted((r.run_id for r in runs if keep(r)), reverse=True)


async def _paged(engine: Engine, query: dict[str, Any]) -> list[uuid.UUID]:
    found: list[uuid.UUID] = []
    cursor = None
    for _ in range(100):
        page = await engine.list(**query, before=cursor)
        assert len(page) <= query["limit"]
        found += [r.run_id for r in page]
        cursor = page.next_cursor
        if cursor is None:
            return found
    raise AssertionError("paging did not end")


def _check(world: World, drawn: dict[str, Any]) -> None:
    query = _resolve(world, drawn)
    expected = _brute(world.runs, query)
    assert world.runner.run(_paged(world.engine, query)) == expected, query


# A failing example's message lists dozens of run ids: long, and still the one to read.
LONG_REPR = pytest.mark.filterwarnings("ignore:Generating overly large repr")


@LONG_REPR
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=300)
@given(query=queries())
def test_memory_listing_equals_a_brute_force_filter(
    memory_world: World, query: dict[str, Any]
) -> None:
    _check(memory_world, query)


@LONG_REPR
@pytest.mark.backend("pg")
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=150)
@given(query=queries())
def test_pg_listing_equals_a_brute_force_filter(pg_world: World, query: dict[str, Any]) -> None:
    _check(pg_world, query)


def test_the_world_has_runs_of_every_kind(memory_world: World) -> None:
    """The property is only as good as its data: every filter matches some runs, not all."""
    runs = memory_world.runs
    assert {r.status for r in runs} == {"pending", "canceled"}
    assert any(r.parent_run_id for r in runs)
    assert any(r.idempotency_key for r in runs)
    assert any(r.tags.get("tenant") and r.tags.get("region") for r in runs)
    assert any(not r.tags for r in runs)
    assert len(memory_world.times("created_at")) == 4
