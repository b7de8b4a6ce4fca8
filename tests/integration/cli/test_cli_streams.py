"""`umt runs watch` shows each run's newest `progress` value; `umt runs show` lists a run's
streams (text and JSON)."""

from __future__ import annotations

import asyncio
import json

from tests.integration.cli.test_cli import Umt
from umt_sdk import Registry, TaskContext, connect, task


@task("cli.streams", version=1)
async def report(ctx: TaskContext[int]) -> int:
    """Writes `progress` up to 3 of 4 (it stops early: 75%) and one `log` line."""
    for done in range(1, 4):
        await ctx.stream.write("progress", {"done": done, "total": 4})
    await ctx.stream.write("log", "stopped early")
    return ctx.input


def _finished_run(umt: Umt) -> str:
    async def go() -> str:
        engine = await connect(umt.url, registry=Registry([report]), schema=umt.schema)
        async with engine:
            handle = await engine.enqueue(report, 7)
            async with engine.worker():
                assert await handle.result(timeout=30) == 7
            return str(handle.run_id)

    return asyncio.run(go())


def test_runs_watch_shows_the_progress_of_each_run(umt: Umt) -> None:
    streaming = _finished_run(umt)
    quiet = umt.enqueue("greet", {"name": "Ada"})
    out = umt.ok("runs", "watch", "--iterations", "1").stdout
    header = out.splitlines()[1]
    at, end = header.index("PROGRESS"), header.index("NOTE")
    progress = {line[:36]: line[at:end].strip() for line in out.splitlines()[2:] if line}
    assert progress[streaming] == "3/4 75%", out
    assert progress[quiet] == "-", out


def test_runs_show_lists_the_streams_of_a_run(umt: Umt) -> None:
    run_id = _finished_run(umt)
    text = umt.ok("runs", "show", run_id).stdout
    streams = text.split("\nstreams:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert streams[0].split() == ["STREAM", "VALUES", "LAST", "WRITTEN", "LAST", "VALUE"]
    assert streams[1].split()[:2] == ["log", "1"]
    assert streams[1].endswith("stopped early")
    assert streams[2].split()[:2] == ["progress", "3"]
    assert streams[2].endswith("3/4 75%")
    data = json.loads(umt.ok("runs", "show", run_id, "--json").stdout)
    assert data["streams"]["progress"]["values"] == 3
    assert data["streams"]["progress"]["last"] == {"done": 3, "total": 4}
    assert data["streams"]["log"]["last"] == "stopped early"
    one = umt.ok("runs", "watch", run_id, "--iterations", "1").stdout
    assert "streams:" in one
    quiet = umt.enqueue("greet", {"name": "Ada"})
    assert "streams:" not in umt.ok("runs", "show", quiet).stdout
    assert json.loads(umt.ok("runs", "show", quiet, "--json").stdout)["streams"] == {}
