"""Check new code against the runs in flight before shipping it: export, then replay.

Run it: `python examples/10_replay_before_deploy.py`. It prints what happened and exits 0.

Yesterday's release runs `refund@1`: `lookup`, `approval` (a fact wait), `pay`. Some runs are
parked on their approval when a change comes in. A deploy pipeline exports their histories and
replays them against the new code, with no database and no side effects:

    umt runs export --task refund@1 --status pending,running,waiting > in-flight.jsonl
    umt replay --registry app.tasks:registry in-flight.jsonl    # exit 1: do not ship

Here the same in process: `Engine.export_history` and `umt_sdk.testing.Replayer`. Renaming a
step the runs already passed is caught, with a diff naming the position; a step appended at the
end passes (the runs just go on live into it); an incompatible change ships as `refund@2`.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from umt_sdk import NonDeterminismError, Registry, RunHistory, TaskContext, connect, task
from umt_sdk.testing import FakeClock, Replayer


async def lookup(order_id: str) -> dict[str, int]:
    return {"amount": 30}


async def pay(amount: int) -> str:
    return f"refunded {amount}"


async def notify(text: str) -> None:
    print(f"   (notify: {text})")


@task("refund", version=1)
async def refund(ctx: TaskContext[str]) -> str:
    order = await ctx.step.run("lookup", lookup, ctx.input)
    await ctx.step.wait_for_fact("approval")
    return await ctx.step.run("pay", pay, order["amount"])


# -- two candidate releases -------------------------------------------------------------------


@task("refund", version=1)  # renames a step the runs in flight already recorded: incompatible
async def refund_renamed(ctx: TaskContext[str]) -> str:
    order = await ctx.step.run("find-order", lookup, ctx.input)
    await ctx.step.wait_for_fact("approval")
    return await ctx.step.run("pay", pay, order["amount"])


@task("refund", version=1)  # adds a step at the end: the recorded runs replay, then go on
async def refund_with_notice(ctx: TaskContext[str]) -> str:
    order = await ctx.step.run("lookup", lookup, ctx.input)
    await ctx.step.wait_for_fact("approval")
    receipt = await ctx.step.run("pay", pay, order["amount"])
    await ctx.step.run("notify", notify, receipt)
    return receipt


async def record_runs() -> list[RunHistory]:
    """Yesterday's release: two refunds done, three parked on their approval; export them all."""
    engine = await connect(
        "memory://", registry=Registry([refund]), clock=FakeClock(auto_advance=True)
    )
    runs = [await engine.enqueue(refund, f"order-{n}") for n in range(5)]
    async with engine.worker(concurrency=5):
        for run in runs[:2]:
            await engine.signal(run.run_id, "approval", {"by": "support"})
            assert await run.result(timeout=5) == "refunded 30"
        for run in runs[2:]:  # parked on their approval
            info = await engine.get(run.run_id)
            while info.status != "waiting":
                await asyncio.sleep(0.01)
                info = await engine.get(run.run_id)
    histories = [await engine.export_history(run.run_id) for run in runs]
    await engine.close()
    return histories


async def check(histories: list[RunHistory]) -> None:
    """The deploy pipeline's check of two candidate releases."""
    print("2. the release that renames `lookup` to `find-order`:")
    results = await Replayer(Registry([refund_renamed])).replay_many(histories)
    assert not any(r.ok for r in results)
    error = results[0].error
    assert isinstance(error, NonDeterminismError)
    assert (error.position, error.recorded, error.current) == (
        1,
        "step 'lookup'",
        "step 'find-order'",
    )
    print("\n".join(f"   {line}" for line in str(error).splitlines()))
    print(f"   -> {len(results)} of {len(results)} runs no longer replay: do not ship it")

    print("3. the release that appends a `notify` step:")
    results = await Replayer(Registry([refund_with_notice])).replay_many(histories)
    assert all(r.ok for r in results), [r.summary() for r in results]
    for result in results[1:3]:
        print(f"   {result.summary()}")
    print(f"   -> all {len(results)} runs replay: ship it (no step body ran during the checks)")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "histories.jsonl"
        exported = asyncio.run(record_runs())
        # What `umt runs export` prints: one JSON object per line.
        path.write_text("".join(h.to_json() + "\n" for h in exported), encoding="utf-8")
        statuses = ", ".join(h.status for h in exported)
        print(f"1. exported {len(exported)} histories to {path.name} ({statuses})")
        histories = RunHistory.from_jsonl(path.read_text(encoding="utf-8"), source=path.name)
    asyncio.run(check(histories))


if __name__ == "__main__":
    main()
