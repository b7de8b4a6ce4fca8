"""One demo worker process: `python worker.py URL SCHEMA GROUP NAME [--otel console]`."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


async def main(url: str, schema: str, group: str, name: str, otel: str | None) -> None:
    os.environ["DEMO_WORKER"] = name
    os.environ["DEMO_URL"] = url
    os.environ["DEMO_BIZ"] = f"{schema}_biz"
    from tasks import GROUPS, registry

    from umt_sdk import connect

    provider = None
    if otel:
        from telemetry import tracer_provider

        provider = tracer_provider(otel, f"umt-demo-worker-{name}")
    engine = await connect(
        url, registry=registry, schema=schema, run_migrations=False, tracer_provider=provider
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with engine.worker(
        versions=GROUPS[group],
        concurrency=4,
        lease=timedelta(seconds=2),
        worker_id=name,
        poll_interval=timedelta(milliseconds=500),
        shutdown_grace=timedelta(seconds=3),
    ):
        print(f"ready {name}", flush=True)
        await stop.wait()
    await engine.close()
    if provider is not None:
        provider.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    otel = args[args.index("--otel") + 1] if "--otel" in args else None
    asyncio.run(main(args[0], args[1], args[2], args[3], otel))
