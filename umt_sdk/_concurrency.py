"""Concurrency keys: at most `limit` runs of a task with the same key run at once.

The SDK decides, the backend stores and enforces. At enqueue the SDK computes the run's key
from its input (`Concurrency.key`) and passes it with the limit (`NewRun.concurrency_key`,
`concurrency_limit`, `count_waiting`); the backend's claim never takes more runs of a key than
its free slots (see `Backend.claim`). The strategies are the SDK's too: after the enqueue it
requests the cancel of the runs the strategy drops, through `Backend.cancel`, as any caller
would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar
from uuid import UUID

from attrs import field, frozen

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._check import shown
from umt_sdk._spi import TERMINAL_STATUSES, Backend, RunQuery
from umt_sdk.exceptions import TaskDefinitionError, UsageError

__all__ = ["Concurrency", "ConcurrencyStrategy", "apply_strategy", "key_fields"]

I = TypeVar("I")

ConcurrencyStrategy = Literal["queue", "cancel_in_progress", "keep_newest"]
"""What a new run of a key does to the others: wait its turn (`queue`, the default); request
the cancel of the older unfinished runs of its key beyond the newest `limit`, running ones
included (`cancel_in_progress`: the newest work wins); or cancel the older runs of its key that
have not started (`keep_newest`: pending runs other than the newest; running ones finish)."""

STRATEGIES: tuple[str, ...] = ("queue", "cancel_in_progress", "keep_newest")
MAX_KEY_LENGTH = 255
_PAGE = 500


def _key_function(_: object, __: object, value: Callable[[Any], str]) -> None:
    check.function(
        value,
        "key",
        expected="a function of the run's input returning its key (a str)",
        where="Concurrency",
    )


def _limit(_: object, __: object, value: int) -> None:
    check.integer(value, "limit", at_least=1, at_most=1_000_000, where="Concurrency")


def _strategy(_: object, __: object, value: str) -> None:
    check.choice(value, "strategy", STRATEGIES, where="Concurrency")


def _count_waiting(_: object, __: object, value: bool) -> None:
    check.flag(value, "count_waiting", where="Concurrency")


@frozen(kw_only=True)
class Concurrency(Generic[I]):
    """At most `limit` runs of the task with the same key running at once, across workers.

    `@task("report", concurrency=Concurrency(key=lambda inp: inp.tenant_id, limit=2))`: the
    key is computed from the input when a run is enqueued and stored with it; a claim takes a
    run only while fewer than `limit` runs of its key hold a slot. The others wait, pending and
    unharmed, in priority then FIFO order within the key, and never hold up other keys or
    tasks. Keys are per task name (every version shares them); the limit is the one of the
    newest run enqueued for the key.

    Args:
        key: a function of the run's input (the task's input type) returning a str of 1 to 255
            characters. It runs at enqueue, in the enqueuing process.
        limit: how many runs of a key may hold a slot at once (>= 1).
        strategy: what a new run does to the other runs of its key (`ConcurrencyStrategy`):
            `"queue"` (default), `"cancel_in_progress"` or `"keep_newest"`.
        count_waiting: whether a run keeps its slot while it sleeps or waits for a fact. By
            default it gives the slot back and needs a free one to go on.
    """

    key: Callable[[I], str] = field(validator=_key_function)
    limit: int = field(validator=_limit)
    strategy: ConcurrencyStrategy = field(default="queue", validator=_strategy)
    count_waiting: bool = field(default=False, validator=_count_waiting)


def check_concurrency(value: object, *, task_name: str) -> Concurrency[Any] | None:
    """`@task(concurrency=...)`: None or a `Concurrency`."""
    if value is None or isinstance(value, Concurrency):
        return value
    raise TaskDefinitionError(
        f"task {task_name!r}: concurrency must be a umt_sdk.Concurrency (for example "
        f"Concurrency(key=lambda inp: inp.tenant_id, limit=2)) or None, got {shown(value)}",
        argument="concurrency",
    )


def key_fields(
    concurrency: Concurrency[Any] | None, *, task_name: str, input_type: Any, input_json: str
) -> dict[str, Any]:
    """The `NewRun` fields of a run of the task with this input: its key and limit."""
    if concurrency is None:
        return {}
    value = _serde.decode(input_json, input_type, what="input")
    try:
        key = concurrency.key(value)
    except Exception as exc:
        raise UsageError(
            f"task {task_name!r}: its concurrency key function raised "
            f"{type(exc).__name__}: {exc}; it must return the run's key (a str) for every "
            "input the task accepts",
            argument="input",
        ) from exc
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise UsageError(
            f"task {task_name!r}: its concurrency key function must return a non-empty "
            f"str of at most {MAX_KEY_LENGTH} characters, got {shown(key)}; convert the value "
            "(str(...)) or shorten it (a hash)",
            argument="input",
        )
    _serde.check_text(key, what="concurrency key")
    return {
        "concurrency_key": key,
        "concurrency_limit": concurrency.limit,
        "count_waiting": concurrency.count_waiting,
    }


async def apply_strategy(
    backend: Backend,
    concurrency: Concurrency[Any] | None,
    *,
    task_name: str,
    run_id: UUID,
    key: str,
) -> list[UUID]:
    """After `run_id` of `key` was enqueued: request the cancel of the runs its strategy drops.
    Returns the runs asked to cancel. Runs newer than `run_id` are never touched (a later
    enqueue decides for them), so concurrent enqueues of a key agree on who is kept."""
    if concurrency is None or concurrency.strategy == "queue":
        return []
    older: list[tuple[UUID, str]] = []  # newest first (run ids are time-ordered)
    before: UUID | None = run_id
    while True:
        page = await backend.list_runs(
            RunQuery(task_name=task_name, concurrency_key=key, before=before, limit=_PAGE)
        )
        older += [(r.run_id, r.status) for r in page if r.status not in TERMINAL_STATUSES]
        if len(page) < _PAGE:
            break
        before = page[-1].run_id
    if concurrency.strategy == "keep_newest":
        dropped = [rid for rid, status in older if status == "pending"]
        why = "keep_newest: a newer run of the key was enqueued"
    else:
        dropped = [rid for rid, _ in older[concurrency.limit - 1 :]]
        why = "cancel_in_progress: a newer run of the key was enqueued"
    for rid in dropped:
        await backend.cancel(rid, reason=f"concurrency key {key!r}, {why} ({run_id})")
    return dropped
