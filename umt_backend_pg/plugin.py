"""The Postgres backend's plugin: serves `postgresql://` and `postgres://` URLs.

It imports without psycopg installed; the driver is loaded when a backend is opened.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from umt_backend_pg import NEEDS_PSYCOPG
from umt_sdk.backend import Backend, Clock, hookimpl
from umt_sdk.exceptions import BackendNotFoundError, UsageError

if TYPE_CHECKING:
    import click

    from umt_sdk.cli import CliBackend

__all__ = [
    "umt_backend_schemes",
    "umt_cli_add_commands",
    "umt_cli_backend",
    "umt_cli_default_url",
    "umt_open_backend",
    "umt_test_storage",
]

_SCHEMES = ("postgresql", "postgres")
_OPTIONS = frozenset(
    {
        "schema",
        "run_migrations",
        "min_size",
        "max_size",
        "listen",
        "listen_url",
        "pooled",
        "idle_in_transaction_timeout",
    }
)


@hookimpl
def umt_backend_schemes() -> Sequence[str]:
    return list(_SCHEMES)


@hookimpl
def umt_open_backend(
    url: str, clock: Clock | None, options: Mapping[str, Any]
) -> Awaitable[Backend] | None:
    if urlsplit(url).scheme not in _SCHEMES:
        return None

    async def open_backend() -> Backend:
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise UsageError(
                f"unknown Postgres backend option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(_OPTIONS))}",
                argument=", ".join(unknown),
            )
        if clock is not None:
            raise UsageError(
                "the Postgres backend keeps the database's time; it takes no clock",
                argument="clock",
            )
        try:
            from umt_backend_pg._backend import PostgresBackend
        except ModuleNotFoundError as exc:  # the `pg` extra is not installed
            if exc.name and exc.name.split(".")[0] in ("psycopg", "psycopg_pool"):
                raise BackendNotFoundError(NEEDS_PSYCOPG) from exc
            raise
        return await PostgresBackend.open(url, **options)

    return open_backend()


@hookimpl
def umt_test_storage(url: str) -> AbstractAsyncContextManager[Mapping[str, Any]] | None:
    if urlsplit(url).scheme not in _SCHEMES:
        return None
    try:
        from umt_backend_pg._testing import fresh_schema
    except ModuleNotFoundError as exc:  # the `pg` extra is not installed
        if exc.name and exc.name.split(".")[0] in ("psycopg", "psycopg_pool"):
            raise BackendNotFoundError(NEEDS_PSYCOPG) from exc
        raise
    return fresh_schema(url)


# The command line: the modules are imported only when `umt` runs.


@hookimpl
def umt_cli_add_commands(cli: click.Group) -> None:
    from umt_backend_pg import _cli

    _cli.add_commands(cli)


@hookimpl
def umt_cli_backend(url: str, options: Mapping[str, Any]) -> CliBackend | None:
    from umt_backend_pg import _cli

    return _cli.backend_for(url, options)


@hookimpl
def umt_cli_default_url(options: Mapping[str, Any]) -> str | None:
    from umt_backend_pg import _cli

    return _cli.default_url(options)
