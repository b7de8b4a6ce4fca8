"""A host's link to Postgres, impaired in user space where the kernel has no `sch_netem`.

    ip netns exec NS python -m tests.chaos.link_proxy --listen 127.0.0.1:15432
        --to 10.231.0.10:5432 --control FILE

Runs in the host's namespace: the host's workers connect to `--listen`, and every connection
is forwarded to `--to` through the host's own veth (so cutting the host's link still cuts
them). While the JSON file `--control` says `{"delay": 0.2, "loss": 0.05}`, each chunk read
in either direction is delivered `delay / 2` later (so a round trip takes `delay` more), and
with probability `loss` it is "lost": delivered a retransmission timeout (0.2 s, Linux's
minimum) later still, holding back the chunks behind it as TCP does. Without the file (or
with zeros) the link is clean. Prints `READY` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from pathlib import Path

RETRANSMISSION_TIMEOUT = 0.2


class Impairment:
    def __init__(self, control: Path) -> None:
        self.control = control
        self.delay = 0.0
        self.loss = 0.0

    async def watch(self) -> None:
        while True:
            try:
                wanted = json.loads(self.control.read_text())
            except (OSError, ValueError):
                wanted = {}
            self.delay = float(wanted.get("delay", 0.0))
            self.loss = float(wanted.get("loss", 0.0))
            await asyncio.sleep(0.1)


async def pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, impairment: Impairment
) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            at, data = await queue.get()
            if not data:
                break
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    delivering = asyncio.create_task(deliver())
    last = 0.0
    try:
        while data := await reader.read(65536):
            at = time.monotonic() + impairment.delay / 2
            if impairment.loss and random.random() < impairment.loss:
                at += RETRANSMISSION_TIMEOUT
            last = max(last, at)  # in order, as TCP delivers
            await queue.put((last, data))
    except OSError:
        pass
    finally:
        await queue.put((0.0, b""))
        with contextlib.suppress(OSError):
            await delivering
        writer.close()


async def main(listen: str, to: str, control: Path) -> None:
    impairment = Impairment(control)
    watcher = asyncio.create_task(impairment.watch())
    to_host, to_port = to.rsplit(":", 1)

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(to_host, int(to_port))
        except OSError:
            client_w.close()
            return
        await asyncio.gather(
            pipe(client_r, server_w, impairment),
            pipe(server_r, client_w, impairment),
            return_exceptions=True,
        )

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port))
    print("READY", flush=True)
    async with server:
        await server.serve_forever()
    watcher.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--to", required=True)
    parser.add_argument("--control", required=True, type=Path)
    args = parser.parse_args()
    asyncio.run(main(args.listen, args.to, args.control))
