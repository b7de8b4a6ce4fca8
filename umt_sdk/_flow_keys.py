"""Keys that shape the flow at enqueue: singletons, debounce and per-key FIFO (`sequence`).

The SDK decides, the backend stores. All three reuse the concurrency-key machinery
(`umt_sdk._concurrency`) where they limit what runs: a singleton's key and a sequence's key
are the run's concurrency key with a limit of 1 that holds its slot through sleeps and waits
(`count_waiting`), so the claim starts one run of the key at a time, as it does for any key.
What they add is decided at the enqueue, under a lock of the key in the backend
(`NewRun.singleton`, `NewRun.debounce_key`):

- `Singleton(key, mode="skip")`: a key with a run that is not terminal stores nothing and
  returns that run; `mode="replace"` stores the new run and the SDK then cancels the key's
  runs that were active when it was stored (as `cancel_in_progress` does, but with the runs
  the backend found under the lock, so concurrent replaces keep exactly the last one).
- `Debounce(key, period, max_wait)`: the key's run that has not started yet takes the new
  input and waits `period` again, never past `max_wait` after the first trigger; without one,
  a run is stored that waits `period`.
- `sequence=key`: only the concurrency key (limit 1, FIFO by enqueue within a priority).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from attrs import field, frozen

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._concurrency import MAX_KEY_LENGTH, Concurrency
from umt_sdk.exceptions import UsageError

__all__ = ["Debounce", "Singleton", "SingletonMode", "flow_key_fields", "per_input"]

SingletonMode = Literal["skip", "replace"]
"""What a new trigger of a singleton key does while a run of the key is active (not
terminal): `"skip"` stores nothing and returns that run's handle; `"replace"` cancels it and
stores the new run, which starts once the old one has stopped."""

MODES: tuple[str, ...] = ("skip", "replace")


def _key(where: str) -> Any:
    def validate(_: object, __: object, value: object) -> None:
        text = check.text(
            value,
            "key",
            empty=False,
            max_length=MAX_KEY_LENGTH,
            expected=f"a non-empty str of at most {MAX_KEY_LENGTH} characters",
            where=where,
        )
        _serde.check_text(text, what=f"{where} key")

    return validate


def _mode(_: object, __: object, value: object) -> None:
    check.choice(value, "mode", MODES, where="Singleton")


def _period(_: object, __: object, value: timedelta) -> None:
    check.duration(
        value,
        "period",
        positive=True,
        expected="a timedelta > 0 such as timedelta(seconds=5)",
        where="Debounce",
    )


def _max_wait(instance: Debounce, _: object, value: timedelta | None) -> None:
    if value is None:
        return
    check.duration(
        value,
        "max_wait",
        positive=True,
        expected="a timedelta >= period such as timedelta(minutes=1), or None",
        where="Debounce",
    )
    if value < instance.period:
        raise UsageError(
            f"Debounce: max_wait ({value}) is shorter than period ({instance.period}): "
            "max_wait bounds the delay from the first trigger, so it must be at least one "
            "period; give max_wait >= period, or None for no bound",
            argument="max_wait",
        )


@frozen
class Singleton:
    """At most one active run of the task per key: `enqueue(..., singleton=Singleton(key))`.

    While a run of the key is not terminal (pending, running or waiting), a new trigger with
    `mode="skip"` (the default) stores nothing and returns the active run's handle
    (`created=False`); with `mode="replace"` it cancels the active run and stores the new
    one, which starts once the old one has stopped. Concurrent triggers are serialized per
    key in the backend: two never both store a run with `"skip"`, and with `"replace"` only
    the last stored survives. The key is the run's concurrency key (limit 1), per task name.

    Args:
        key: 1 to 255 characters, stored in clear (derive it from an identifier).
        mode: `"skip"` or `"replace"` (`SingletonMode`).
    """

    key: str = field(validator=_key("Singleton"))
    mode: SingletonMode = field(default="skip", validator=_mode)


@frozen
class Debounce:
    """Collapse a burst of triggers into one run: `enqueue(..., debounce=Debounce(key, p))`.

    The first trigger of a key stores a run that starts after `period`; each trigger within
    that time gives the run its input (the last one wins) and restarts the wait, but the run
    starts at the latest `max_wait` after the first trigger. Once the run has started, the
    next trigger stores a new run. Keys are per task name and version.

    Args:
        key: 1 to 255 characters, stored in clear.
        period: the quiet time after the last trigger before the run starts (> 0).
        max_wait: the longest delay from the first trigger (>= period); None: no bound.
    """

    key: str = field(validator=_key("Debounce"))
    period: timedelta = field(validator=_period)
    max_wait: timedelta | None = field(default=None, validator=_max_wait)


def flow_key_fields(
    *,
    task_name: str,
    concurrency: Concurrency[Any] | None,
    singleton: object,
    debounce: object,
    sequence: object,
    idempotency_key: str | None,
    delay: timedelta | None,
    start_within: timedelta | None,
    conn: object,
) -> dict[str, Any]:
    """The `NewRun` fields for `enqueue(singleton=, debounce=, sequence=)`, after checking
    them together with the other arguments; `UsageError` naming the argument otherwise."""
    if singleton is not None and not isinstance(singleton, Singleton):
        check.refuse("singleton", "a umt_sdk.Singleton (Singleton('key')) or None", singleton)
    if debounce is not None and not isinstance(debounce, Debounce):
        check.refuse(
            "debounce",
            "a umt_sdk.Debounce (Debounce('key', timedelta(seconds=5))) or None",
            debounce,
        )
    if sequence is not None:
        check.text(
            sequence,
            "sequence",
            empty=False,
            max_length=MAX_KEY_LENGTH,
            expected=f"a non-empty str of at most {MAX_KEY_LENGTH} characters, or None",
        )
        assert isinstance(sequence, str)
        _serde.check_text(sequence, what="sequence key")
    arguments = {"singleton": singleton, "debounce": debounce, "sequence": sequence}
    given = [name for name, value in arguments.items() if value is not None]
    if not given:
        return {}
    if len(given) > 1:
        raise UsageError(
            f"{given[1]}= cannot be combined with {given[0]}=: each decides on its own when a "
            "run of its key is stored and started; use one of them per enqueue",
            argument=given[1],
        )
    argument = given[0]
    if idempotency_key is not None and argument != "sequence":
        raise UsageError(
            f"{argument}= cannot be combined with idempotency_key=: the {argument} key "
            "already decides which run a trigger gives back; use one or the other",
            argument=argument,
        )
    if conn is not None and argument != "sequence":
        raise UsageError(
            f"{argument}= cannot be used with conn=: it decides under a lock of its key in "
            "the engine's own transaction; enqueue without conn=",
            argument="conn",
        )
    if isinstance(debounce, Debounce):
        if delay is not None:
            raise UsageError(
                "delay= cannot be combined with debounce=: the debounce's period is the delay",
                argument="delay",
            )
        if start_within is not None:
            raise UsageError(
                "start_within= cannot be combined with debounce=: each trigger moves the run's "
                "start, which a start deadline would race",
                argument="start_within",
            )
        return {
            "delay": debounce.period,
            "debounce_key": debounce.key,
            "debounce_max_wait": debounce.max_wait,
        }
    if concurrency is not None:
        raise UsageError(
            f"task {task_name!r} has concurrency=, and {argument}= makes its own concurrency "
            f"key (limit 1): a run has one key; drop {argument}= or the task's concurrency",
            argument=argument,
        )
    key = singleton.key if isinstance(singleton, Singleton) else sequence
    fields: dict[str, Any] = {
        "concurrency_key": key,
        "concurrency_limit": 1,
        "count_waiting": True,
    }
    if isinstance(singleton, Singleton):
        fields["singleton"] = singleton.mode
    return fields


def per_input(value: object, argument: str, count: int, one: type | tuple[type, ...]) -> list[Any]:
    """`enqueue_many`'s `singleton=`, `debounce=` or `sequence=`, one per input: None (none
    for any), one value (`one`'s type: the same for every input), or a sequence with one
    value (or None) per input; `UsageError` naming `argument` otherwise. The values
    themselves are checked by `flow_key_fields`."""
    if value is None:
        return [None] * count
    if isinstance(value, one):
        return [value] * count
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        shown_type = one.__name__ if isinstance(one, type) else one[0].__name__
        check.refuse(
            argument,
            f"a {shown_type} (the same for every input), a list of them with one per input "
            "(None for none), or None",
            value,
        )
    values = list(value)
    if len(values) != count:
        raise UsageError(
            f"{argument} has {len(values)} values for {count} inputs: give one per input "
            "(None for none), or one value for all",
            argument=argument,
        )
    return values
