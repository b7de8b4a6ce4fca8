"""Outcomes an operator settles: a step whose failure leaves its outcome unknown parks its run
in `needs_attention` instead of retrying (and maybe paying twice) or failing.

Run it: `python examples/24_needs_attention.py`. It prints what happened and exits 0.

A payout task sends money through a (pretend) bank API. When the bank does not answer in time,
the transfer may or may not have happened: the step declares `uncertain_on=(TimeoutError,)`,
so the run waits for a person instead of calling the bank again.

1. three payouts time out; `engine.list(needs_attention=True)` lists them, each naming the
   step to settle (`umt runs list --status needs_attention` on the command line);
2. the operator checks the bank's statement: payout p1 went through, so it is settled done
   with the bank's reference (the step is not run again, the run goes on); p2 did not, so it
   is settled not done (the step runs again); p3 is canceled (refunded by hand);
3. a settle that does not fit is refused and changes nothing;
4. the run's history keeps who settled what.

`FakeClock(auto_advance=True)` jumps virtual time forward whenever every run is blocked.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import attrs

from umt_sdk import Engine, Registry, RunInfo, TaskContext, UsageError, connect, step, task
from umt_sdk.testing import FakeClock

BANK_CALLS: Counter[str] = Counter()
"""How often the bank API was called per payout: the side effect that must not repeat."""


@attrs.frozen
class Payout:
    payout_id: str
    cents: int


@attrs.frozen
class Transfer:
    bank_ref: str
    cents: int


@step("transfer", uncertain_on=(TimeoutError,))
async def transfer(payout: Payout) -> Transfer:
    BANK_CALLS[payout.payout_id] += 1
    if BANK_CALLS[payout.payout_id] == 1:  # the bank is slow today: the first call times out
        raise TimeoutError("the bank did not answer within 30 s")
    return Transfer(bank_ref=f"bank-{payout.payout_id}", cents=payout.cents)


@step("notify")
async def notify(payout: Payout, bank_ref: str) -> str:
    return f"payout {payout.payout_id}: {payout.cents / 100:.2f} EUR sent ({bank_ref})"


@task("payout", version=1)
async def payout(ctx: TaskContext[Payout]) -> str:
    sent = await transfer(ctx.input)
    return await notify(ctx.input, sent.bank_ref)


async def _all_parked(engine: Engine, count: int) -> list[RunInfo]:
    """The runs needing attention, once there are `count` of them (a dashboard would poll)."""
    while True:
        page = await engine.list(needs_attention=True)
        if len(page) >= count:
            return list(page)
        await asyncio.sleep(0.01)


async def main() -> None:
    engine = await connect(
        "memory://", registry=Registry([payout]), clock=FakeClock(auto_advance=True)
    )
    async with engine.worker(concurrency=4) as worker:
        runs = {
            pid: await engine.enqueue(payout, Payout(pid, cents))
            for pid, cents in (("p1", 12_000), ("p2", 4_550), ("p3", 990))
        }
        # 1. Each transfer timed out: its run waits for a person, holding no worker slot.
        parked = await _all_parked(engine, 3)
        assert not worker.running_runs
        print("1. runs needing attention:")
        for listed in sorted(parked, key=lambda i: i.input["payout_id"]):
            info = await engine.get(listed.run_id)  # with its timeline
            step_view = next(v for v in info.timeline if v.name == info.needs_attention)
            error = step_view.error.message if step_view.error else ""
            print(
                f"   {info.input['payout_id']}: {info.display_status}, step "
                f"{info.needs_attention!r} ({error})"
            )

        # 2. The bank statement says p1 went through and p2 did not; p3 is refunded by hand.
        await engine.settle(
            runs["p1"].run_id,
            step="transfer",
            done=True,
            output={"bank_ref": "bank-stmt-8812", "cents": 12_000},
            by="ops:alice",
        )
        await engine.settle(runs["p2"].run_id, step="transfer", done=False, by="ops:alice")
        await engine.cancel(runs["p3"].run_id, reason="refunded by hand")
        print(f"2. p1: {await runs['p1'].result(timeout=5)}")
        print(f"   p2: {await runs['p2'].result(timeout=5)}")
        print(f"   p3: {(await engine.get(runs['p3'].run_id)).status}")
        assert BANK_CALLS == {"p1": 1, "p2": 2, "p3": 1}, BANK_CALLS
        print(f"   bank calls: {dict(BANK_CALLS)} (p1 never called again, p2 once more)")

        # 3. A settle that does not fit the run is refused, with nothing stored.
        refused = []
        for label in ("p1", "p3"):  # completed, canceled: nothing waits to be settled
            try:
                await engine.settle(runs[label].run_id, step="transfer", done=False)
            except UsageError as exc:
                refused.append(f"{label}: {str(exc).split(': ', 1)[1]}")
        print("3. refused:")
        for message in refused:
            print(f"   {message}")

    # 4. The history keeps the settlement and who made it.
    info = await engine.get(runs["p1"].run_id)
    print("4. p1's history:")
    for view in info.timeline:
        detail = ""
        if view.name.startswith("umt.attention:"):
            settled = json.loads(view.output_json or "null")["umt_settled"]
            detail = f"settled {settled['as']} by {settled['by']}"
        elif view.error is not None:
            detail = f"{view.error.type}: {view.error.message}"
        print(f"   {view.name:<24} {view.kind:<5} {view.status:<10} {detail}")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
