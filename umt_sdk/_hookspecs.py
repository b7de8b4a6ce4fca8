"""The hooks a backend plugin implements (pluggy project `umt`, entry-point group `umt`)."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import click
import pluggy

from umt_sdk._spi import Backend, Clock

__all__ = ["BackendHookspecs", "CliBackend", "hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("umt")
hookimpl = pluggy.HookimplMarker("umt")


class CliBackend(Protocol):
    """What a backend plugin tells the command line about a URL it serves."""

    def where(self) -> str:
        """Where the engine's data is, for messages: `schema 'umt'` (or '' when nothing to
        say)."""
        ...

    def connect_options(self, *, worker: bool, concurrency: int) -> dict[str, Any]:
        """The extra keyword arguments of `connect()` for a command: a worker serving
        `concurrency` runs at once, or a short-lived client (`worker=False`)."""
        ...

    async def preflight(self, *, need_schema: bool) -> None:
        """Fail fast with one clear line (`CliError`): the storage cannot be reached, or (when
        `need_schema`) holds no engine tables."""
        ...


class BackendHookspecs:
    """Hook specifications. Implement them as module-level functions marked `@hookimpl`."""

    @hookspec
    def umt_backend_schemes(self) -> Sequence[str]:  # type: ignore[empty-body]
        """The URL schemes this plugin serves, for error messages (e.g. `["memory"]`)."""

    @hookspec(firstresult=True)
    def umt_open_backend(
        self, url: str, clock: Clock | None, options: Mapping[str, Any]
    ) -> Awaitable[Backend] | None:
        """Return an awaitable that opens a backend for `url`, or None if the scheme is not
        yours. `clock` is given only by tests (a `FakeClock`); `options` are the extra keyword
        arguments of `connect()`. Import heavy drivers inside, so the plugin module imports
        without them."""

    @hookspec
    def umt_cli_add_commands(self, cli: click.Group) -> None:
        """Add this backend's commands to the `umt` group (`cli.add_command(...)`), and any
        global options it needs (`cli.params.append(click.Option(...))`): their values reach
        `umt_cli_backend` and `umt_cli_default_url` as `options`, by parameter name. Called once,
        the first time the group is used; the command modules may be imported inside."""

    @hookspec(firstresult=True)
    def umt_cli_backend(self, url: str, options: Mapping[str, Any]) -> CliBackend | None:
        """The command line's view of the backend for `url` (checks and `connect` options), or
        None if the scheme is not yours."""

    @hookspec(firstresult=True)
    def umt_cli_default_url(self, options: Mapping[str, Any]) -> str | None:
        """The URL to use when the command line was given none (a local development server,
        say), or None. May start a server, and say so on stderr."""

    @hookspec(firstresult=True)
    def umt_test_storage(self, url: str) -> AbstractAsyncContextManager[Mapping[str, Any]] | None:
        """Storage of one test's own under `url`, for the pytest plugin's `umt_engine`: an
        async context manager that creates it (a fresh schema, say), gives the extra keyword
        arguments of `connect()` that open it, and removes it on exit. None if the scheme is
        not yours."""
