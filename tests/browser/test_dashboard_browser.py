"""The dashboard in a real headless Chromium, as an on-call engineer uses it, while real worker
processes run the demo's workload (examples/demo) on the session's Postgres.

The runs page shows a pending run turn completed without a reload; a worker SIGKILLed in the
middle of a step leaves an interrupted execution that another worker takes over, and the run's
timeline shows both; a run waiting for a fact is canceled with its button; a run is enqueued
from the form. No page logs a console error. Screenshots are kept as artifacts
(docs/testing.md, "The browser tests").
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from uuid import UUID

import attrs
import psycopg
import pytest
from psycopg import sql

from tests._procs.support import Process, Spawner, eventually
from tests.browser.chromium import console_entries, console_errors
from tests.browser.served import served
from umt_sdk import Engine, connect

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo"
WAIT = 60.0  # the longest any page is waited for (a lease of 2 s, polls of 2 s)

pytestmark = pytest.mark.slow


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The demo's tasks, as its workers serve them (the test process only enqueues them).
demo_tasks = _load("umt_demo_tasks", DEMO / "tasks.py")
_path = list(sys.path)
try:  # demo.py puts its folder first on sys.path; only its business tables are wanted
    BUSINESS_DDL: str = _load("umt_demo_driver", DEMO / "demo.py").BUSINESS_DDL
finally:
    sys.path[:] = _path


@attrs.define
class Demo:
    """The demo's database (the test's schema, and the business tables beside it), an engine
    on it for the test's own enqueues, and a spawner of the demo's worker processes."""

    url: str
    schema: str
    engine: Engine
    spawner: Spawner
    dashboard: str = ""

    async def worker(self, group: str, name: str) -> Process:
        """`examples/demo/worker.py URL SCHEMA GROUP NAME`, once it serves."""
        proc = self.spawner.run(
            "examples.demo.worker", self.url, self.schema, group, name, name=name
        )
        await proc.wait_for("ready", timeout=WAIT)
        return proc

    async def step_started(self, run_id: UUID, step: str, worker: str) -> None:
        """Until `worker` is inside the body of `step` of the run (the demo's step log)."""

        async def started() -> bool:
            async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
                cur = await conn.execute(
                    sql.SQL(
                        "SELECT 1 FROM {}.step_log WHERE run_id = %s AND step = %s "
                        "AND worker = %s AND finished_at IS NULL"
                    ).format(sql.Identifier(f"{self.schema}_biz")),
                    (run_id, step, worker),
                )
                return await cur.fetchone() is not None

        await eventually(started, timeout=WAIT, what=f"{worker} to start {step!r} of {run_id}")


@pytest.fixture
async def demo(
    pg_url: str, pg_schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Demo]:
    biz = sql.Identifier(f"{pg_schema}_biz")
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(sql.SQL(BUSINESS_DDL).format(biz=biz))  # type: ignore[arg-type]
    # A transfer step long enough for a kill to land inside it.
    monkeypatch.setenv("DEMO_TRANSFER_SECONDS", "4")
    engine = await connect(
        pg_url, registry=demo_tasks.registry, schema=pg_schema, run_migrations=False
    )
    try:
        with Spawner.under(tmp_path, url=pg_url, schema=pg_schema) as spawner:
            yield Demo(url=pg_url, schema=pg_schema, engine=engine, spawner=spawner)
    finally:
        await engine.close()
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(biz))


@pytest.fixture
def dashboard(demo: Demo) -> Iterator[str]:
    with served(demo.url, schema=demo.schema, registry=demo_tasks.registry) as url:
        demo.dashboard = url
        yield url


# -- reading the page ----------------------------------------------------------------------------


def wait_until(browser: Any, check: Callable[[], Any], *, what: str, timeout: float = WAIT) -> Any:
    """Poll `check()` (reading the page as it is now) until it gives something truthy."""
    from selenium.common.exceptions import WebDriverException

    deadline = time.monotonic() + timeout
    last: WebDriverException | None = None
    while True:
        try:
            value = check()
        except WebDriverException as exc:
            # The next page is not there yet (no such element, a node of the page being
            # left), or a live update replaced what was read (stale element): read again.
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout} s waiting for {what} (last error: {last!r}); "
                "the page shows:\n" + browser.find_element("tag name", "body").text[:3000]
            )
        time.sleep(0.1)


def row_status(browser: Any, run_id: UUID) -> str | None:
    """The status shown in the runs table for the run (None: not listed)."""
    rows = browser.find_elements(
        "xpath", f"//tbody[@id='runs-rows']/tr[.//a[contains(@href, '/runs/{run_id}')]]"
    )
    if not rows:
        return None
    return str(rows[0].find_element("css selector", ".status").text.strip())


STATUS_CELL = "//*[@id='run-status']/.."
"""A run's status with what it waits for, on its page."""


def no_console_errors(browser: Any, where: str) -> None:
    errors = console_errors(console_entries(browser))
    assert errors == [], f"console errors on {where}: {errors}"


def mark_page(browser: Any) -> None:
    """A value only this load of the page holds: gone after any reload or navigation."""
    browser.execute_script("window.umtLoadMarker = 'this load';")


def same_page(browser: Any) -> bool:
    return bool(browser.execute_script("return window.umtLoadMarker === 'this load';"))


# -- the tests -----------------------------------------------------------------------------------


async def test_runs_go_live_and_a_killed_workers_run_is_taken_over(
    demo: Demo, dashboard: str, browser: Any, shots: Callable[[str], Path]
) -> None:
    meta = await demo.engine.enqueue(demo_tasks.fetch_metadata, {"item": "meta-1"})
    download = await demo.engine.enqueue(demo_tasks.download, {"item": "ubuntu-1"})
    await demo.engine.signal(download.run_id, "approved", {"by": "alice"})  # before it waits

    browser.get(f"{dashboard}/runs")
    assert row_status(browser, meta.run_id) == "pending"
    assert row_status(browser, download.run_id) == "pending"
    mark_page(browser)
    shots("runs-pending")

    io = await demo.worker("io", "io-1")
    wait_until(
        browser,
        lambda: row_status(browser, meta.run_id) == "completed",
        what="the fetch_metadata run to show completed without a reload",
    )
    assert same_page(browser), "the runs page was reloaded: the status must change in place"

    # io-1 is killed inside the download's long transfer step; agent-1 takes the run over
    # once io-1's lease (2 s) has run out, and completes it (its approval came early).
    await demo.step_started(download.run_id, "transfer", "io-1")
    await asyncio.sleep(0.8)  # a heartbeat names the step the execution is in
    io.kill()  # SIGKILL
    await demo.worker("agent", "agent-1")
    # More of an ordinary day on the same page: summaries agent-1 completes, a download left
    # waiting for its approval, a fetch no live worker serves, and one canceled.
    summaries = [
        await demo.engine.enqueue(demo_tasks.summarize, {"item": f"report-{n}"}) for n in (1, 2)
    ]
    unapproved = await demo.engine.enqueue(demo_tasks.download, {"item": "ubuntu-2"})
    unserved = await demo.engine.enqueue(demo_tasks.fetch_metadata, {"item": "meta-2"})
    dropped = await demo.engine.enqueue(demo_tasks.fetch_metadata, {"item": "meta-3"})
    await demo.engine.cancel(dropped.run_id, reason="not needed")
    expected = {
        download.run_id: "completed",
        unapproved.run_id: "waiting",
        unserved.run_id: "pending",
        dropped.run_id: "canceled",
        **{s.run_id: "completed" for s in summaries},
    }
    wait_until(
        browser,
        lambda: all(row_status(browser, r) == want for r, want in expected.items()),
        what="the download taken over by agent-1 to show completed, and the others their ends",
    )
    assert same_page(browser), "the runs page was reloaded: new runs must appear in place"
    browser.set_window_size(1400, 640)  # the rows, not the empty page below them
    shots("runs")
    no_console_errors(browser, "the runs page")

    browser.find_element("css selector", f"a[href$='/runs/{download.run_id}']").click()
    wait_until(
        browser,
        lambda: str(download.run_id) in browser.find_element("tag name", "h1").text,
        what="the run's page",
    )
    info = await demo.engine.get(download.run_id)
    executions = [(e.worker_id, e.outcome) for e in info.executions]
    assert executions[0] == ("io-1", "interrupted"), executions
    assert {worker for worker, _ in executions[1:]} == {"agent-1"}, executions
    assert executions[-1][1] == "completed", executions
    page = browser.find_element("tag name", "body").text
    for shown in ("transfer", "cool-down", "approved", "agent-1"):
        assert shown in page, f"{shown!r} not on the run's page:\n{page}"
    # The killed worker's execution is plainly marked, with its worker and fencing token.
    killed = [line for line in page.splitlines() if "io-1" in line]
    assert killed, page
    assert any(
        "interrupted" in line.lower() and str(info.executions[0].fencing_token) in line
        for line in killed
    ), killed
    browser.set_window_size(1400, 1500)
    shots("run-timeline")
    no_console_errors(browser, "the run's page")


async def test_a_waiting_run_is_canceled_from_its_page(
    demo: Demo, dashboard: str, browser: Any, shots: Callable[[str], Path]
) -> None:
    await demo.worker("agent", "agent-1")
    waiting = await demo.engine.enqueue(demo_tasks.download, {"item": "ubuntu-2"})  # no approval
    browser.get(f"{dashboard}/runs/{waiting.run_id}")
    mark_page(browser)
    wait_until(
        browser,
        lambda: "waiting" in browser.find_element("id", "run-status").text,
        what="the run's page to show it waiting for its approval",
    )
    assert same_page(browser), "the run's page was reloaded: its status must change in place"
    shots("run-waiting")
    no_console_errors(browser, "the waiting run's page")

    browser.find_element("name", "reason").send_keys("no approval coming")
    browser.find_element("xpath", "//button[normalize-space()='Cancel run']").click()
    wait_until(
        browser,
        lambda: "canceled" in browser.find_element("id", "run-status").text,
        what="the run's page to show it canceled",
    )
    info = await demo.engine.get(waiting.run_id)
    assert info.status == "canceled"
    wait_until(
        browser,
        lambda: "no approval coming" in browser.find_element("tag name", "body").text,
        what="the cancel's reason on the run's page",
    )
    shots("run-canceled")
    no_console_errors(browser, "the canceled run's page")


HOSTILE = '"><img src=x onerror="window.umtPwned=1"><script>window.umtPwned=1</script>\x07'


async def test_hostile_values_show_as_text(
    demo: Demo, dashboard: str, browser: Any, shots: Callable[[str], Path]
) -> None:
    hostile = await demo.engine.enqueue(demo_tasks.download, {"item": HOSTILE})
    await demo.engine.signal(hostile.run_id, "approved", {"by": HOSTILE})
    for page in (f"{dashboard}/runs", f"{dashboard}/runs/{hostile.run_id}"):
        browser.get(page)
        wait_until(browser, lambda: "umtPwned" in browser.page_source, what="the value shown")
        await asyncio.sleep(0.5)  # let an injected handler run, if any got through
        assert browser.execute_script("return window.umtPwned === undefined;"), page
        assert not browser.find_elements("css selector", "img[src='x']"), page
        assert "<script>window.umtPwned=1</script>" in browser.find_element(
            "tag name", "body"
        ).text.replace("\\u0007", ""), page
        no_console_errors(browser, page)
    shots("hostile")


async def test_a_fact_from_the_page_finishes_a_run_and_a_retry_links_to_it(
    demo: Demo, dashboard: str, browser: Any, shots: Callable[[str], Path]
) -> None:
    await demo.worker("agent", "agent-1")
    waiting = await demo.engine.enqueue(demo_tasks.download, {"item": "ubuntu-3"})
    browser.get(f"{dashboard}/runs/{waiting.run_id}")
    wait_until(  # past its durable sleep (also "waiting"), at the wait for its approval
        browser,
        lambda: "for fact approved" in browser.find_element("xpath", STATUS_CELL).text,
        what="the run to wait for its approval",
    )

    # The actions are drawn with the page (a live refresh would clobber what is typed), so
    # the fact's name is filled in once the page is loaded while the run waits (opened anew:
    # a reload would restore the empty field the browser had).
    browser.get(f"{dashboard}/runs/{waiting.run_id}")
    # A payload that is not JSON: shown next to its field, nothing stored.
    fact_form = "//form[contains(@action, '/signal')]"
    assert (
        browser.find_element("xpath", f"{fact_form}//input[@name='name']").get_attribute("value")
        == "approved"
    ), "the fact's name defaults to the one the run waits for"
    payload = browser.find_element("xpath", f"{fact_form}//textarea[@name='payload']")
    payload.clear()
    payload.send_keys('{"by": carol}')
    browser.find_element("xpath", f"{fact_form}//button").click()
    error = wait_until(
        browser,
        lambda: browser.find_elements("css selector", ".field-error"),
        what="the payload's error next to its field",
    )
    assert "payload" in error[0].find_element("xpath", "./..").text.lower(), error[0].text
    shots("fact-invalid")
    # The refused form comes back as 400, which the console reports; nothing else may.
    refused = console_errors(console_entries(browser))
    assert [(e.source, "/signal" in e.message, "400" in e.message) for e in refused] == [
        ("network", True, True)
    ], refused
    info = await demo.engine.get(waiting.run_id)
    assert info.status == "waiting"
    assert info.waiting_for == "approved"

    payload = browser.find_element("css selector", "textarea[name='payload']")
    payload.clear()
    payload.send_keys('{"by": "carol"}')
    browser.find_element("xpath", "//button[normalize-space()='Send fact']").click()
    wait_until(
        browser,
        lambda: "stored" in browser.find_element("tag name", "body").text,
        what="the notice that the fact was stored",
    )
    mark_page(browser)
    wait_until(
        browser,
        lambda: "completed" in browser.find_element("id", "run-status").text,
        what="the approved run to complete",
    )
    assert same_page(browser), "the run's page was reloaded: its status must change in place"
    assert (await demo.engine.get(waiting.run_id)).output is not None
    no_console_errors(browser, "the approved run's page")

    # A finished run offers "Retry as a new run": same input, linked back to this one.
    browser.get(f"{dashboard}/runs/{waiting.run_id}")  # actions are drawn with the page
    browser.find_element("xpath", "//button[normalize-space()='Retry as a new run']").click()
    wait_until(
        browser,
        lambda: (
            f"/runs/{waiting.run_id}"
            in (
                browser.find_element(
                    "xpath", "//dt[normalize-space()='Retry of']/following-sibling::dd[1]/a"
                ).get_attribute("href")
                or ""
            )
        ),
        what="the new run's page, linked to the original",
    )
    assert str(waiting.run_id) not in browser.find_element("tag name", "h1").text
    shots("retried")
    no_console_errors(browser, "the retried run's page")


async def test_every_waiting_run_of_a_filter_is_canceled_after_a_count(
    demo: Demo, dashboard: str, browser: Any, shots: Callable[[str], Path]
) -> None:
    await demo.worker("agent", "agent-1")
    runs = [
        await demo.engine.enqueue(demo_tasks.download, {"item": f"batch-{n}"}) for n in range(3)
    ]
    kept = await demo.engine.enqueue(demo_tasks.summarize, {"item": "keep me"})
    browser.get(f"{dashboard}/runs?task=download%401")
    wait_until(
        browser,
        lambda: all(row_status(browser, r.run_id) == "waiting" for r in runs),
        what="the three downloads to wait for their approvals",
    )
    browser.find_element("partial link text", "Cancel all unfinished runs matching").click()
    count = wait_until(
        browser, lambda: browser.find_element("id", "match-count").text, what="the count"
    )
    assert count == "3"
    shots("cancel-matching")
    browser.find_element("xpath", "//button[contains(., 'Yes, cancel 3 run')]").click()
    wait_until(
        browser,
        lambda: "3 canceled" in browser.find_element("tag name", "body").text,
        what="the notice of the bulk cancel",
    )
    for run in runs:
        assert (await demo.engine.get(run.run_id)).status == "canceled"
    assert (await demo.engine.get(kept.run_id)).status != "canceled"
    no_console_errors(browser, "the runs page after the bulk cancel")


async def test_a_run_enqueued_from_the_form_runs(
    demo: Demo, dashboard: str, browser: Any, shots: Callable[[str], Path]
) -> None:
    await demo.worker("agent", "agent-1")
    browser.get(f"{dashboard}/tasks")
    browser.find_element("css selector", "a[href$='/tasks/summarize/1/enqueue']").click()
    wait_until(
        browser,
        lambda: "summarize@1" in browser.find_element("tag name", "h1").text,
        what="the enqueue form of summarize@1",
    )
    item = browser.find_element("name", "field.item")

    # An empty required field: the error beside it, nothing stored.
    browser.find_element("xpath", "//button[normalize-space()='Enqueue']").click()
    error = wait_until(
        browser,
        lambda: browser.find_elements("id", "error-item"),
        what="the error beside the empty field",
    )
    assert error[0].text == "required"
    shots("enqueue-invalid")
    refused = console_errors(console_entries(browser))
    assert [(e.source, "400" in e.message) for e in refused] == [("network", True)], refused
    assert (await demo.engine.list(task_name="summarize")).runs == ()

    item = browser.find_element("name", "field.item")
    item.send_keys("from the form")
    browser.find_element("xpath", "//button[normalize-space()='Enqueue']").click()
    wait_until(
        browser,
        lambda: "enqueued" in browser.find_element("tag name", "body").text,
        what="the new run's page with its notice",
    )
    mark_page(browser)
    wait_until(
        browser,
        lambda: "completed" in browser.find_element("id", "run-status").text,
        what="the run enqueued from the form to complete",
    )
    assert same_page(browser)
    (run,) = (await demo.engine.list(task_name="summarize")).runs
    assert run.status == "completed"
    assert str(run.run_id) in browser.find_element("tag name", "h1").text
    assert '"from the form"' in browser.find_element("tag name", "body").text
    shots("enqueued")
    no_console_errors(browser, "the enqueued run's page")

    browser.get(f"{dashboard}/workers")
    assert "agent-1" in browser.find_element("tag name", "body").text
    shots("workers")
    no_console_errors(browser, "the workers page")
    browser.get(f"{dashboard}/tasks")
    assert "summarize" in browser.find_element("tag name", "body").text
    shots("tasks")
    no_console_errors(browser, "the tasks page")


async def test_with_a_token_the_browser_logs_in_once_and_acts(
    demo: Demo, browser: Any, shots: Callable[[str], Path]
) -> None:
    token = "correct horse battery staple"
    pending = await demo.engine.enqueue(demo_tasks.fetch_metadata, {"item": "locked"})
    with served(
        demo.url, schema=demo.schema, registry=demo_tasks.registry, token=token
    ) as dashboard:
        browser.get(f"{dashboard}/runs/{pending.run_id}")
        assert "/login" in browser.current_url
        assert browser.find_element("tag name", "h1").text == "Access token"
        browser.find_element("name", "token").send_keys("not the token")
        browser.find_element("xpath", "//button[normalize-space()='Log in']").click()
        wait_until(
            browser,
            lambda: "That is not the token." in browser.find_element("tag name", "body").text,
            what="the wrong token refused",
        )
        # The refused login answers 401, which the console reports; nothing else may.
        refused = console_errors(console_entries(browser))
        assert [(e.source, "401" in e.message) for e in refused] == [("network", True)], refused

        browser.find_element("name", "token").send_keys(token)
        browser.find_element("xpath", "//button[normalize-space()='Log in']").click()
        wait_until(
            browser,
            lambda: str(pending.run_id) in browser.find_element("tag name", "h1").text,
            what="the run's page the login was asked for",
        )
        # The cookies a real browser keeps (token, CSRF) carry an action through.
        browser.find_element("xpath", "//button[normalize-space()='Cancel run']").click()
        wait_until(
            browser,
            lambda: "canceled" in browser.find_element("id", "run-status").text,
            what="the run canceled by the logged-in browser",
        )
        assert (await demo.engine.get(pending.run_id)).status == "canceled"
        no_console_errors(browser, "the dashboard behind its token")
