"""Retention: which finished runs are deleted, when, and by whom; and the tags runs carry.

The SDK decides (how old, which tasks, how large a batch, when to stop); the store deletes
(`umt_sdk.backend.RetentionStore`): one batch at a time, one pruner at a time across every
process (a batch that finds another pruner at work does nothing and the pass ends), and a
tombstone per pruned run so that its idempotency key stays taken.

The policy comes from `connect(retention=..., idempotency_retention=...)` and from the
`@task(retention=...)` of the tasks the registry knows: a task with its own retention is
pruned by it, every other task by the default. Workers run `Pruner.run_pass` in the
background; `engine.prune` and `umt runs prune` run one prune by hand.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any
from uuid import UUID

from attrs import define, field, frozen

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._definition import TaskDefinition
from umt_sdk._spi import Backend, PruneQuery, RetentionStore
from umt_sdk.exceptions import RunNotFoundError, RunPrunedError, UsageError

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "MAX_TAGS",
    "MAX_TAG_KEY_LENGTH",
    "MAX_TAG_VALUE_LENGTH",
    "PruneReport",
    "Pruner",
    "RetentionPolicy",
    "check_tags",
    "missing_run",
    "retention_store",
]

DEFAULT_BATCH_SIZE = 500
"""Runs deleted per batch: small enough that a batch holds few locks and writes little WAL."""

MAX_TAGS = 16
MAX_TAG_KEY_LENGTH = 64
MAX_TAG_VALUE_LENGTH = 256
_TAG_KEY = re.compile(r"^[A-Za-z0-9_.:\-/]+$")


def check_tags(tags: object, *, where: str = "enqueue()") -> dict[str, str]:
    """The tags of a run: a mapping of at most `MAX_TAGS` keys (letters, digits and `_.:-/`,
    at most `MAX_TAG_KEY_LENGTH` characters) to text values (at most `MAX_TAG_VALUE_LENGTH`
    characters, storable). `UsageError` naming the tag otherwise."""
    if tags is None:
        return {}
    if not isinstance(tags, Mapping):
        check.refuse(
            "tags",
            "a dict of text keys to text values, such as {'tenant': 't7'}",
            tags,
            where=where,
        )
    if len(tags) > MAX_TAGS:
        raise UsageError(
            f"{where}: tags takes at most {MAX_TAGS} tags, got {len(tags)}; put what you filter "
            "by in tags and the rest in the input",
            argument="tags",
        )
    checked: dict[str, str] = {}
    for key, value in tags.items():
        if (
            not isinstance(key, str)
            or not key
            or len(key) > MAX_TAG_KEY_LENGTH
            or not _TAG_KEY.match(key)
        ):
            check.refuse(
                "tags",
                f"tag keys of 1 to {MAX_TAG_KEY_LENGTH} letters, digits or _.:-/ "
                "(such as 'tenant')",
                key,
                where=where,
            )
        if not isinstance(value, str) or len(value) > MAX_TAG_VALUE_LENGTH:
            check.refuse(
                "tags",
                f"tag values that are text of at most {MAX_TAG_VALUE_LENGTH} characters "
                f"(tag {key!r})",
                value,
                where=where,
                hint="convert numbers with str(...)" if isinstance(value, int | float) else "",
            )
        problem = _serde.unstorable_reason(value)
        if problem is not None:
            raise UsageError(
                f"{where}: tags: the value of tag {key!r} cannot be stored: it {problem}",
                argument="tags",
            )
        checked[key] = value
    return checked


def retention_store(backend: Backend, what: str) -> RetentionStore:
    """The backend as a `RetentionStore`, or a `UsageError` saying that it cannot prune."""
    if isinstance(backend, RetentionStore):
        return backend
    raise UsageError(
        f"{what}: the {type(backend).__name__} backend does not delete runs (it does not "
        "implement umt_sdk.backend.RetentionStore); its runs are kept",
        argument="retention",
    )


async def missing_run(backend: Backend, run_id: UUID) -> RunNotFoundError:
    """The error for a run the store does not hold: `RunPrunedError` when retention deleted it
    (its tombstone says when), else `RunNotFoundError`."""
    if isinstance(backend, RetentionStore):
        tombstone = await backend.get_pruned(run_id)
        if tombstone is not None:
            return RunPrunedError(
                f"run {run_id} ({tombstone.task_name}@{tombstone.task_version}) finished "
                f"{tombstone.status} at {tombstone.finished_at.isoformat()} and was deleted "
                f"by retention at {tombstone.pruned_at.isoformat()}; only its tombstone "
                "is kept (see docs/retention.md)",
                run_id=run_id,
                status=tombstone.status,
                finished_at=tombstone.finished_at,
                pruned_at=tombstone.pruned_at,
            )
    return RunNotFoundError(f"no run {run_id}", run_id=run_id)


@frozen(kw_only=True)
class PruneReport:
    """What `engine.prune` did (or, with `dry_run`, would do)."""

    pruned: int
    """Runs deleted; with `dry_run`, runs that a prune would delete now."""
    batches: int
    """Batches that deleted something (0 for a dry run)."""
    dry_run: bool
    busy: bool = False
    """Another pruner (a worker) was deleting at the same time: it goes on with the rest."""


@frozen(kw_only=True)
class RetentionPolicy:
    """How long finished runs and the tombstones of pruned runs are kept."""

    default: timedelta | None = None
    """Finished runs older than this are deleted (None: kept for ever)."""
    per_task: Mapping[str, timedelta] = field(factory=dict)
    """Task name -> its own retention (`@task(retention=...)`), which wins over `default`."""
    idempotency: timedelta | None = None
    """Tombstones (and so the idempotency keys of pruned runs) older than this are dropped
    (None: kept for ever, so a key never becomes free again)."""
    batch_size: int = DEFAULT_BATCH_SIZE

    @property
    def active(self) -> bool:
        """Whether there is anything for a worker to do."""
        return bool(self.default or self.per_task or self.idempotency)

    @classmethod
    def build(
        cls,
        registry: Iterable[TaskDefinition[Any, Any]],
        *,
        default: timedelta | None,
        idempotency: timedelta | None,
    ) -> RetentionPolicy:
        """The policy of `connect`: its options, and the retention each task of the registry
        declares (the longest of its versions, when they differ)."""
        per_task: dict[str, timedelta] = {}
        for definition in registry:
            own = definition.retention
            if own is not None:
                per_task[definition.name] = max(own, per_task.get(definition.name, own))
        return cls(default=default, per_task=per_task, idempotency=idempotency)


def check_retention(value: object, argument: str) -> timedelta | None:
    """A retention option: None or a positive timedelta."""
    if value is None:
        return None
    return check.duration(
        value,
        argument,
        positive=True,
        expected="a timedelta > 0 such as timedelta(days=30), or None to keep for ever",
        where="connect()",
    )


@define(eq=False)
class Pruner:
    """Deletes old finished runs through a `RetentionStore`, batch by batch."""

    store: RetentionStore
    policy: RetentionPolicy

    async def prune(
        self,
        *,
        older_than: timedelta,
        task_names: Sequence[str] | None = None,
        exclude_task_names: Sequence[str] = (),
        dry_run: bool = False,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_batches: int | None = None,
    ) -> PruneReport:
        """Delete every run prunable now, `batch_size` at a time, until none is left, another
        pruner is at work (`busy`), or `max_batches` batches are done."""
        query = PruneQuery(
            older_than=older_than,
            task_names=None if task_names is None else list(task_names),
            exclude_task_names=list(exclude_task_names),
            limit=batch_size,
        )
        if dry_run:
            count = await self.store.count_prunable(query)
            return PruneReport(pruned=count, batches=0, dry_run=True)
        pruned = batches = 0
        while max_batches is None or batches < max_batches:
            batch = await self.store.prune_runs(query)
            if batch.busy:
                return PruneReport(pruned=pruned, batches=batches, dry_run=False, busy=True)
            if batch.pruned:
                pruned += batch.pruned
                batches += 1
            if batch.pruned < batch_size:
                break
        return PruneReport(pruned=pruned, batches=batches, dry_run=False)

    async def run_pass(self, *, max_batches: int = 100) -> dict[str, Any]:
        """One background pass: each task with its own retention, then every other task by
        the default, then the tombstones. Returns what it did, for the log."""
        policy = self.policy
        done: dict[str, Any] = {"pruned": 0, "forgotten": 0, "busy": False}
        for name, older_than in sorted(policy.per_task.items()):
            report = await self.prune(
                older_than=older_than,
                task_names=[name],
                batch_size=policy.batch_size,
                max_batches=max_batches,
            )
            done["pruned"] += report.pruned
            if report.busy:
                done["busy"] = True
                return done
        if policy.default is not None:
            report = await self.prune(
                older_than=policy.default,
                exclude_task_names=sorted(policy.per_task),
                batch_size=policy.batch_size,
                max_batches=max_batches,
            )
            done["pruned"] += report.pruned
            if report.busy:
                done["busy"] = True
                return done
        if policy.idempotency is not None:
            for _ in range(max_batches):
                batch = await self.store.forget_pruned(
                    older_than=policy.idempotency, limit=policy.batch_size
                )
                done["forgotten"] += batch.pruned
                if batch.busy:
                    done["busy"] = True
                    break
                if batch.pruned < policy.batch_size:
                    break
        return done
