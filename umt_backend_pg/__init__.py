"""The Postgres umt backend (psycopg 3): `await umt_sdk.connect("postgresql://...")`.

Also: `migrate(url, schema=...)` for deployments that migrate separately,
`start_embedded()` / `database_url()` for an embedded Postgres with no setup, and the
operation ledger for a separate business database (`install_ledger`), and the
transactional outbox: `install_outbox` / `outbox_ddl` for the business database,
`insert_outbox_event` for business transactions and `OutboxRelay` to turn rows into runs.

Each name is imported when it is first used: `umt_backend_pg.plugin`, which every
`umt_sdk.connect` and the `umt` command load, must import without psycopg (installed by the
`pg` extra), so that a plain install still runs the memory backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from umt_backend_pg._backend import PostgresBackend
    from umt_backend_pg._embedded import database_url, start_embedded
    from umt_backend_pg._ledger import PostgresLedger, install_ledger
    from umt_backend_pg._migrate import migrate, pending_migrations_sql
    from umt_backend_pg.outbox import (
        DispatchReport,
        OutboxRelay,
        insert_outbox_event,
        install_outbox,
        outbox_ddl,
    )

__all__ = [
    "DispatchReport",
    "OutboxRelay",
    "PostgresBackend",
    "PostgresLedger",
    "database_url",
    "insert_outbox_event",
    "install_ledger",
    "install_outbox",
    "migrate",
    "outbox_ddl",
    "pending_migrations_sql",
    "start_embedded",
]

_HOMES = {
    "DispatchReport": "umt_backend_pg.outbox",
    "OutboxRelay": "umt_backend_pg.outbox",
    "PostgresBackend": "umt_backend_pg._backend",
    "PostgresLedger": "umt_backend_pg._ledger",
    "database_url": "umt_backend_pg._embedded",
    "insert_outbox_event": "umt_backend_pg.outbox",
    "install_ledger": "umt_backend_pg._ledger",
    "install_outbox": "umt_backend_pg.outbox",
    "migrate": "umt_backend_pg._migrate",
    "outbox_ddl": "umt_backend_pg.outbox",
    "pending_migrations_sql": "umt_backend_pg._migrate",
    "start_embedded": "umt_backend_pg._embedded",
}
NEEDS_PSYCOPG = "the Postgres backend needs psycopg: pip install 'umt-tasks[pg]'"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(home)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("psycopg", "psycopg_pool"):
            raise ModuleNotFoundError(f"umt_backend_pg.{name}: {NEEDS_PSYCOPG}") from exc
        raise
    value = getattr(module, name)
    if isinstance(value, type):
        value.__module__ = __name__  # the public home, in reprs and docs
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
