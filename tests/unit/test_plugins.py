"""Backends are pluggy plugins chosen by URL scheme; `connect(plugins=[...])` adds more."""

from __future__ import annotations

import types
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import pytest

import umt_backend_memory.plugin
from umt_backend_memory import MemoryBackend
from umt_sdk import Registry, TaskContext, connect, task
from umt_sdk.backend import Backend, Clock, SystemClock, hookimpl
from umt_sdk.exceptions import BackendError, BackendNotFoundError, UsageError
from umt_sdk.testing import FakeClock


@task("plugins.double")
async def double(ctx: TaskContext[int]) -> int:
    return 2 * ctx.input


def make_mem2_plugin() -> types.ModuleType:
    """A plugin module serving `mem2://` with the memory backend, recording what it was given."""
    module = types.ModuleType("mem2_plugin")
    module.opened = []  # type: ignore[attr-defined]

    @hookimpl
    def umt_backend_schemes() -> Sequence[str]:
        return ["mem2"]

    @hookimpl
    def umt_open_backend(
        url: str, clock: Clock | None, options: Mapping[str, Any]
    ) -> Awaitable[Backend] | None:
        if urlsplit(url).scheme != "mem2":
            return None

        async def open_backend() -> Backend:
            backend = MemoryBackend(clock=clock or SystemClock())
            module.opened.append((url, dict(options), backend))  # type: ignore[attr-defined]
            return backend

        return open_backend()

    module.umt_backend_schemes = umt_backend_schemes  # type: ignore[attr-defined]
    module.umt_open_backend = umt_open_backend  # type: ignore[attr-defined]
    return module


async def test_an_unknown_scheme_names_the_installed_ones() -> None:
    with pytest.raises(BackendNotFoundError) as caught:
        await connect("nosuch://x")
    message = str(caught.value)
    assert "scheme 'nosuch'" in message
    assert "installed schemes: memory" in message
    assert "umt_backend_memory.plugin" in message
    assert "plugins=[...]" in message
    assert isinstance(caught.value, BackendError)


async def test_the_error_does_not_repeat_credentials() -> None:
    with pytest.raises(BackendNotFoundError) as caught:
        await connect("nosuch://admin:s3cr3t@db.internal:5432/app")
    assert "s3cr3t" not in str(caught.value)
    assert "db.internal:5432/app" in str(caught.value)


async def test_a_url_without_a_scheme_is_not_found() -> None:
    with pytest.raises(BackendNotFoundError, match=r"scheme '\(none\)'"):
        await connect("just-a-path")


async def test_an_extra_plugin_serves_its_scheme() -> None:
    plugin = make_mem2_plugin()
    clock = FakeClock(auto_advance=True)
    engine = await connect(
        "mem2://box", registry=Registry([double]), clock=clock, plugins=[plugin], shards=3
    )
    try:
        [(url, options, backend)] = plugin.opened  # type: ignore[attr-defined]
        assert (url, options) == ("mem2://box", {"shards": 3})
        assert engine.backend is backend
        assert engine.backend.clock is clock
        handle = await engine.enqueue(double, 21)
        async with engine.worker():
            assert await handle.result(timeout=5) == 42
    finally:
        await engine.close()


async def test_the_extra_plugin_is_listed_and_needed() -> None:
    plugin = make_mem2_plugin()
    with pytest.raises(BackendNotFoundError, match="installed schemes: mem2, memory"):
        await connect("nosuch://", plugins=[plugin])
    with pytest.raises(BackendNotFoundError, match="scheme 'mem2'"):
        await connect("mem2://box")
    assert plugin.opened == []  # type: ignore[attr-defined]


async def test_memory_urls_still_go_to_the_memory_plugin_alongside_extras() -> None:
    plugin = make_mem2_plugin()
    engine = await connect("memory://", plugins=[plugin, umt_backend_memory.plugin])
    try:
        assert isinstance(engine.backend, MemoryBackend)
        assert isinstance(engine.backend.clock, SystemClock)
        assert plugin.opened == []  # type: ignore[attr-defined]
    finally:
        await engine.close()


async def test_the_memory_backend_refuses_options() -> None:
    # A UsageError since the hierarchy change (it was a TypeError; UsageError is not one).
    with pytest.raises(
        UsageError, match="the memory backend takes no options, got dsn, pool_size"
    ) as caught:
        await connect("memory://", pool_size=5, dsn="x")
    assert caught.value.argument == "dsn, pool_size"


async def test_a_plugin_that_cannot_be_imported_leaves_the_others_working(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An installed plugin whose module fails to import (a missing dependency, as the Postgres
    # backend without the `pg` extra once did) must not take the memory backend down with it.
    import importlib.metadata

    from umt_sdk import _plugins

    real = importlib.metadata.entry_points(group="umt")
    broken = importlib.metadata.EntryPoint(
        name="broken", value="umt_no_such_backend_module.plugin", group="umt"
    )
    monkeypatch.setattr(_plugins.importlib.metadata, "entry_points", lambda group: [*real, broken])
    engine = await connect("memory://", registry=Registry([double]))
    try:
        async with engine.worker():
            run = await engine.enqueue(double, 21)
            assert await run.result(timeout=5) == 42
    finally:
        await engine.close()
    with pytest.raises(BackendNotFoundError) as caught:
        await connect("broken://x", registry=Registry([double]))
    assert "'broken' could not be loaded" in str(caught.value)
    assert "ModuleNotFoundError" in str(caught.value)


def test_the_postgres_plugin_and_cli_import_without_psycopg() -> None:
    # Every `connect` and the `umt` command load the plugin module: it and the package must not
    # import the driver, which a plain install (no `pg` extra) does not have.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import umt_backend_pg.plugin, umt_backend_pg._cli, umt_sdk.cli\n"
        "drivers = ('psycopg', 'psycopg_pool')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in drivers)\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
