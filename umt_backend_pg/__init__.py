"""The Postgres umt backend (psycopg 3): `await umt_sdk.connect("postgresql://...")`.

Also: `migrate(url, schema=...)` for deployments that migrate separately, and
`start_embedded()` / `database_url()` for an embedded Postgres with no setup.
"""

from umt_backend_pg._backend import PostgresBackend, PostgresLedger
from umt_backend_pg._embedded import database_url, start_embedded
from umt_backend_pg._migrate import migrate, pending_migrations_sql

__all__ = [
    "PostgresBackend",
    "PostgresLedger",
    "database_url",
    "migrate",
    "pending_migrations_sql",
    "start_embedded",
]

for _name in ("PostgresBackend", "PostgresLedger"):
    globals()[_name].__module__ = __name__
del _name
