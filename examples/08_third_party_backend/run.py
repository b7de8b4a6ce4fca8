"""Using a third-party backend plugin without installing it: `connect(url, plugins=[module])`.

Run it: `python examples/08_third_party_backend/run.py`. It prints what happened and exits 0.

The plugin (umt_dict_backend.py, next to this file) serves `dict://NAME`: every connect to the
same name shares one in-process store. Here a producer engine enqueues and a separate worker
engine executes, like an API process and a worker process would on a shared database.
Installed with `pip install ./examples/08_third_party_backend`, `plugins=` would not be needed:
umt finds backends through the `umt` entry-point group.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from umt_sdk import Registry, TaskContext, connect, task
from umt_sdk.exceptions import BackendNotFoundError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the plugin is not installed
import umt_dict_backend


@task("shout", version=1)
async def shout(ctx: TaskContext[str]) -> str:
    return ctx.input.upper() + "!"


async def main() -> None:
    registry = Registry([shout])
    try:  # without the plugin, no backend serves dict://, and the error says what exists
        await connect("dict://shop", registry=registry)
        raise AssertionError("dict:// must need its plugin")
    except BackendNotFoundError as exc:
        print(f"without the plugin: {exc}")

    producer = await connect("dict://shop", registry=registry, plugins=[umt_dict_backend])
    worker_side = await connect("dict://shop", registry=registry, plugins=[umt_dict_backend])
    print(f"two engines on dict://shop: {type(producer.backend).__name__} handles, one store")

    run = await producer.enqueue(shout, "hello from a plugin")
    async with worker_side.worker():  # the worker's engine sees the producer's run
        result = await producer.result(run.run_id, timeout=5)
    info = await worker_side.get(run.run_id)
    print(f"result: {result!r}; status seen by the worker's engine: {info.status}")
    assert result == "HELLO FROM A PLUGIN!"
    assert info.status == "completed"

    other = await connect("dict://elsewhere", registry=registry, plugins=[umt_dict_backend])
    assert len(await other.list()) == 0, "another name is another store"
    print("dict://elsewhere is a separate, empty store")
    for engine in (producer, worker_side, other):
        await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
