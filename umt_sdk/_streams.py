"""Streams out of a run: `ctx.stream.write(name, value)` in a handler; `engine.stream(...)`,
`engine.stream_last(...)` and `engine.stream_heads(...)` for whoever watches it.

A stream is an ordered, durable list of JSON values that one run writes under a name
("progress", "log", ...). The SDK decides what each write is keyed by; the store
(`StreamStore`) keeps the entries in order, numbers them (`seq`: 1, 2, 3... per stream) and
keeps the first entry of each key.

The key of a write is where the handler stands when it writes, so a write made again by code
that runs again finds the entry it made the first time:

- inside a step's body (and the tasks and threads it starts): `step:<step>:<attempt>:<n>`,
  the step's recorded name (`fetch`, `fetch#2`), its attempt and the write's position among
  that attempt's writes to the same stream (0, 1, 2... in the order they are called). A step
  that runs again after a crash (its record was never written) runs the same attempt again:
  its writes find their entries, nothing is duplicated. A step retried after it failed is a
  new attempt, and its writes are new entries: a reader sees the retry's progress. A step
  whose record is stored is never run again, so it never writes again.
- in the handler's own code, between steps (it runs again on every execution, replaying):
  `run:<calls>:<n>`, the number of step calls (steps, sleeps, fact waits, children) the
  handler made before the write in this execution, and the write's position among the
  writes to the same stream since the last of them. A replay makes the same calls in the
  same order, so it finds the same keys (the handler must be deterministic between steps
  anyway).

The first write of a key wins: a write made again with another value keeps the stored one
(the reader has seen it already). Writes are fenced like every write of an execution: an
execution that lost its lease cannot write.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import Any, Protocol, TypeVar
from uuid import UUID

from attrs import frozen

from umt_sdk import _serde
from umt_sdk._names import check_name
from umt_sdk._retention import missing_run
from umt_sdk._spi import (
    TERMINAL_STATUSES,
    Backend,
    Lease,
    StreamAppend,
    StreamEntry,
    StreamStore,
)
from umt_sdk.exceptions import PayloadError, UsageError

__all__ = [
    "FOLLOW_WAIT",
    "MAX_VALUE_BYTES",
    "PAGE",
    "StepScope",
    "StreamApi",
    "StreamHost",
    "StreamItem",
    "StreamWriter",
    "SyncStreamApi",
    "encode_value",
    "follow_stream",
    "heads_by_run",
    "item_of",
    "step_scope",
    "stream_store",
]

T = TypeVar("T")

MAX_VALUE_BYTES = 64 * 1024
"""The largest value one write may store, as UTF-8 JSON text: progress, a status line, a
partial result's summary. Bigger data belongs in a step's output or in your own storage."""

PAGE = 500
"""Entries `engine.stream` reads per round trip."""

FOLLOW_WAIT = 5.0
"""Seconds a follower waits for a hint before it reads the run's state again."""


@frozen(kw_only=True)
class StreamItem:
    """One value a run wrote to one of its streams, as a reader sees it."""

    run_id: UUID
    stream: str
    seq: int
    """Its place in the stream (1 for the first): pass the last one seen as `since=` to
    go on from there."""
    value: Any
    """The value, decoded as JSON (or to the `value_type` the reader asked for)."""
    written_at: datetime
    """When the store first stored it (the store's clock)."""


def item_of(entry: StreamEntry, value_type: Any = Any) -> StreamItem:
    """A stored entry as a reader sees it."""
    return StreamItem(
        run_id=entry.run_id,
        stream=entry.stream,
        seq=entry.seq,
        value=_serde.decode(
            entry.value_json, value_type, what=f"value {entry.seq} of stream {entry.stream!r}"
        ),
        written_at=entry.written_at,
    )


def stream_store(backend: Backend) -> StreamStore:
    """The backend as a `StreamStore`, or `UsageError` saying it stores no streams."""
    if not isinstance(backend, StreamStore):
        raise UsageError(
            f"this backend ({type(backend).__name__}) does not store the streams of runs: "
            "use the memory or Postgres backend, or implement umt_sdk.backend.StreamStore",
            argument="stream",
        )
    return backend


# -- writing -----------------------------------------------------------------------------------


class _Positions:
    """The next position of a write per stream, shared by threads (a lock: a step's body may
    write from several)."""

    __slots__ = ("_lock", "_next")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[str, int] = {}

    def take(self, stream: str) -> int:
        with self._lock:
            position = self._next.get(stream, 0)
            self._next[stream] = position + 1
            return position


class StepScope:
    """The step attempt a write belongs to, and the next position in it per stream (see the
    module docstring). Shared by the step's tasks and threads."""

    __slots__ = ("_positions", "attempt", "name")

    def __init__(self, name: str, attempt: int) -> None:
        self.name = name
        self.attempt = attempt
        self._positions = _Positions()

    def next_key(self, stream: str) -> str:
        return f"step:{self.name}:{self.attempt}:{self._positions.take(stream)}"


step_scope: ContextVar[StepScope | None] = ContextVar("umt_stream_step_scope", default=None)
"""Set by `_steps.Steps` while a step's body runs (copied into the threads it runs in)."""


class StreamHost(Protocol):
    """What a writer asks of the execution it writes for."""

    @property
    def backend(self) -> Backend: ...
    @property
    def lease(self) -> Lease: ...

    async def guard(self, awaitable: Awaitable[T]) -> T: ...


class StreamWriter:
    """The writes of one execution: keys them (module docstring) and appends them, fenced."""

    def __init__(self, host: StreamHost, calls: Callable[[], int]) -> None:
        self._host = host
        self._calls = calls
        self._body_calls = -1
        self._body_positions = _Positions()

    def next_key(self, stream: str) -> str:
        """The key of the write to `stream` being made now: call it where the write is
        called (the handler's task or thread), before anything else can write."""
        scope = step_scope.get()
        if scope is not None:
            return scope.next_key(stream)
        calls = self._calls()
        if calls != self._body_calls:
            self._body_calls = calls
            self._body_positions = _Positions()
        return f"run:{calls}:{self._body_positions.take(stream)}"

    async def append(self, name: str, key: str, value_json: str) -> int:
        """Append one value (or find the entry of `key`) and return its seq."""
        store = stream_store(self._host.backend)
        entries = await self._host.guard(
            store.append_stream(
                self._host.lease, [StreamAppend(stream=name, key=key, value_json=value_json)]
            )
        )
        seq: int = entries[0].seq
        return seq


def encode_value(name: str, value: Any) -> str:
    """The value's JSON text, or `PayloadError` when it cannot be stored or is too big."""
    text = _serde.encode(value, what=f"value of stream {name!r}")
    if len(text) > MAX_VALUE_BYTES // 4 and (size := len(text.encode("utf-8"))) > MAX_VALUE_BYTES:
        raise PayloadError(
            f"value of stream {name!r} cannot be stored: its JSON is {size:,} bytes, more than "
            f"the limit of {MAX_VALUE_BYTES:,} (64 KiB) for one stream value; write a summary "
            "(a count, a percentage, a reference) and keep big data in a step's output",
            field=f"value of stream {name!r}",
        )
    return text


class StreamApi:
    """`ctx.stream` in an async task: `await ctx.stream.write("progress", {...})`."""

    __slots__ = ("_writer",)

    def __init__(self, writer: StreamWriter) -> None:
        self._writer = writer

    async def write(self, name: str, value: Any) -> int:
        """Append `value` (JSON: a dict, a list, a number, an attrs class...) to the run's
        stream `name` and return its seq (1 for the first value of the stream).

        Durable and ordered: readers (`engine.stream`) see every value once, in order. A
        write that runs again (a step re-run after a crash, the handler replaying) finds the
        entry it made the first time instead of adding one; a step retried after a failure
        writes new entries. `name` is 1-200 letters, digits and `_ . : - /`; a value's JSON
        is at most 64 KiB (`PayloadError` beyond).
        """
        check_name("stream", name, argument="name")
        key = self._writer.next_key(name)
        return await self._writer.append(name, key, encode_value(name, value))


class SyncStreamApi:
    """`ctx.stream` in a plain (sync) task: the same write, blocking the handler's thread."""

    __slots__ = ("_from_thread", "_writer")

    def __init__(
        self, writer: StreamWriter, from_thread: Callable[[Coroutine[Any, Any, int]], int]
    ) -> None:
        self._writer = writer
        self._from_thread = from_thread

    def write(self, name: str, value: Any) -> int:
        """Append `value` to the run's stream `name` (see `StreamApi.write`)."""
        check_name("stream", name, argument="name")
        key = self._writer.next_key(name)  # here, in the handler's thread, where the scope is
        text = encode_value(name, value)
        return self._from_thread(self._writer.append(name, key, text))


# -- reading ------------------------------------------------------------------------------------


async def follow_stream(
    backend: Backend,
    run_id: UUID,
    name: str,
    *,
    since: int,
    follow: bool,
    value_type: Any,
) -> AsyncGenerator[StreamItem, None]:
    """The items of the run's stream after seq `since`, in order; with `follow`, then the new
    ones as they come, until the run has ended and its last item was given."""
    store = stream_store(backend)
    head = await backend.get_run_head(run_id)
    if head is None:
        raise await missing_run(backend, run_id)
    ended = head.status in TERMINAL_STATUSES
    cursor = since
    while True:
        entries = await store.read_stream(run_id, name, after=cursor, limit=PAGE)
        for entry in entries:
            cursor = entry.seq
            yield item_of(entry, value_type)
        if len(entries) == PAGE:
            continue
        if ended or not follow:
            # Every entry is stored before the write that ends the run: once a read that
            # began after the run was seen ended comes back short, nothing more can come.
            return
        await store.wait_for_stream(run_id, name, after=cursor, timeout=FOLLOW_WAIT)
        head = await backend.get_run_head(run_id)
        if head is None:  # deleted while followed: what was read is all there is
            return
        ended = head.status in TERMINAL_STATUSES


def heads_by_run(
    entries: Sequence[StreamEntry], value_type: Any = Any
) -> Mapping[UUID, Mapping[str, StreamItem]]:
    """The newest entries of runs' streams, by run, then by stream name (sorted)."""
    found: dict[UUID, dict[str, StreamItem]] = {}
    for entry in sorted(entries, key=lambda e: (str(e.run_id), e.stream)):
        found.setdefault(entry.run_id, {})[entry.stream] = item_of(entry, value_type)
    return found
