"""A run reports its progress; a caller shows it live, then reads it back after the run.

Run it: `python examples/13_progress_stream.py` (the memory backend). On Postgres the same code
stores the values in `stream_entries`, and a follower in any other process is woken by LISTEN.

- `await ctx.stream.write("progress", {...})` appends a value to the run's `progress` stream,
  durably and in order; inside a step and between steps alike;
- `async for item in engine.stream(run_id, "progress")` gives what was written so far, then
  each new value as it is written, and ends when the run ends;
- `engine.stream_last(run_id, "progress")` is the newest value (a progress bar's need);
- the run sleeps durably halfway, so a second execution replays the first half: its writes
  find the values the first one stored, and nothing is written twice.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from attrs import frozen

from umt_sdk import Registry, TaskContext, connect, task


@frozen
class Import:
    rows: int
    batch: int


@task("import_rows", version=1)
async def import_rows(ctx: TaskContext[Import]) -> int:
    total, size = ctx.input.rows, ctx.input.batch
    await ctx.stream.write("progress", {"done": 0, "total": total})
    imported = 0
    for start in range(0, total, size):

        async def load(start: int = start) -> int:
            count = min(size, total - start)
            await asyncio.sleep(0.01)  # the real work: read a file, write a table...
            await ctx.stream.write("log", f"rows {start + 1}-{start + count}")
            return count

        imported += await ctx.step.run("batch", load)  # batch, batch#2, ...: one per call
        await ctx.stream.write("progress", {"done": imported, "total": total})
        if start == 0:
            await ctx.step.sleep("breathe", timedelta(milliseconds=50))  # a second execution
    return imported


def bar(done: int, total: int, width: int = 20) -> str:
    filled = width * done // total
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


async def main() -> None:
    registry = Registry([import_rows])
    async with await connect("memory://", registry=registry) as engine:
        handle = await engine.enqueue(import_rows, Import(rows=100, batch=25))
        async with engine.worker():
            async for item in engine.stream(handle.run_id, "progress"):  # live, until the end
                print(f"#{item.seq} {bar(item.value['done'], item.value['total'])}")
            print("imported", await handle.result(timeout=10), "rows")

        info = await engine.get(handle.run_id)
        log = [item.value async for item in engine.stream(handle.run_id, "log")]
        last = await engine.stream_last(handle.run_id, "progress")
        assert last is not None
        print(f"{len(info.executions)} executions; log: {', '.join(log)}")
        print(f"newest progress: #{last.seq} {last.value}: each value once, replay or not")


if __name__ == "__main__":
    asyncio.run(main())
