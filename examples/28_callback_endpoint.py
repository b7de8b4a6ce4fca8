"""The dashboard's signed callback endpoint: a service completes a run's callback over HTTP.

Run it: `python examples/28_callback_endpoint.py` (needs the dashboard extra: `pip install
'umt-tasks[dashboard]'`). It prints what happened and exits 0.

The dashboard serves `POST /callbacks/complete` when it is given a callback secret
(`create_app(engine, callback_secret=...)`, or `UMT_CALLBACK_SECRET` for `umt dashboard`).
Here it runs on a real HTTP server on 127.0.0.1, next to a worker:

1. a print job asks a (pretend) print shop to print, giving it the run's callback token; the
   shop's system POSTs `{"token": ..., "payload": ...}` signed with the shared secret
   (HMAC-SHA256 over the timestamp and the body), and the parked run continues;
2. the shop retries its request: refused (409, the token completed once), and so are a
   request signed with another secret (401), a replayed request an hour old (401), a body
   that is not JSON (400) and a forged token (404); none changes anything.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from datetime import timedelta
from typing import Any

import httpx
import uvicorn

from umt_sdk import Registry, TaskContext, connect, step, task
from umt_sdk.dashboard import create_app, sign_callback

SECRET = secrets.token_urlsafe(32)  # in production: UMT_CALLBACK_SECRET, shared with the shop
SHOP: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
"""The pretend print shop's inbox: (callback token, file) per print order."""


@step("order-print")
async def order_print(token: str, file: str) -> str:
    await SHOP.put((token, file))  # a real shop gets an HTTPS call with the token
    return "ordered"


@task("print_job", version=1)
async def print_job(ctx: TaskContext[str]) -> str:
    token = await ctx.step.callback_token("printed", timeout=timedelta(hours=6))
    await order_print(token, ctx.input)
    done: dict[str, Any] = await ctx.step.wait_for_callback(token)
    return f"{ctx.input}: {done['pages']} pages printed, tracking {done['tracking']}"


def signed(document: Any, *, secret: str = SECRET, age: int = 0) -> dict[str, Any]:
    """A request as the shop sends it: the JSON body and its signature headers."""
    body = json.dumps(document).encode()
    headers = sign_callback(secret, body, timestamp=int(time.time()) - age)
    return {"content": body, "headers": headers}


async def main() -> None:
    engine = await connect("memory://", registry=Registry([print_job]))
    app = create_app(engine, callback_secret=SECRET)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # any free port
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    listener.listen()  # requests queue here until the server accepts them
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    url = f"http://127.0.0.1:{port}/callbacks/complete"
    try:
        async with engine.worker(concurrency=2), httpx.AsyncClient(timeout=10) as shop:
            # 1. The shop prints, then completes the callback over HTTP.
            run = await engine.enqueue(print_job, "poster.pdf")
            token, file = await SHOP.get()
            print(f"1. the shop got {file} and a token ({token[:14]}...)")
            answer = {"pages": 12, "tracking": "PS-881"}
            response = await shop.post(url, **signed({"token": token, "payload": answer}))
            print(f"   POST /callbacks/complete -> {response.status_code} {response.json()}")
            print(f"   the run: {await run.result(timeout=10)}")

            # 2. Everything else is refused, with a reason, and changes nothing.
            attempts = {
                "retried": signed({"token": token, "payload": {"pages": 0}}),
                "other secret": signed({"token": token}, secret=secrets.token_urlsafe(32)),
                "an hour old": signed({"token": token}, age=3600),
                "not JSON": {"content": b"{", "headers": sign_callback(SECRET, b"{")},
                "forged": signed(
                    {"token": token[:-4] + ("AAAA" if token[-4:] != "AAAA" else "BBBB")}
                ),
            }
            print("2. refused:")
            for label, request in attempts.items():
                response = await shop.post(url, **request)
                reason = response.json()["error"]["reason"]
                print(f"   {label}: {response.status_code} {reason}")
                assert 400 <= response.status_code < 500
            assert (await run.result(timeout=10)).startswith("poster.pdf: 12 pages")
    finally:
        server.should_exit = True
        await serving
        await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
