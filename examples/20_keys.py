"""Keys that shape the flow: singletons, debounce and per-key FIFO, decided at `enqueue`.

Run it: `python examples/20_keys.py` (the memory backend and its virtual clock; on Postgres the
same calls are serialized per key in the database, across every process and host).

- `singleton=Singleton("mailbox:acme")`: a mailbox sync is triggered by every webhook, but one
  sync at a time is enough: triggers while one is active return its handle (`created=False`);
- `singleton=Singleton("preview:main", mode="replace")`: a preview build of the newest commit
  cancels the build of the previous one, and starts once it has stopped;
- `debounce=Debounce("doc:42", period=..., max_wait=...)`: a burst of edits reindexes the
  document once, with the last text, a period after the last edit and never later than
  `max_wait` after the first (shown on the virtual clock);
- `sequence="account:7"`: an account's ledger entries are applied one at a time, in the order
  they were enqueued, while another account's go on in parallel.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from attrs import frozen

from umt_sdk import (
    Debounce,
    Registry,
    RunCanceledError,
    Singleton,
    TaskContext,
    connect,
    task,
)
from umt_sdk.testing import FakeClock


@frozen
class Mailbox:
    tenant: str
    webhook: int


synced: list[str] = []


@task("sync_mailbox", version=1)
async def sync_mailbox(ctx: TaskContext[Mailbox]) -> str:
    def fetch() -> None:
        synced.append(f"{ctx.input.tenant} (webhook {ctx.input.webhook})")

    await ctx.step.run("fetch", fetch)
    return f"synced {ctx.input.tenant} for webhook {ctx.input.webhook}"


@frozen
class Commit:
    sha: str


building = asyncio.Event()
"""Set while a preview build is inside its long step."""


@task("build_preview", version=1)
async def build_preview(ctx: TaskContext[Commit]) -> str:
    async def build() -> None:
        building.set()
        if ctx.input.sha == "a1":  # the old commit's build is slow: it is replaced meanwhile
            await ctx.abort_event.wait()
        ctx.throw_if_canceled()

    await ctx.step.run("build", build)
    return f"preview of {ctx.input.sha}"


@frozen
class Edit:
    doc: int
    text: str


@task("reindex", version=1)
async def reindex(ctx: TaskContext[Edit]) -> str:
    return f"doc {ctx.input.doc} indexed with {ctx.input.text!r}"


@frozen
class Entry:
    account: int
    amount: int


applied: list[tuple[int, int]] = []


@task("apply_entry", version=1)
async def apply_entry(ctx: TaskContext[Entry]) -> int:
    async def apply() -> None:
        applied.append((ctx.input.account, ctx.input.amount))
        await asyncio.sleep(0.01)

    await ctx.step.run("apply", apply)
    return ctx.input.amount


async def singletons() -> None:
    registry = Registry([sync_mailbox, build_preview])
    async with await connect("memory://", registry=registry) as engine:
        key = Singleton("mailbox:acme")
        handles = [
            await engine.enqueue(sync_mailbox, Mailbox("acme", i), singleton=key) for i in range(4)
        ]
        print("webhooks -> runs created:", [h.created for h in handles])
        assert len({h.run_id for h in handles}) == 1
        async with engine.worker():
            print(await handles[-1].result(timeout=10))
            again = await engine.enqueue(sync_mailbox, Mailbox("acme", 4), singleton=key)
            print("after the sync ended, a webhook starts a new one:", again.created)
            await again.result(timeout=10)

            replace = Singleton("preview:main", mode="replace")
            old = await engine.enqueue(build_preview, Commit("a1"), singleton=replace)
            await asyncio.wait_for(building.wait(), timeout=10)
            new = await engine.enqueue(build_preview, Commit("b2"), singleton=replace)
            try:
                await old.result(timeout=10)
            except RunCanceledError as error:
                print("old build:", error.reason)
            print("new build:", await new.result(timeout=10))
        print("mailbox syncs that ran:", synced)


async def debounce() -> None:
    clock = FakeClock()
    start = clock.now()
    async with await connect("memory://", registry=Registry([reindex]), clock=clock) as engine:
        edits = Debounce("doc:42", period=timedelta(seconds=30), max_wait=timedelta(minutes=2))
        handles = []
        for n in range(6):  # an edit every 20 seconds: each within the period of the last
            handles.append(await engine.enqueue(reindex, Edit(42, f"draft {n}"), debounce=edits))
            clock.advance(timedelta(seconds=20))  # 100 s after the first, the last edit
        print("edits -> runs created:", [h.created for h in handles])
        info = await engine.get(handles[0].run_id)
        assert info.available_at is not None
        assert info.available_at - start == timedelta(minutes=2)
        print(
            "the reindex starts at",
            f"+{(info.available_at - start).total_seconds():g}s",
            "(max_wait after the first edit, not 30 s after the last)",
        )
        clock.advance(max(info.available_at - clock.now(), timedelta(0)))
        async with engine.worker():
            print(await handles[-1].result(timeout=10))


async def sequences() -> None:
    async with await connect("memory://", registry=Registry([apply_entry])) as engine:
        handles = [
            await engine.enqueue(apply_entry, Entry(account, amount), sequence=f"account:{account}")
            for amount in (100, -30, 45, -10)
            for account in (7, 8)
        ]
        async with engine.worker(concurrency=8):
            for handle in handles:
                await handle.result(timeout=10)
        for account in (7, 8):
            order = [amount for acct, amount in applied if acct == account]
            print(f"account {account} applied in order:", order)
            assert order == [100, -30, 45, -10]


async def main() -> None:
    await singletons()
    await debounce()
    await sequences()


if __name__ == "__main__":
    asyncio.run(main())
