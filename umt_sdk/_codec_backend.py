"""The backend a codec sits in front of: every payload sealed on the way in, opened on the way out.

`connect(url, codec=...)` wraps the backend its plugin opened in a `CodecBackend`; the engine,
its workers, the scheduler and the ledger only ever talk to the wrapper, so no code path can
store a payload in clear by forgetting to encode it.

What is a payload is said once, by naming convention, so a method added to the SPI later is
covered without touching this module: every field or keyword argument whose name ends in
`_json` (a run's input and output, a step's output, a fact's payload, a schedule's input, a
ledger result, a stream entry's value...), and the message and traceback of every `ErrorInfo`
(an error type stays clear: it is a class name, and retry policies are matched on it). The
records walked are the SPI's (attrs classes of `umt_sdk`), in arguments and results alike,
nested records and sequences of them included. Names, keys, hashes, times and statuses stay
clear: the store needs them to claim, order and deduplicate. The input hash of an idempotency
key is computed by the SDK from the plaintext before it gets here, so it does not change when
the codec encrypts.

Every public coroutine method of the wrapped backend (of its class, and every SPI method it
answers to, even through `__getattr__`) gets a sealing twin on a class made for it
(`wrap_backend`), so an optional protocol the backend implements (`ScheduleStore`...)
is still implemented by the wrapper, and one it does not is not: `isinstance` answers the
same. Other attributes are read through to the wrapped backend.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import attrs

from umt_sdk._codec import PayloadCodec, open_json, open_text, seal_json, seal_text, sealed_by
from umt_sdk._event_spi import EventListStore, EventStore
from umt_sdk._spi import (
    Backend,
    BatchEnqueueStore,
    ChildGroupStore,
    ClaimedRun,
    Clock,
    ErrorInfo,
    InsightStore,
    Ledger,
    LifecycleStore,
    RateLimitStore,
    RetentionStore,
    ScheduleStore,
    StreamStore,
    TaskPair,
    TransactionStore,
)
from umt_sdk.exceptions import CodecError

__all__ = [
    "CodecBackend",
    "MaskingBackend",
    "codec_of",
    "inner_backend",
    "mask_backend",
    "open_payloads",
    "seal_payloads",
    "wrap_backend",
]

_Convert = Callable[[str], str]
_log = logging.getLogger("umt.worker")


@functools.cache
def _record_fields(cls: type) -> tuple[tuple[str, str, bool], ...]:
    """(name, init alias, is a payload) of each field of an attrs record class."""
    return tuple((f.name, f.alias or f.name, f.name.endswith("_json")) for f in attrs.fields(cls))


def _walk(value: Any, json: _Convert, text: _Convert) -> Any:
    """`value` with every payload in it converted (the same object when nothing is)."""
    if isinstance(value, str | int | float | bool | None):
        return value
    if isinstance(value, ErrorInfo):
        if not value.message and not value.traceback:
            return value
        return attrs.evolve(
            value,
            message=text(value.message) if value.message else "",
            traceback=text(value.traceback) if value.traceback else "",
        )
    cls = type(value)
    if attrs.has(cls) and cls.__module__.startswith("umt_sdk"):
        changes: dict[str, Any] = {}
        for name, alias, payload in _record_fields(cls):
            item = getattr(value, name)
            if payload and isinstance(item, str):
                changes[alias] = json(item)
            elif not isinstance(item, str | int | float | bool | None):
                new = _walk(item, json, text)
                if new is not item:
                    changes[alias] = new
        return attrs.evolve(value, **changes) if changes else value
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        items = [_walk(item, json, text) for item in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        pairs = {key: _walk(item, json, text) for key, item in value.items()}
        if all(pairs[key] is item for key, item in value.items()):
            return value
        return pairs
    return value


def seal_payloads(codec: PayloadCodec, value: Any) -> Any:
    """`value` (an SPI record, a sequence or mapping of them) with every payload sealed."""
    return _walk(value, functools.partial(seal_json, codec), functools.partial(seal_text, codec))


def open_payloads(codec: PayloadCodec, value: Any) -> Any:
    """`value` with every payload that `seal_payloads` sealed opened again (`CodecError` for
    one that was tampered with or sealed by another codec)."""
    return _walk(value, functools.partial(open_json, codec), functools.partial(open_text, codec))


class _Sealing:
    """What a sealing proxy holds: the wrapped object and the codec, and how it seals a
    payload on the way in and opens it on the way out."""

    def __init__(self, inner: Any, codec: PayloadCodec | None) -> None:
        self.inner = inner
        self.codec = codec

    def _seal_json(self, text: str) -> str:
        assert self.codec is not None
        return seal_json(self.codec, text)

    def _seal_text(self, text: str) -> str:
        assert self.codec is not None
        return seal_text(self.codec, text)

    def _open_json(self, text: str) -> str:
        assert self.codec is not None
        return open_json(self.codec, text)

    def _open_text(self, text: str) -> str:
        assert self.codec is not None
        return open_text(self.codec, text)

    def _seal(self, value: Any) -> Any:
        return _walk(value, self._seal_json, self._seal_text)

    def _open(self, value: Any) -> Any:
        return _walk(value, self._open_json, self._open_text)

    def _seal_call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        sealed_args = tuple(self._seal(arg) for arg in args)
        sealed_kwargs = {
            key: self._seal_json(value)
            if key.endswith("_json") and isinstance(value, str)
            else self._seal(value)
            for key, value in kwargs.items()
        }
        return sealed_args, sealed_kwargs

    def __getattr__(self, name: str) -> Any:
        # Only reached for what the proxy class does not define: attributes without payloads
        # (a backend's pool, its own helpers), read through.
        if name in ("inner", "codec"):
            raise AttributeError(name)
        return getattr(self.inner, name)


_S = TypeVar("_S", bound=_Sealing)


def _sealed_coroutine(name: str) -> Callable[..., Any]:
    async def method(self: _Sealing, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._seal_call(args, kwargs)
        result = await getattr(self.inner, name)(*args, **kwargs)
        return self._open(result)

    method.__name__ = method.__qualname__ = name
    return method


def _sealed_generator(name: str) -> Callable[..., Any]:
    async def method(self: _Sealing, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        args, kwargs = self._seal_call(args, kwargs)
        async for item in getattr(self.inner, name)(*args, **kwargs):
            yield self._open(item)

    method.__name__ = method.__qualname__ = name
    return method


def _sealed_step_transaction(name: str) -> Callable[..., Any]:
    """`TransactionStore.run_step_transaction`: the record is the body's result, not an
    argument, so the body is wrapped to seal what it returns before the backend stores it."""

    async def method(
        self: _Sealing, lease: Any, body: Callable[[Any], Awaitable[Any]], **kwargs: Any
    ) -> Any:
        async def sealed_body(tx: Any) -> Any:
            return self._seal(await body(tx))

        return await getattr(self.inner, name)(lease, sealed_body, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


_CALLBACK_METHODS: dict[str, Callable[[str], Callable[..., Any]]] = {
    "run_step_transaction": _sealed_step_transaction
}
"""SPI methods whose payloads come back from a callback: sealed by their own twin."""


# The SPI's protocols: their methods are looked up on the backend object itself, so a backend
# that forwards them (a `__getattr__` proxy, as examples/08's does) is sealed all the same.
_PROTOCOLS: tuple[type, ...] = (
    Backend,
    Ledger,
    ScheduleStore,
    RetentionStore,
    ChildGroupStore,
    StreamStore,
    LifecycleStore,
    InsightStore,
    RateLimitStore,
    BatchEnqueueStore,
    EventStore,
    EventListStore,
    TransactionStore,
)
_PROTOCOL_METHODS = frozenset(
    name for protocol in _PROTOCOLS for name in vars(protocol) if not name.startswith("_")
)


def _proxy_class(base: type[_S], inner: object) -> type[_S]:
    """`base` with a sealing twin of every public coroutine method of `inner`: those of its
    class, and every SPI method it answers to (through `__getattr__` too)."""
    names = {name for name, _ in inspect.getmembers(type(inner))} | _PROTOCOL_METHODS
    methods: list[tuple[str, bool]] = []
    for name in sorted(names):
        if name.startswith("_") or hasattr(base, name):
            continue
        member = getattr(inner, name, None)
        if inspect.iscoroutinefunction(member):
            methods.append((name, False))
        elif inspect.isasyncgenfunction(member):
            methods.append((name, True))
    key = (base, type(inner), tuple(methods))
    proxy = _PROXIES.get(key)
    if proxy is None:
        namespace: dict[str, Any] = {
            name: _sealed_generator(name)
            if generator
            else _CALLBACK_METHODS.get(name, _sealed_coroutine)(name)
            for name, generator in methods
        }
        proxy = _PROXIES[key] = type(f"{base.__name__}[{type(inner).__name__}]", (base,), namespace)
    assert issubclass(proxy, base)
    return proxy


_PROXIES: dict[tuple[type, type, tuple[tuple[str, bool], ...]], type] = {}


class CodecBackend(_Sealing):
    """A backend whose payloads pass through `codec` (see the module docstring): what
    `connect(url, codec=...)` gives the engine. `inner` is the backend it wraps, for code that
    needs that backend's own type (the outbox relay asks the Postgres backend where it is)."""

    inner: Backend
    codec: PayloadCodec

    @property
    def clock(self) -> Clock | None:
        return self.inner.clock

    async def claim(
        self, *, worker_id: str, pairs: Sequence[TaskPair], limit: int, lease: timedelta
    ) -> Sequence[ClaimedRun]:
        """Claim through the wrapped backend and open each run on its own: a run this codec
        cannot open (a key it lacks, a changed payload) stays sealed, and its execution hands
        it back (`CodecError` on its input), without holding up the other runs of the batch."""
        claimed = await self.inner.claim(worker_id=worker_id, pairs=pairs, limit=limit, lease=lease)
        opened: list[ClaimedRun] = []
        for run in claimed:
            try:
                opened.append(self._open(run))
            except CodecError as exc:
                _log.error("run %s: cannot open its payloads: %s", run.run_id, exc)
                opened.append(run)
        return opened

    def add_cancel_listener(self, listener: Callable[[Any, str], None]) -> Callable[[], None]:
        return self.inner.add_cancel_listener(listener)

    def ledger(self, conn: Any) -> Ledger:
        """The wrapped backend's ledger, its results sealed like every other payload."""
        inner = self.inner.ledger(conn)
        proxy: Ledger = _proxy_class(_Sealing, inner)(inner, self.codec)
        return proxy


class MaskingBackend(_Sealing):
    """For a reader without the codec (the command line with no `--codec`): every sealed
    payload reads as `<encrypted: NAME>` (JSON: that string) instead of its ciphertext, and
    `masked` collects the names of the codecs met, so the reader can say how to read them.
    Writes pass as they are. Never for a worker: it would run tasks on the placeholders."""

    inner: Backend

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, None)
        self.masked: set[str] = set()
        self._shown: set[str] = set()

    @property
    def clock(self) -> Clock | None:
        return self.inner.clock

    def add_cancel_listener(self, listener: Callable[[Any, str], None]) -> Callable[[], None]:
        return self.inner.add_cancel_listener(listener)

    def _seal_json(self, text: str) -> str:
        if text.startswith('"<encrypted: ') and text in self._shown:
            # A stand-in read back to be written (a rerun, a fork): it would start a run on
            # "<encrypted: ...>" instead of its input.
            raise CodecError(
                f"cannot write {text} back: it stands for a payload this reader could not "
                "decode; pass --codec (or connect with codec=...) to do this",
                codec=text[len('"<encrypted: ') : -2],
            )
        return text

    def _seal_text(self, text: str) -> str:
        return text

    def _placeholder(self, text: str) -> str | None:
        name = sealed_by(text)
        if name is None:
            return None
        self.masked.add(name)
        shown = f"<encrypted: {name}>"
        self._shown.add(json.dumps(shown))
        return shown

    def _open_json(self, text: str) -> str:
        shown = self._placeholder(text)
        return text if shown is None else json.dumps(shown)

    def _open_text(self, text: str) -> str:
        shown = self._placeholder(text)
        return text if shown is None else shown


def mask_backend(backend: Backend) -> MaskingBackend:
    """`backend` for a reader without the codec (see `MaskingBackend`)."""
    proxy: MaskingBackend = _proxy_class(MaskingBackend, backend)(backend)
    return proxy


def wrap_backend(backend: Backend, codec: PayloadCodec) -> Backend:
    """`backend` behind `codec`: a `CodecBackend` that implements what `backend` implements."""
    proxy: Backend = _proxy_class(CodecBackend, backend)(backend, codec)
    return proxy


def inner_backend(backend: Any) -> Any:
    """The backend under any codec wrapper."""
    while isinstance(backend, CodecBackend | MaskingBackend):
        backend = backend.inner
    return backend


def codec_of(backend: Any) -> PayloadCodec | None:
    """The codec `backend` seals with, if it is a `CodecBackend`."""
    return backend.codec if isinstance(backend, CodecBackend) else None
