"""A run in needs_attention settled from its page in a real headless Chromium: the form
refuses an output of the wrong type beside its field (nothing stored), then settles the step
as done with the right one, and the run completes with that output, its step not run again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from tests.browser.chromium import console_entries, console_errors
from tests.browser.served import served
from tests.browser.test_dashboard_browser import no_console_errors, wait_until
from umt_sdk import Engine, Registry, TaskContext, connect, task

pytestmark = pytest.mark.slow

CALLS: list[str] = []


async def _lost_reply(sku: str) -> int:
    CALLS.append(sku)
    raise TimeoutError("no reply from the warehouse")


@task("browser.reserve", version=1)
async def reserve(ctx: TaskContext[str]) -> int:
    count: int = await ctx.step.run(
        "reserve-stock", _lost_reply, ctx.input, uncertain_on=(TimeoutError,)
    )
    return count


REGISTRY = Registry([reserve])


async def _needs_attention(engine: Engine, run_id: UUID) -> None:
    for _ in range(3000):
        if (await engine.get(run_id)).needs_attention == "reserve-stock":
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"run {run_id} never needed attention")


async def test_a_run_needing_attention_is_settled_from_its_page(
    pg_url: str, pg_schema: str, browser: Any, shots: Callable[[str], Path]
) -> None:
    engine = await connect(pg_url, registry=REGISTRY, schema=pg_schema, run_migrations=False)
    try:
        run = await engine.enqueue(reserve, "sku-9")
        async with engine.worker():
            await _needs_attention(engine, run.run_id)
            assert CALLS == ["sku-9"]
            with served(pg_url, schema=pg_schema, registry=REGISTRY) as dashboard:
                browser.get(f"{dashboard}/runs/{run.run_id}")
                form = "//form[contains(@action, '/settle')]"
                wait_until(
                    browser,
                    lambda: browser.find_elements("xpath", form),
                    what="the settle form on the run's page",
                )
                assert "needs_attention" in browser.find_element("id", "run-status").text
                shots("needs-attention")

                # An output that is not the step's type (int): refused beside its field.
                browser.find_element("xpath", f"{form}//input[@value='done']").click()
                browser.find_element("xpath", f"{form}//textarea[@name='output']").send_keys(
                    '"twelve"'
                )
                browser.find_element("xpath", f"{form}//input[@name='by']").send_keys("dana")
                browser.find_element("xpath", f"{form}//button").click()
                error = wait_until(
                    browser,
                    lambda: browser.find_elements("css selector", ".field-error"),
                    what="the output's error beside its field",
                )
                assert "output type" in error[0].text, error[0].text
                shots("settle-invalid")
                refused = console_errors(console_entries(browser))
                assert [
                    (e.source, "/settle" in e.message, "400" in e.message) for e in refused
                ] == [("network", True, True)], refused
                assert (await engine.get(run.run_id)).needs_attention == "reserve-stock"

                # The form comes back as it was sent: correct the output and settle.
                output = browser.find_element("xpath", f"{form}//textarea[@name='output']")
                output.clear()
                output.send_keys("12")
                browser.find_element("xpath", "//button[normalize-space()='Settle step']").click()
                wait_until(
                    browser,
                    lambda: (
                        "as done: the run goes on (by dana)"
                        in browser.find_element("tag name", "body").text
                    ),
                    what="the notice that the step was settled",
                )
                assert await run.result(timeout=30) == 12
                browser.get(f"{dashboard}/runs/{run.run_id}")
                wait_until(
                    browser,
                    lambda: "completed" in browser.find_element("id", "run-status").text,
                    what="the settled run to show completed",
                )
                assert not browser.find_elements("xpath", form), "nothing left to settle"
                shots("settled")
                no_console_errors(browser, "the settled run's page")
        assert CALLS == ["sku-9"], "settled as done: the step did not run again"
    finally:
        await engine.close()
