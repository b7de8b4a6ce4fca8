"""MemoryStore: business tables in memory, written through atomic transactions."""

from __future__ import annotations

import sys
import threading

import pytest

from umt_backend_memory import MemoryStore, MemoryTransaction


def test_put_get_and_rows() -> None:
    store = MemoryStore()
    assert store.get("t", "k") is None
    assert store.get("t", "k", "fallback") == "fallback"
    store.put("t", "k", 1)
    assert store.get("t", "k") == 1
    rows = store.rows("t")
    rows["k"] = 99
    assert store.rows("t") == {"k": 1}, "rows() is a copy"
    assert store.rows("empty") == {}


def test_writes_are_buffered_until_applied() -> None:
    store = MemoryStore()
    store.put("t", "gone", "x")
    tx = store.transaction()
    assert isinstance(tx, MemoryTransaction)
    tx.put("t", "a", 1)
    tx.put("u", "b", 2)
    tx.delete("t", "gone")
    assert store.rows("t") == {"gone": "x"}
    assert store.rows("u") == {}
    assert tx.get("t", "a") == 1, "a transaction reads its own writes"
    assert tx.get("t", "gone", "deleted") == "deleted"
    assert tx.get("t", "missing", "d") == "d"
    tx.apply()
    assert store.rows("t") == {"a": 1}
    assert store.rows("u") == {"b": 2}


def test_apply_consumes_the_buffer() -> None:
    store = MemoryStore()
    tx = store.transaction()
    tx.put("t", "a", 1)
    tx.apply()
    store.put("t", "a", 2)
    tx.apply()
    assert store.get("t", "a") == 2


async def test_async_with_commits_on_success() -> None:
    store = MemoryStore()
    async with store.transaction() as tx:
        tx.put("t", "a", 1)
        tx.insert("t", "b", 2)
        assert store.rows("t") == {}
    assert store.rows("t") == {"a": 1, "b": 2}


async def test_async_with_applies_nothing_on_error() -> None:
    store = MemoryStore()
    store.put("t", "taken", 0)

    async def write() -> None:
        async with store.transaction() as tx:
            tx.put("t", "a", 1)
            tx.delete("t", "taken")
            tx.put("u", "b", 2)
            tx.insert("t", "c", 3)
            tx.put("t", "taken", 9)
            tx.insert("t", "taken", 4)

    with pytest.raises(KeyError, match="duplicate key 'taken' in table 't'"):
        await write()
    assert store.rows("t") == {"taken": 0}
    assert store.rows("u") == {}


def test_insert_enforces_unique_keys() -> None:
    store = MemoryStore()
    store.put("receipts", "r1", "stored")
    tx = store.transaction()
    with pytest.raises(KeyError, match="duplicate key 'r1'"):
        tx.insert("receipts", "r1", "again")
    tx.insert("receipts", "r2", "new")
    with pytest.raises(KeyError, match="duplicate key 'r2'"):
        tx.insert("receipts", "r2", "twice in one transaction")
    tx.insert("other", "r1", "another table")
    tx.delete("receipts", "r1")
    tx.insert("receipts", "r1", "after delete")
    tx.apply()
    assert store.rows("receipts") == {"r1": "after delete", "r2": "new"}
    assert store.rows("other") == {"r1": "another table"}


def test_a_stored_none_still_counts_as_taken() -> None:
    store = MemoryStore()
    store.put("t", "k", None)
    with pytest.raises(KeyError):
        store.transaction().insert("t", "k", 1)


def test_readers_never_see_half_a_transaction() -> None:
    store = MemoryStore()
    tx = store.transaction()
    for i in range(20_000):
        tx.put("t", i, i)
    seen: set[int] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seen.add(len(store.rows("t")))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=read)
    try:
        reader.start()
        tx.apply()
        seen.add(len(store.rows("t")))
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert seen <= {0, 20_000}
    assert 20_000 in seen
