"""The memory backend's plugin: serves `memory://` URLs."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from umt_sdk.backend import Backend, Clock, SystemClock, hookimpl
from umt_sdk.exceptions import UsageError

__all__ = ["umt_backend_schemes", "umt_open_backend"]


@hookimpl
def umt_backend_schemes() -> Sequence[str]:
    return ["memory"]


@hookimpl
def umt_open_backend(
    url: str, clock: Clock | None, options: Mapping[str, Any]
) -> Awaitable[Backend] | None:
    if urlsplit(url).scheme != "memory":
        return None

    async def open_backend() -> Backend:
        from umt_backend_memory._backend import MemoryBackend

        if options:
            raise UsageError(
                f"the memory backend takes no options, got {', '.join(sorted(options))}",
                argument=", ".join(sorted(options)),
            )
        return MemoryBackend(clock=clock if clock is not None else SystemClock())

    return open_backend()
