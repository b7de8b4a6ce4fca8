"""Callback tokens: a run hands a token to the outside world and waits, parked, for its answer.

Run it: `python examples/21_callbacks.py`. It prints what happened and exits 0.

1. a checkout asks a (pretend) payment provider to charge a card, giving it a callback token;
   the provider's webhook later calls `engine.complete_callback(token, payload)`, and the
   run, parked without a worker slot meanwhile, continues with the payload;
2. the provider retries its webhook: the second completion is refused (the first payload
   stays), and so are a forged token and a malformed one;
3. a provider that never answers: the token expires after its timeout (a day, in virtual
   time), the run gets `CallbackTimeoutError`, and a late webhook is refused as expired.

`FakeClock(auto_advance=True)` jumps virtual time forward whenever every run is blocked.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from umt_sdk import (
    CallbackTimeoutError,
    CallbackTokenError,
    Registry,
    TaskContext,
    connect,
    step,
    task,
)
from umt_sdk.testing import FakeClock

PROVIDER: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
"""The pretend payment provider's inbox: (callback token, amount) per charge request."""


@step("request-charge")
async def request_charge(token: str, amount: int) -> str:
    await PROVIDER.put((token, amount))  # a real provider gets an HTTPS call with the token
    return "requested"


@task("checkout", version=1)
async def checkout(ctx: TaskContext[int]) -> str:
    # A step: minted once, and a replay after the park gets the same token back.
    token = await ctx.step.callback_token("payment", timeout=timedelta(days=1))
    await request_charge(token, ctx.input)
    try:
        receipt: dict[str, Any] = await ctx.step.wait_for_callback(token)
    except CallbackTimeoutError:
        return "no answer from the provider: order canceled"
    return f"paid {receipt['amount']} (receipt {receipt['receipt']})"


async def main() -> None:
    clock = FakeClock(auto_advance=True)
    engine = await connect("memory://", registry=Registry([checkout]), clock=clock)
    async with engine.worker(concurrency=2) as worker:
        # 1. Charge, then the provider's webhook completes the callback.
        run = await engine.enqueue(checkout, 4200)
        token, amount = await PROVIDER.get()
        info = await engine.get(run.run_id)
        while info.status != "waiting" or worker.running_runs:  # parked: no slot held
            await asyncio.sleep(0.01)
            info = await engine.get(run.run_id)
        print(f"1. the provider got a token ({token[:14]}...) for {amount}; the run is parked")
        await engine.complete_callback(token, {"amount": amount, "receipt": "r-1"})
        print(f"   webhook completed it: {await run.result(timeout=5)}")

        # 2. A token completes once; forged and malformed ones change nothing.
        refused = []
        forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
        for label, attempt in (("again", token), ("forged", forged), ("malformed", "hello")):
            try:
                await engine.complete_callback(attempt, {"amount": 1, "receipt": "evil"})
            except CallbackTokenError as exc:
                refused.append(f"{label}: {exc.reason}")
        assert refused == ["again: completed", "forged: unknown", "malformed: malformed"]
        print(f"2. refused, nothing changed: {', '.join(refused)}")

        # 3. Nobody answers: the token expires after a (virtual) day.
        before = clock.now()
        run = await engine.enqueue(checkout, 999)
        late_token, _ = await PROVIDER.get()
        outcome = await run.result(timeout=5)
        assert outcome == "no answer from the provider: order canceled"
        print(f"3. after {clock.now() - before} of virtual time: {outcome}")
        late = "accepted"
        try:
            await engine.complete_callback(late_token, {"amount": 999, "receipt": "late"})
        except CallbackTokenError as exc:
            late = exc.reason
        assert late == "expired", late
        print("   the late webhook is refused: the token expired")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
