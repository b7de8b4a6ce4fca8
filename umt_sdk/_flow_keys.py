"""Keys that shape the flow at enqueue: singletons.

The SDK decides, the backend stores. A singleton reuses the concurrency-key machinery
(`umt_sdk._concurrency`): its key is the run's concurrency key with a limit of 1 that holds
its slot through sleeps and waits (`count_waiting`), so the claim starts one run of the key
at a time, as it does for any key. What it adds is decided at the enqueue, under a lock of
the key in the backend (`NewRun.singleton`):

- `Singleton(key, mode="skip")`: a key with a run that is not terminal stores nothing and
  returns that run; `mode="replace"` stores the new run and the SDK then cancels the key's
  runs that were active when it was stored (as `cancel_in_progress` does, but with the runs
  the backend found under the lock, so concurrent replaces keep exactly the last one).
"""

from __future__ import annotations

from typing import Any, Literal

from attrs import field, frozen

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._concurrency import MAX_KEY_LENGTH, Concurrency
from umt_sdk.exceptions import UsageError

__all__ = ["Singleton", "SingletonMode", "flow_key_fields"]

SingletonMode = Literal["skip", "replace"]
"""What a new trigger of a singleton key does while a run of the key is active (not
terminal): `"skip"` stores nothing and returns that run's handle; `"replace"` cancels it and
stores the new run, which starts once the old one has stopped."""

MODES: tuple[str, ...] = ("skip", "replace")


def _key(where: str) -> Any:
    def validate(_: object, __: object, value: object) -> None:
        check.text(
            value,
            "key",
            empty=False,
            max_length=MAX_KEY_LENGTH,
            expected=f"a non-empty str of at most {MAX_KEY_LENGTH} characters",
            where=where,
        )
        _serde.check_text(value, what=f"{where} key")  # type: ignore[arg-type]

    return validate


def _mode(_: object, __: object, value: object) -> None:
    check.choice(value, "mode", MODES, where="Singleton")


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


def flow_key_fields(
    *,
    task_name: str,
    concurrency: Concurrency[Any] | None,
    singleton: object,
    idempotency_key: str | None,
    conn: object,
) -> dict[str, Any]:
    """The `NewRun` fields for `enqueue(singleton=)`, after checking
    them together with the other arguments; `UsageError` naming the argument otherwise."""
    if singleton is not None and not isinstance(singleton, Singleton):
        check.refuse("singleton", "a umt_sdk.Singleton (Singleton('key')) or None", singleton)
    if singleton is None:
        return {}
    argument = "singleton"
    if idempotency_key is not None:
        raise UsageError(
            f"{argument}= cannot be combined with idempotency_key=: the {argument} key "
            "already decides which run a trigger gives back; use one or the other",
            argument=argument,
        )
    if conn is not None:
        raise UsageError(
            f"{argument}= cannot be used with conn=: it decides under a lock of its key in "
            "the engine's own transaction; enqueue without conn=",
            argument="conn",
        )
    if concurrency is not None:
        raise UsageError(
            f"task {task_name!r} has concurrency=, and {argument}= makes its own concurrency "
            f"key (limit 1): a run has one key; drop {argument}= or the task's concurrency",
            argument=argument,
        )
    assert isinstance(singleton, Singleton)
    return {
        "concurrency_key": singleton.key,
        "concurrency_limit": 1,
        "count_waiting": True,
        "singleton": singleton.mode,
    }
