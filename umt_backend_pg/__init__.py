"""The Postgres umt backend (psycopg 3): `await umt_sdk.connect("postgresql://...")`.

Also: `migrate(url, schema=...)` for deployments that migrate separately,
`start_embedded()` / `database_url()` for an embedded Postgres with no setup, and the
operation ledger for a separate business database (`install_ledger`), and the
transactional outbox: `install_outbox` / `outbox_ddl` for the business database,
`insert_outbox_event` for business transactions and `OutboxRelay` to turn rows into runs.
"""

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

for _name in ("DispatchReport", "OutboxRelay", "PostgresBackend", "PostgresLedger"):
    globals()[_name].__module__ = __name__
del _name
