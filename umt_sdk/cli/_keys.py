"""`umt enqueue`'s keys that shape the flow: `--singleton`, `--debounce`, `--sequence`.

Checked before anything is stored or a database is opened, with the engine's own rules
(`Singleton`, `Debounce` and the checks `enqueue` makes of them together with the other
arguments); a refusal is one line naming the option, exit 2.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from umt_sdk._definition import TaskDefinition
from umt_sdk._flow_keys import Debounce, Singleton, flow_key_fields
from umt_sdk.cli._app import InputError
from umt_sdk.exceptions import UsageError

__all__ = ["flow_key_options"]

_OPTION_OF_ARGUMENT = {
    "singleton": "--singleton",
    "mode": "--singleton-mode",
    "debounce": "--debounce",
    "period": "--debounce-period",
    "max_wait": "--debounce-max-wait",
    "sequence": "--sequence",
    "delay": "--delay",
    "start_within": "--start-within",
    "idempotency_key": "--idempotency-key",
}


def _refused(exc: UsageError, default: str) -> InputError:
    option = _OPTION_OF_ARGUMENT.get(exc.argument, default)
    return InputError(f"{option}: {exc}")


def flow_key_options(
    definition: TaskDefinition[Any, Any],
    *,
    singleton: str | None,
    singleton_mode: str | None,
    debounce: str | None,
    debounce_period: timedelta | None,
    debounce_max_wait: timedelta | None,
    sequence: str | None,
    idempotency_key: str | None,
    delay: timedelta | None,
    start_within: timedelta | None,
) -> dict[str, Any]:
    """The `singleton=`, `debounce=` and `sequence=` arguments of `engine.enqueue` that the
    options give; `InputError` naming the option for anything `enqueue` would refuse."""
    if singleton_mode is not None and singleton is None:
        raise InputError("--singleton-mode needs --singleton KEY")
    if debounce is None and (debounce_period is not None or debounce_max_wait is not None):
        given = "--debounce-period" if debounce_period is not None else "--debounce-max-wait"
        raise InputError(f"{given} needs --debounce KEY")
    if debounce is not None and debounce_period is None:
        raise InputError(
            "--debounce needs --debounce-period DURATION (the quiet time after the last "
            "trigger, such as 5s)"
        )
    keys: dict[str, Any] = {}
    try:
        if singleton is not None:
            keys["singleton"] = Singleton(singleton, mode=singleton_mode or "skip")  # type: ignore[arg-type]  # a click.Choice of the modes
        if debounce is not None:
            assert debounce_period is not None
            keys["debounce"] = Debounce(debounce, debounce_period, debounce_max_wait)
        if sequence is not None:
            keys["sequence"] = sequence
    except UsageError as exc:
        raise _refused(exc, "--singleton" if singleton is not None else "--debounce") from exc
    try:
        flow_key_fields(
            task_name=definition.name,
            concurrency=definition.concurrency,
            singleton=keys.get("singleton"),
            debounce=keys.get("debounce"),
            sequence=keys.get("sequence"),
            idempotency_key=idempotency_key,
            delay=delay,
            start_within=start_within,
            conn=None,
        )
    except UsageError as exc:
        raise _refused(exc, "--sequence") from exc
    return keys
