"""Driver errors never escape the backend: they become umt's BackendError (and a lost lease
its FencingError)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from umt_sdk.backend import Lease
from umt_sdk.exceptions import BackendError, BackendUnavailableError, FencingError

__all__ = ["fenced", "wrap_exceptions"]


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
        if _unreachable(exc):
            raise BackendUnavailableError(f"database unavailable: {exc}") from exc
        raise BackendError(f"database error {exc.sqlstate or '?'}: {exc}") from exc
    except psycopg.Error as exc:
        sqlstate = getattr(exc, "sqlstate", None) or "?"
        raise BackendError(f"database error {sqlstate}: {exc}") from exc


# Server shutting down / restarting / not accepting connections yet (admin_shutdown,
# crash_shutdown, cannot_connect_now); class 08 is connection exceptions.
_UNREACHABLE_STATES = frozenset({"57P01", "57P02", "57P03"})


def _unreachable(exc: psycopg.OperationalError) -> bool:
    """The server could not be reached or went away (the connection is gone), as opposed to
    an operational error of a statement (a timeout, a resource limit) that would recur."""
    sqlstate = exc.sqlstate
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in _UNREACHABLE_STATES


def fenced(lease: Lease, what: str) -> FencingError:
    """The error of a write refused because `lease` no longer holds its run."""
    return FencingError(
        f"{what}: run {lease.run_id} is no longer held by attempt token {lease.fencing_token}",
        run_id=lease.run_id,
        fencing_token=lease.fencing_token,
    )
