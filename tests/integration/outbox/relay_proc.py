"""A relay process for the outbox tests, started with `start_relay` (`_support.py` here).

    python -m tests.integration.outbox.relay_proc --business-url URL --engine-url URL
        --schema S --name r1 --workdir DIR [--mode auto|same_database|separate] [--batch N]
        [--pause-after K] [--concurrency C]

Routes `item` events to `process_item` through a mapper that appends the payload's `n` to
`<workdir>/<name>.calls` (one line per call, flushed), so the test can count how often each row
was routed.
With `--pause-after K` the mapper prints `PAUSED` after its K-th call and blocks, mid-batch
(mid-transaction), until the test SIGKILLs the process. Prints `READY <mode>` once the relay
detected its mode, and `DONE <created> <dispatched>` after SIGTERM (a graceful stop).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests._procs.worker import exit_when_orphaned, say, stop_on_sigterm
from tests.integration.outbox.tasks import process_item, registry
from umt_backend_pg import OutboxRelay
from umt_sdk import connect


async def main(args: argparse.Namespace) -> None:
    calls_path = Path(args.workdir) / f"{args.name}.calls"
    log = calls_path.open("a", buffering=1)
    calls = 0

    def mapper(payload: dict[str, Any]) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        log.write(f"{payload['n']}\n")
        if args.pause_after and calls == args.pause_after:
            say("PAUSED")
            time.sleep(3600)  # blocks the loop mid-transaction until SIGKILL
        return {"n": payload["n"]}

    engine = await connect(
        args.engine_url, registry=registry, schema=args.schema, run_migrations=False, max_size=4
    )
    relay = OutboxRelay(
        args.business_url,
        engine,
        {"item": (process_item, mapper)},
        schema=args.schema,
        batch_size=args.batch,
        mode=args.mode,
        concurrency=args.concurrency,
        poll_interval=timedelta(seconds=0.5),
    )
    orphan_watch = asyncio.create_task(exit_when_orphaned(os.getppid()))
    await relay.run_once()
    say("READY", "same" if relay.same_database else "separate")
    stop = stop_on_sigterm()
    async with relay:
        await stop.wait()
    say("DONE", relay.totals.created, relay.totals.dispatched)
    await engine.close()
    orphan_watch.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--business-url", required=True)
    parser.add_argument("--engine-url", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--pause-after", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
