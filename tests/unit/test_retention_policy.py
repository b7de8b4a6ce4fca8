"""What decides retention before any store is asked: `@task(retention=)`, the policy built
from a registry, and the options of `connect` and `engine.worker`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import Registry, TaskContext, UsageError, connect, task
from umt_sdk._retention import RetentionPolicy, check_tags
from umt_sdk.exceptions import TaskDefinitionError
from umt_sdk.testing import FakeClock


@task("policy.kept", version=1, retention=timedelta(days=7))
async def kept_v1(ctx: TaskContext[int]) -> int:
    return ctx.input


@task("policy.kept", version=2, retention=timedelta(days=30))
async def kept_v2(ctx: TaskContext[int]) -> int:
    return ctx.input


@task("policy.plain", version=1)
async def plain(ctx: TaskContext[int]) -> int:
    return ctx.input


@pytest.mark.parametrize(
    "bad", [timedelta(0), timedelta(days=-1), 30, "30d", timedelta(days=40_000)], ids=repr
)
def test_a_task_retention_must_be_a_positive_timedelta(bad: Any) -> None:
    with pytest.raises(TaskDefinitionError, match="retention must be a timedelta > 0") as caught:
        task("policy.bad", retention=bad)
    assert caught.value.argument == "retention"


def test_the_longest_retention_of_a_task_s_versions_applies() -> None:
    policy = RetentionPolicy.build(
        Registry([kept_v1, kept_v2, plain]), default=timedelta(days=3), idempotency=None
    )
    assert policy.per_task == {"policy.kept": timedelta(days=30)}
    assert policy.default == timedelta(days=3)
    assert policy.active
    assert not RetentionPolicy.build(Registry([plain]), default=None, idempotency=None).active


async def test_connect_and_worker_refuse_bad_retention_options() -> None:
    for argument in ("retention", "idempotency_retention"):
        for bad in (timedelta(0), 30, "30d"):
            with pytest.raises(UsageError, match=argument) as caught:
                await connect("memory://", clock=FakeClock(), **{argument: bad})
            assert caught.value.argument == argument
    engine = await connect("memory://", registry=Registry([plain]), clock=FakeClock())
    async with engine:
        with pytest.raises(UsageError, match="prune_interval"):
            engine.worker(prune_interval=timedelta(0))
        assert engine.worker().pruner is None, "no retention: workers delete nothing"
    retained = await connect(
        "memory://", registry=Registry([kept_v2]), clock=FakeClock()
    )  # a task's own retention is enough for the workers to prune
    async with retained:
        assert retained.worker().pruner is not None


def test_tags_are_checked_and_copied() -> None:
    given = {"tenant": "t7"}
    checked = check_tags(given)
    assert checked == given
    assert checked is not given
    assert check_tags(None) == {}
    with pytest.raises(UsageError, match=r"tags takes at most 16 tags, got 17"):
        check_tags({f"k{i}": "v" for i in range(17)})
    with pytest.raises(UsageError, match="convert numbers with str"):
        check_tags({"tenant": 7})
