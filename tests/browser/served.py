"""The dashboard served for a browser: `create_app(engine)` under uvicorn on a free loopback
port, in a thread with an event loop of its own (the engine's pool belongs to that loop)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

from umt_sdk import Registry, connect


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServedDashboard:
    """`url` is where the browser opens it (`http://127.0.0.1:PORT`)."""

    def __init__(self, db_url: str, *, schema: str, registry: Registry, **options: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._started = threading.Event()
        self._failed: BaseException | None = None
        self._server: Any = None
        # A daemon: should it ever outlive `stop()`, it must not hold the test process open.
        self._thread = threading.Thread(
            target=self._run,
            args=(db_url, schema, registry, options),
            name="dashboard",
            daemon=True,
        )

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(60) or self._failed is not None:
            self.stop()
            raise AssertionError(f"the dashboard did not start: {self._failed!r}")

    def _run(self, db_url: str, schema: str, registry: Registry, options: Any) -> None:
        try:
            asyncio.run(self._serve(db_url, schema, registry, options))
        except BaseException as exc:
            self._failed = exc
        finally:
            self._started.set()

    async def _serve(self, db_url: str, schema: str, registry: Registry, options: Any) -> None:
        import uvicorn

        from umt_sdk.dashboard import create_app

        engine = await connect(db_url, registry=registry, schema=schema, run_migrations=False)
        try:
            config = uvicorn.Config(
                create_app(engine, **options),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="off",
                # The browser may still hold a request open when the test stops the server.
                timeout_graceful_shutdown=5,
            )
            self._server = uvicorn.Server(config)
            serving = asyncio.create_task(self._server.serve())
            while not self._server.started and not serving.done():  # noqa: ASYNC110 - uvicorn offers a flag only
                await asyncio.sleep(0.02)
            self._started.set()
            await serving
        finally:
            await engine.close()

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(30)
            if self._thread.is_alive():
                raise AssertionError("the dashboard's server did not stop within 30 s")


@contextlib.contextmanager
def served(db_url: str, *, schema: str, registry: Registry, **options: Any) -> Iterator[str]:
    """The dashboard's base URL while the block runs."""
    dashboard = ServedDashboard(db_url, schema=schema, registry=registry, **options)
    dashboard.start()
    try:
        yield dashboard.url
    finally:
        dashboard.stop()
