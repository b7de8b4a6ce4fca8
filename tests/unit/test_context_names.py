"""`ctx.canceled` is the one spelling; `ctx.cancelled` still works, with a DeprecationWarning."""

from __future__ import annotations

import pytest

from umt_sdk import Registry, TaskContext, connect, task


@task("names.spelling", version=1)
async def spelling(ctx: TaskContext[None]) -> list[bool]:
    with pytest.warns(DeprecationWarning, match=r"ctx\.cancelled is deprecated: use ctx\.canceled"):
        old = ctx.cancelled
    return [ctx.canceled, old]


async def test_canceled_and_its_deprecated_alias_agree() -> None:
    engine = await connect("memory://", registry=Registry([spelling]))
    try:
        handle = await engine.enqueue(spelling, None)
        async with engine.worker():
            assert await handle.result(timeout=10) == [False, False]
    finally:
        await engine.close()
