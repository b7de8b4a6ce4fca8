"""Driver errors never escape the backend: they become umt's BackendError."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from umt_sdk.exceptions import BackendError

__all__ = ["wrap_exceptions"]


@contextmanager
def wrap_exceptions() -> Iterator[None]:
    try:
        yield
    except psycopg.errors.UndefinedTable as exc:
        raise BackendError(
            f"the umt tables are missing ({exc.diag.message_primary}); run `umt migrate` "
            "or connect with run_migrations=True"
        ) from exc
    except psycopg.OperationalError as exc:
        raise BackendError(f"database unavailable: {exc}") from exc
    except psycopg.Error as exc:
        sqlstate = getattr(exc, "sqlstate", None) or "?"
        raise BackendError(f"database error {sqlstate}: {exc}") from exc
