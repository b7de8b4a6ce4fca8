"""What the issue calls done: a newcomer runs `make demo`, then the `umt dashboard` command the
demo prints, and finds the killed worker's interrupted execution and the takeover on a run's
timeline, without reading any docs. The demo runs for real (its worker processes, the SIGKILL),
on the session's Postgres; the dashboard is the real `umt` command in a process of its own."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.browser.chromium import console_entries, console_errors
from tests.browser.served import free_port
from tests.browser.test_dashboard_browser import wait_until

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo" / "demo.py"
UMT = Path(sys.executable).parent / "umt"

pytestmark = pytest.mark.slow


@pytest.fixture
def demo_schema(pg_url: str) -> Iterator[str]:
    schema = f"demo_{uuid.uuid4().hex[:8]}"
    yield schema
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for name in (schema, f"{schema}_biz"):
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@contextlib.contextmanager
def dashboard_process(command: list[str], env: dict[str, str], logs: Path) -> Iterator[str]:
    """The printed command, run with `--port` of a free port; its URL once it answers."""
    port = free_port()
    out = (logs / "dashboard.log").open("wb")
    proc = subprocess.Popen(
        [*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            log = (logs / "dashboard.log").read_text(errors="replace")
            assert proc.poll() is None, f"umt dashboard exited ({proc.returncode}):\n{log}"
            assert time.monotonic() < deadline, f"umt dashboard did not listen:\n{log}"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        out.close()


def test_after_the_demo_the_dashboard_shows_the_killed_worker_and_the_takeover(
    pg_url: str, demo_schema: str, tmp_path: Path, browser: Any, shots: Callable[[str], Path]
) -> None:
    env = {**os.environ, "UMT_DATABASE_URL": pg_url}
    told = subprocess.run(
        [sys.executable, str(DEMO), "--schema", demo_schema],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
        cwd=tmp_path,
    )
    assert told.returncode == 0, f"the demo failed:\n{told.stdout}\n{told.stderr}"
    # The demo's last words are the command to run next.
    last = told.stdout.strip().splitlines()[-1]
    assert "see it in a browser: umt " in last, told.stdout
    printed = last.split("see it in a browser: ", 1)[1].split("  (", 1)[0]
    command = shlex.split(printed)
    assert command[0] == "umt"
    assert command[-1] == "dashboard", printed

    with dashboard_process([str(UMT), *command[1:]], env, tmp_path) as url:
        browser.get(url)  # the root: the runs page
        assert browser.find_element("tag name", "h1").text == "Runs"
        lost = browser.find_elements(
            "xpath", "//tbody[@id='runs-rows']/tr[.//*[contains(text(), 'lost')]]"
        )
        assert lost, "no run with a lost lease on the runs page:\n" + browser.page_source[:4000]
        shots("demo-runs")
        assert console_errors(console_entries(browser)) == []

        lost[0].find_element("css selector", "a[href*='/runs/']").click()
        timeline = wait_until(
            browser,
            lambda: browser.find_element("css selector", "table.timeline-table").text,
            what="the run's timeline",
        )
        lines = timeline.splitlines()
        interrupted = [line for line in lines if "INTERRUPTED" in line and "worker io-1" in line]
        assert interrupted, timeline
        takers = [
            line
            for line in lines
            if "worker " in line and "worker io-1" not in line and "INTERRUPTED" not in line
        ]
        assert takers, f"no execution by another worker after io-1's:\n{timeline}"
        status = browser.find_element("id", "run-status").text
        assert status in ("completed", "canceled"), status
        browser.set_window_size(1400, 1500)
        shots("demo-timeline")
        assert console_errors(console_entries(browser)) == []
