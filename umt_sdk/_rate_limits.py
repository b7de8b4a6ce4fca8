"""Rate limits: named token buckets stored by the backend, taken by runs and by steps.

A `RateLimit` names a limit (`"openai"`, 600 per minute) and, optionally, a key function of a
run's input that splits it into independent buckets (one per tenant). The SDK decides what a
token is for and when to ask; the store keeps each bucket and takes tokens from it atomically
with the claim (`@task(rate_limit=...)`: a run starts only with a token) or with the step's
request (`ctx.step.run(..., rate_limit=...)`), by the one rule `take_tokens` states, so every
worker and host shares the limit.

The rule is GCRA, a token bucket kept as one time per bucket (its *theoretical arrival time*,
`tat`): a bucket holds at most `limit` tokens and one comes back every `per / limit` (rounded
up to the microsecond). So at most `limit` are taken at once, and over any span of time `d`
at most `limit + d * limit / per`: the rate never exceeds `limit` per `per`.
"""

from __future__ import annotations

import builtins
import contextlib
import re
import weakref
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from attrs import field, frozen

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._check import shown
from umt_sdk._spi import Backend, RateLimitInfo, RateLimitStore
from umt_sdk.exceptions import TaskDefinitionError, UsageError

__all__ = [
    "MAX_KEY_LENGTH",
    "RateLimit",
    "RateLimits",
    "TokenTake",
    "check_limit_name",
    "check_rate_limit",
    "check_step_rate_limit",
    "ensure_defined",
    "park_slot",
    "rate_limit_fields",
    "rate_limit_key",
    "rate_limit_store",
    "take_tokens",
    "token_interval",
]

I = TypeVar("I")

MAX_KEY_LENGTH = 255
MAX_LIMIT = 1_000_000_000
_NAME = re.compile(r"^[A-Za-z0-9_.:\-/]{1,100}$")
_MICROSECOND = timedelta(microseconds=1)


def check_limit_name(name: object, *, where: str = "RateLimit", argument: str = "name") -> str:
    """A rate limit's name: 1-100 letters, digits and `_ . : - /`, else `UsageError`."""
    if isinstance(name, str) and _NAME.match(name):
        return name
    raise UsageError(
        f"{where}: {argument} must be a rate limit's name, 1-100 characters of letters, "
        f"digits and _ . : - / (such as 'openai'), got {shown(name)}",
        argument=argument,
    )


def _name(_: object, __: object, value: str) -> None:
    check_limit_name(value)


def _limit(_: object, __: object, value: int) -> None:
    check.integer(
        value,
        "limit",
        at_least=1,
        at_most=MAX_LIMIT,
        expected=f"an integer from 1 to {MAX_LIMIT} (tokens per `per`)",
        where="RateLimit",
    )


def _per(_: object, __: object, value: timedelta) -> None:
    check.duration(
        value,
        "per",
        positive=True,
        expected="a timedelta > 0 such as timedelta(minutes=1) (the window `limit` is per)",
        where="RateLimit",
    )
    if value < _MICROSECOND:
        check.refuse("per", "at least one microsecond", value, where="RateLimit")


def _key(_: object, __: object, value: Callable[[Any], str] | None) -> None:
    if value is not None:
        check.function(
            value,
            "key",
            expected="a function of the run's input returning its bucket's key (a str), or None",
            where="RateLimit",
        )


@frozen
class RateLimit(Generic[I]):
    """A named rate limit: at most `limit` tokens per `per`, shared by every worker and host.

    `RateLimit("openai", limit=600, per=timedelta(minutes=1))`. Use it on a task
    (`@task(rate_limit=OPENAI)`: a run starts only with a token; without one it waits,
    pending and unharmed, until the next token is due) or on a step
    (`ctx.step.run("ask", ask, rate_limit=OPENAI)` or `rate_limit="openai"`: the step waits
    for a token before its body runs). The limit is stored by name the first time it is used
    (a stored limit is never overwritten by code: change it with `engine.rate_limits.set`).

    A bucket holds at most `limit` tokens and one comes back every `per / limit`: a burst of
    `limit` at once, then the steady rate (GCRA; see docs/flow-control.md).

    Args:
        name: the limit's name, shared by everything that uses it (1-100 letters, digits and
            `_ . : - /`).
        limit: tokens per `per` (>= 1).
        per: the window (a timedelta > 0).
        key: a function of the run's input returning a str of 1 to 255 characters: each key
            is an independent bucket of the same limit (one per tenant). None: one bucket.
    """

    name: str = field(validator=_name)
    limit: int = field(kw_only=True, validator=_limit)
    per: timedelta = field(kw_only=True, validator=_per)
    key: Callable[[I], str] | None = field(default=None, kw_only=True, validator=_key)


def check_rate_limit(value: object, *, task_name: str) -> RateLimit[Any] | None:
    """`@task(rate_limit=...)`: None or a `RateLimit`."""
    if value is None or isinstance(value, RateLimit):
        return value
    raise TaskDefinitionError(
        f"task {task_name!r}: rate_limit must be a umt_sdk.RateLimit (for example "
        f"RateLimit('openai', limit=600, per=timedelta(minutes=1))) or None, got {shown(value)}",
        argument="rate_limit",
    )


def rate_limit_key(limit: RateLimit[Any], value: Any, *, where: str) -> str:
    """The bucket key of `value` (a run's decoded input) under `limit`; "" without a key
    function."""
    if limit.key is None:
        return ""
    try:
        key = limit.key(value)
    except Exception as exc:
        raise UsageError(
            f"{where}: the key function of rate limit {limit.name!r} raised "
            f"{type(exc).__name__}: {exc}; it must return the bucket's key (a str) for every "
            "input the task accepts",
            argument="input",
        ) from exc
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise UsageError(
            f"{where}: the key function of rate limit {limit.name!r} must return a non-empty "
            f"str of at most {MAX_KEY_LENGTH} characters, got {shown(key)}; convert the value "
            "(str(...)) or shorten it (a hash)",
            argument="input",
        )
    _serde.check_text(key, what="rate limit key")
    return key


def rate_limit_fields(
    limit: RateLimit[Any] | None, *, task_name: str, input_type: Any, input_json: str
) -> dict[str, Any]:
    """The `NewRun` fields of a run of a task with `limit`: the limit's name and the key."""
    if limit is None:
        return {}
    value = _serde.decode(input_json, input_type, what="input") if limit.key else None
    key = rate_limit_key(limit, value, where=f"task {task_name!r}")
    return {"rate_limit": limit.name, "rate_limit_key": key}


def check_step_rate_limit(name: object, rate_limit: object, rate_limit_key: object) -> None:
    """`ctx.step.run(..., rate_limit=, rate_limit_key=)`: a limit's name or a `RateLimit`,
    and a bucket's key (a str of 1 to 255 characters) or None."""
    where = f"step {name!r}"
    if rate_limit is None:
        if rate_limit_key is not None:
            check.refuse(
                "rate_limit_key",
                "None without a rate_limit",
                rate_limit_key,
                where=where,
                hint="name the limit too: rate_limit='openai', rate_limit_key='t7'",
            )
        return
    if not isinstance(rate_limit, RateLimit):
        if not isinstance(rate_limit, str):
            check.refuse(
                "rate_limit",
                "a rate limit's name (such as 'openai') or a umt_sdk.RateLimit, or None",
                rate_limit,
                where=where,
            )
        check_limit_name(rate_limit, where=where, argument="rate_limit")
    elif rate_limit.key is not None and rate_limit_key is None:
        raise UsageError(
            f"{where}: rate limit {rate_limit.name!r} splits its buckets by a key function of "
            "a run's input, which a step does not have; name the step's bucket with "
            "rate_limit_key=... (a str)",
            argument="rate_limit_key",
        )
    if rate_limit_key is not None:
        key = check.text(
            rate_limit_key, "rate_limit_key", empty=False, max_length=MAX_KEY_LENGTH, where=where
        )
        _serde.check_text(key, what="rate_limit_key")


def rate_limit_store(backend: Backend, call: str) -> RateLimitStore:
    """The backend as a `RateLimitStore`, or a `UsageError` that says it cannot do `call`."""
    if isinstance(backend, RateLimitStore):
        return backend
    raise UsageError(
        f"{call} needs a backend that stores rate limits (one that implements "
        f"umt_sdk.backend.RateLimitStore); {type(backend).__name__} does not. Use the memory "
        "or Postgres backend, or implement it (the contract suite checks it)",
        argument="backend",
    )


# -- the rule every store applies ---------------------------------------------------------------


def token_interval(limit: int, per: timedelta) -> timedelta:
    """How often a bucket of `limit` per `per` gets a token back: `per / limit`, rounded up
    to the microsecond (never faster than the limit)."""
    per_us = per // _MICROSECOND
    return timedelta(microseconds=-(-per_us // limit))


@frozen(kw_only=True)
class TokenTake:
    """What one take from a bucket did (`take_tokens`)."""

    taken: int
    """Tokens taken (at most the ones asked for)."""
    tat: datetime
    """The bucket's new theoretical arrival time, to store."""
    next_at: datetime
    """When the bucket next has a free token: at or before now while some are left."""


def take_tokens(
    *, tat: datetime | None, now: datetime, limit: int, per: timedelta, wanted: int
) -> TokenTake:
    """Take up to `wanted` tokens at `now` from a bucket whose stored time is `tat` (None: a
    new bucket, full). The one rule of every store (GCRA):

    - `interval` = `token_interval(limit, per)`; `base` = the later of `tat` and `now`;
    - free tokens = `limit - ceil((base - now) / interval)` (a full bucket has `limit`);
    - taken = the lesser of `wanted` and the free tokens (never below 0);
    - the new `tat` = `base + taken * interval`;
    - the next token is free at `new tat - (limit - 1) * interval`.
    """
    interval = token_interval(limit, per)
    interval_us = interval // _MICROSECOND
    base = now if tat is None or tat < now else tat
    owed_us = (base - now) // _MICROSECOND
    free = limit - (-(-owed_us // interval_us))
    taken = max(0, min(wanted, free))
    new_tat = base + taken * interval
    return TokenTake(taken=taken, tat=new_tat, next_at=new_tat - (limit - 1) * interval)


def park_slot(next_at: datetime, parked_until: datetime | None, interval: timedelta) -> datetime:
    """When a run (or a step) that found no token waits until: the bucket's next token, or one
    interval after the last wait the bucket handed out (`parked_until`, None: none), whichever
    is later. The store keeps the result as the bucket's new `parked_until`, so the runs a
    bucket parks keep their order and each waits for a token of its own (no herd at each
    token, no newcomer ahead of the backlog)."""
    if parked_until is None:
        return next_at
    return max(next_at, parked_until + interval)


# -- the engine's face ----------------------------------------------------------------------------

_DEFINED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
"""Per backend object, the limits this process stored already (`define_rate_limit` is first
write wins, so once is enough: a stored limit is never overwritten by code)."""


async def ensure_defined(backend: Backend, limit: RateLimit[Any], call: str) -> None:
    """Store `limit` unless this process stored it on `backend` already."""
    store = rate_limit_store(backend, call)
    try:
        done = _DEFINED.setdefault(backend, set())
    except TypeError:  # a backend that cannot be weakly referenced: ask every time
        done = set()
    if limit.name in done:
        return
    await store.define_rate_limit(limit.name, limit=limit.limit, per=limit.per)
    done.add(limit.name)


class RateLimits:
    """`engine.rate_limits`: read, change, pause and resume the stored rate limits.

    A change holds at once on every worker and host: the runs a limit parked are claimable
    again and take their tokens by the new rule; tokens already taken stay taken.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def _store(self, call: str) -> RateLimitStore:
        return rate_limit_store(self._backend, f"rate_limits.{call}()")

    async def set(
        self,
        name: str | RateLimit[Any],
        *,
        limit: int | None = None,
        per: timedelta | None = None,
    ) -> RateLimitInfo:
        """Store a limit, or change a stored one: `set("openai", limit=600,
        per=timedelta(minutes=1))` or `set(OPENAI)` (a `RateLimit`, its key function unused).
        Its pause, if any, stays. Returns the stored limit."""
        if isinstance(name, RateLimit):
            if limit is not None or per is not None:
                raise UsageError(
                    "rate_limits.set(rate_limit): a RateLimit carries its limit and per; pass "
                    "either set(RateLimit(...)) or set('name', limit=..., per=...)",
                    argument="limit",
                )
            declared: RateLimit[Any] = name
            name, limit, per = declared.name, declared.limit, declared.per
        else:
            check_limit_name(name, where="rate_limits.set()")
            if limit is None or per is None:
                raise UsageError(
                    f"rate_limits.set({name!r}): give both limit= (tokens per window, >= 1) "
                    "and per= (the window, a timedelta such as timedelta(minutes=1))",
                    argument="limit" if limit is None else "per",
                )
            RateLimit(name, limit=limit, per=per)  # the same checks as a declaration
        info = await self._store("set").set_rate_limit(name, limit=limit, per=per)
        with contextlib.suppress(TypeError):
            _DEFINED.setdefault(self._backend, set()).add(name)
        return info

    async def get(self, name: str) -> RateLimitInfo | None:
        """The stored limit of that name, or None."""
        check_limit_name(name, where="rate_limits.get()")
        return await self._store("get").get_rate_limit(name)

    async def list(self) -> builtins.list[RateLimitInfo]:
        """Every stored limit, by name."""
        return builtins.list(await self._store("list").list_rate_limits())

    async def pause(self, name: str) -> bool:
        """Pause a limit: it gives no token until `resume`; runs and steps that need one wait
        unharmed (a run stays pending, a step's run parks). False when it was paused already.
        An unknown name raises `UsageError`."""
        return await self._pause(name, paused=True, call="pause")

    async def resume(self, name: str) -> bool:
        """Resume a paused limit: the runs it held are claimable at once. False when it was
        not paused. An unknown name raises `UsageError`."""
        return await self._pause(name, paused=False, call="resume")

    async def _pause(self, name: str, *, paused: bool, call: str) -> bool:
        check_limit_name(name, where=f"rate_limits.{call}()")
        store = self._store(call)
        if await store.get_rate_limit(name) is None:
            raise UsageError(
                f"rate_limits.{call}({name!r}): no rate limit of that name is stored; "
                "rate_limits.list() shows them, rate_limits.set(...) stores one",
                argument="name",
            )
        return await store.pause_rate_limit(name, paused=paused)
