"""EXAMPLE ONLY: a third-party umt backend plugin serving `dict://NAME` URLs.

A umt backend plugin is a module with two pluggy hook implementations (see
`umt_sdk.backend.BackendHookspecs`), registered under the `umt` entry-point group (see this
directory's pyproject.toml) or passed to `connect(url, plugins=[module])` without installing:

- `umt_backend_schemes()`: the URL schemes it serves (used in "no backend" error messages);
- `umt_open_backend(url, clock, options)`: for a URL of its scheme, an awaitable that opens an
  object implementing `umt_sdk.backend.Backend`; None for any other URL.

What `dict://` adds: every `connect("dict://shop")` in a process opens the *same* named store
(each `memory://` connect gets its own), so a producer and a worker can be separate engines.
It stores nothing itself: it forwards every Backend method to a shared
`umt_backend_memory.MemoryBackend`. A real backend implements those methods on its storage and
proves it with `umt_sdk.testing.BackendContract` (see tests/acceptance/test_third_party_backend.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from umt_sdk.backend import Backend, Clock, SystemClock, hookimpl

__all__ = ["DictBackend", "umt_backend_schemes", "umt_open_backend"]

_STORES: dict[str, tuple[Any, int]] = {}  # name -> (shared MemoryBackend, open handles)


class DictBackend:
    """One handle on a named store; `close` releases it, the last one closes the store."""

    def __init__(self, name: str, clock: Clock | None) -> None:
        from umt_backend_memory import MemoryBackend  # import drivers when opening, not at load

        inner, handles = _STORES.get(name) or (MemoryBackend(clock=clock or SystemClock()), 0)
        if clock is not None and inner.clock is not clock:
            raise ValueError(f"dict://{name} is already open with another clock")
        _STORES[name] = (inner, handles + 1)
        self.name = name
        self._inner = inner
        self._closed = False

    def __getattr__(self, attribute: str) -> Any:
        # Every method of the Backend protocol (enqueue, claim, heartbeat, ...) and `clock`.
        return getattr(self._inner, attribute)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        inner, handles = _STORES.pop(self.name)
        if handles > 1:
            _STORES[self.name] = (inner, handles - 1)
        else:
            await inner.close()


@hookimpl
def umt_backend_schemes() -> Sequence[str]:
    return ["dict"]


@hookimpl
def umt_open_backend(
    url: str, clock: Clock | None, options: Mapping[str, Any]
) -> Awaitable[Backend] | None:
    parts = urlsplit(url)
    if parts.scheme != "dict":
        return None  # not ours: another plugin may serve it

    async def open_backend() -> Backend:
        if options:
            raise TypeError(f"dict:// takes no options, got {', '.join(sorted(options))}")
        return DictBackend(parts.netloc or "default", clock)

    return open_backend()
