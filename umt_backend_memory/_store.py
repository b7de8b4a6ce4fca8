"""A tiny transactional key-value store standing in for business tables in tests."""

from __future__ import annotations

import threading
from typing import Any

from umt_sdk.exceptions import UsageError

__all__ = ["MemoryStore", "MemoryTransaction"]

_DELETED = object()


def _row(table: object, key: object) -> None:
    """A table is named by a string, and a key must be hashable (as a dict key is)."""
    if not isinstance(table, str):
        raise UsageError(
            f"table must be a table name (a string), got {type(table).__name__}", argument="table"
        )
    try:
        hash(key)
    except Exception:  # unhashable (a list), or a __hash__ that raises
        raise UsageError(
            f"key must be hashable (a str, an int, a tuple...), got {type(key).__name__}",
            argument="key",
        ) from None


class MemoryStore:
    """Business tables in memory: `table -> key -> value`, written through transactions.

    Pass it as the connection of `with_attempt_token` on the memory backend: the `commit`
    callback gets a `MemoryTransaction` whose writes apply only if the fencing check passes.
    The memory backend's own one (`MemoryBackend.store`) is the engine's database of
    transactional steps: their `tx` is a serializable transaction on it.
    """

    def __init__(self) -> None:
        self._tables: dict[str, dict[Any, Any]] = {}
        # How many times each row was written: what a serializable transaction's reads saw.
        self._versions: dict[tuple[str, Any], int] = {}
        self._lock = threading.RLock()

    def transaction(self, *, serializable: bool = False) -> MemoryTransaction:
        """A transaction whose writes apply at once when it commits. `serializable`: it also
        remembers the rows it read, and `conflicts()` says whether a commit changed one since
        (optimistic concurrency: the committer refuses it rather than lose an update)."""
        return MemoryTransaction(self, serializable=serializable)

    def clear(self) -> None:
        """Forget every table."""
        with self._lock:
            self._tables.clear()
            self._versions.clear()

    def get(self, table: str, key: Any, default: Any = None) -> Any:
        _row(table, key)
        with self._lock:
            return self._tables.get(table, {}).get(key, default)

    def rows(self, table: str) -> dict[Any, Any]:
        """A copy of a table."""
        _row(table, None)
        with self._lock:
            return dict(self._tables.get(table, {}))

    def put(self, table: str, key: Any, value: Any) -> None:
        """Write one row outside any transaction."""
        _row(table, key)
        with self._lock:
            self._tables.setdefault(table, {})[key] = value


class MemoryTransaction:
    """Buffered writes on a `MemoryStore`; `async with store.transaction() as tx` commits them."""

    def __init__(self, store: MemoryStore, *, serializable: bool = False) -> None:
        self._store = store
        self._writes: dict[tuple[str, Any], Any] = {}
        self._reads: dict[tuple[str, Any], int] | None = {} if serializable else None

    async def __aenter__(self) -> MemoryTransaction:
        return self

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.apply()

    def get(self, table: str, key: Any, default: Any = None) -> Any:
        _row(table, key)
        value = self._writes.get((table, key), _DELETED if (table, key) in self._writes else None)
        if (table, key) in self._writes:
            return default if value is _DELETED else value
        store = self._store
        with store._lock:
            if self._reads is not None:
                self._reads.setdefault((table, key), store._versions.get((table, key), 0))
            return store._tables.get(table, {}).get(key, default)

    def conflicts(self) -> bool:
        """Whether a row this (serializable) transaction read was written by a commit since."""
        if not self._reads:
            return False
        versions = self._store._versions
        with self._store._lock:
            return any(versions.get(row, 0) != seen for row, seen in self._reads.items())

    def put(self, table: str, key: Any, value: Any) -> None:
        _row(table, key)
        self._writes[(table, key)] = value

    def insert(self, table: str, key: Any, value: Any) -> None:
        """Like `put`, but a duplicate key raises KeyError (a unique constraint)."""
        if self.get(table, key, _DELETED) is not _DELETED:
            raise KeyError(f"duplicate key {key!r} in table {table!r}")
        self.put(table, key, value)

    def delete(self, table: str, key: Any) -> None:
        _row(table, key)
        self._writes[(table, key)] = _DELETED

    def apply(self) -> None:
        """Apply every buffered write at once."""
        with self._store._lock:
            for (table, key), value in self._writes.items():
                versions = self._store._versions
                versions[(table, key)] = versions.get((table, key), 0) + 1
                rows = self._store._tables.setdefault(table, {})
                if value is _DELETED:
                    rows.pop(key, None)
                else:
                    rows[key] = value
        self._writes.clear()
