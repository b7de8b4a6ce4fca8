"""The hooks a backend plugin implements (pluggy project `umt`, entry-point group `umt`)."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import pluggy

from umt_sdk._spi import Backend, Clock

__all__ = ["BackendHookspecs", "hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("umt")
hookimpl = pluggy.HookimplMarker("umt")


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
