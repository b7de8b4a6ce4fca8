"""The plugin host: owns the pluggy manager and gives each hook one typed method."""

from __future__ import annotations

import importlib.metadata
import types
from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any
from urllib.parse import urlsplit

import click
import pluggy

from umt_sdk import _hookspecs
from umt_sdk._spi import Backend, Clock
from umt_sdk.exceptions import BackendNotFoundError

__all__ = ["PluginHost"]


class PluginHost:
    """Loads backend plugins from the `umt` entry-point group (built-in ones included)."""

    def __init__(self, extra_plugins: Iterable[object] = ()) -> None:
        self._pm = pluggy.PluginManager("umt")
        self._pm.add_hookspecs(_hookspecs.BackendHookspecs)
        self._failed: dict[str, str] = {}
        self._load_entry_points()
        for plugin in extra_plugins:
            if not self._pm.is_registered(plugin):
                self._pm.register(plugin)

    def _load_entry_points(self) -> None:
        """Every plugin of the `umt` entry-point group that imports; one that cannot (a missing
        dependency, a bug) is left out and named in the errors, never breaks the others."""
        for ep in importlib.metadata.entry_points(group="umt"):
            if self._pm.get_plugin(ep.name) is not None or self._pm.is_blocked(ep.name):
                continue  # the same distribution found twice on the path
            try:
                plugin = ep.load()
            except Exception as exc:
                text = str(exc).strip().splitlines()
                self._failed[ep.name] = f"{type(exc).__name__}: {text[0] if text else ''}"
                continue
            self._pm.register(plugin, name=ep.name)

    @property
    def failed_plugins(self) -> Mapping[str, str]:
        """Plugins of the `umt` group that could not be loaded, with the error of each."""
        return dict(self._failed)

    def schemes(self) -> list[str]:
        found: list[str] = []
        for schemes in self._pm.hook.umt_backend_schemes():
            found.extend(schemes)
        return sorted(set(found))

    def plugin_names(self) -> list[str]:
        names = []
        for plugin in self._pm.get_plugins():
            name = plugin.__name__ if isinstance(plugin, types.ModuleType) else repr(plugin)
            names.append(name)
        return sorted(names)

    def cli_add_commands(self, cli: click.Group) -> None:
        self._pm.hook.umt_cli_add_commands(cli=cli)

    def cli_backend(self, url: str, options: Mapping[str, Any]) -> _hookspecs.CliBackend | None:
        found: _hookspecs.CliBackend | None = self._pm.hook.umt_cli_backend(
            url=url, options=dict(options)
        )
        return found

    def cli_default_url(self, options: Mapping[str, Any]) -> str | None:
        url: str | None = self._pm.hook.umt_cli_default_url(options=dict(options))
        return url

    def test_storage(self, url: str) -> AbstractAsyncContextManager[Mapping[str, Any]] | None:
        storage: AbstractAsyncContextManager[Mapping[str, Any]] | None = (
            self._pm.hook.umt_test_storage(url=url)
        )
        return storage

    async def open_backend(
        self, url: str, *, clock: Clock | None, options: Mapping[str, Any]
    ) -> Backend:
        opener = self._pm.hook.umt_open_backend(url=url, clock=clock, options=dict(options))
        if opener is None:
            scheme = urlsplit(url).scheme or "(none)"
            failed = "".join(
                f"; plugin {name!r} could not be loaded ({why})"
                for name, why in sorted(self._failed.items())
            )
            raise BackendNotFoundError(
                f"no installed backend serves URLs of scheme {scheme!r} ({url.split('@')[-1]!r}); "
                f"installed schemes: {', '.join(self.schemes()) or 'none'} "
                f"(plugins: {', '.join(self.plugin_names()) or 'none'}{failed}). Install the "
                "backend's package, or pass its plugin module with connect(..., plugins=[...])"
            )
        backend: Backend = await opener
        return backend
