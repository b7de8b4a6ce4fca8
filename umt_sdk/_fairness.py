"""Fairness keys: within a task, the keys' runs take turns, weighted, in the claim.

`enqueue(task, input, fairness_key="tenant-7", weight=2)`. The SDK decides, the backend stores
and orders. A fairness key is a concurrency key (`umt_sdk._concurrency`) with no slot limit
(`FAIR_SLOTS`, a limit no key reaches) and a weight (`NewRun.fairness_weight`): the claim
already serves a task's keys least recently served first; for a fairness key it also places the
key's due runs as if they became ready when the key was last served, not when they were
enqueued, and takes at most `weight` of them per claim. So 100,000 runs of one tenant delay
another tenant's run by one turn at most, and a key of weight 3 gets three runs for each of a
key of weight 1 while both have a backlog.

A run has one key: a fairness key is refused beside the task's `concurrency=` and beside
`singleton=` and `sequence=` (their keys already take turns, with a limit). Keys are per task
name and share the namespace of its concurrency keys; the newest enqueue's weight is the key's.
"""

from __future__ import annotations

from typing import Any

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._concurrency import MAX_KEY_LENGTH, Concurrency
from umt_sdk.exceptions import UsageError

__all__ = ["FAIR_SLOTS", "MAX_WEIGHT", "fairness_fields"]

FAIR_SLOTS = 2_147_483_647
"""The slot limit stored for a fairness key: the largest a backend's 32-bit counter holds, so
no key ever fills (a fairness key orders, it does not limit)."""

MAX_WEIGHT = 1000
"""The most runs one turn of a key may take (a claim reads at most that many of a key)."""


def fairness_fields(
    *,
    task_name: str,
    fairness_key: object,
    weight: object,
    concurrency: Concurrency[Any] | None,
    flow: dict[str, Any],
) -> dict[str, Any]:
    """The `NewRun` fields of `enqueue(fairness_key=, weight=)`, after checking them with the
    task's concurrency and the flow-key fields (`flow_key_fields`' result) of the enqueue;
    `UsageError` naming the argument otherwise, before anything is stored."""
    if weight is not None:
        check.integer(
            weight,
            "weight",
            at_least=1,
            at_most=MAX_WEIGHT,
            expected=f"an integer from 1 to {MAX_WEIGHT} (the runs a turn of the key takes)",
        )
    if fairness_key is None:
        if weight is not None:
            raise UsageError(
                "weight= needs fairness_key=: a weight is the share of a fairness key's turns; "
                "give the run's key (fairness_key='tenant-7') or drop weight=",
                argument="weight",
            )
        return {}
    key = check.text(
        fairness_key,
        "fairness_key",
        empty=False,
        max_length=MAX_KEY_LENGTH,
        expected=f"a non-empty str of at most {MAX_KEY_LENGTH} characters, or None",
    )
    _serde.check_text(key, what="fairness key")
    if concurrency is not None:
        raise UsageError(
            f"task {task_name!r} has concurrency=, whose key already takes turns with the "
            "task's other keys: a run has one key; drop fairness_key= or the task's concurrency",
            argument="fairness_key",
        )
    if "concurrency_key" in flow:
        other = "singleton" if "singleton" in flow else "sequence"
        raise UsageError(
            f"fairness_key= cannot be combined with {other}=: {other}= makes the run's key "
            "(limit 1), which already takes turns with the task's other keys; use one of them",
            argument="fairness_key",
        )
    return {
        "concurrency_key": key,
        "concurrency_limit": FAIR_SLOTS,
        "fairness_weight": 1 if weight is None else weight,
    }
