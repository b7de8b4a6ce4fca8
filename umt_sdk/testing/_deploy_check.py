"""The deploy check (`umt check`): before a release ships, replay the histories of every live
run against its code, and name each run it would break.

A live run (`pending`, `running`, `waiting`) resumes on the new code: it replays its recorded
steps by name and goes on. The check replays each one with the `Replayer` (no side effects,
no step body) and reports every run that would hit non-determinism (a step renamed,
reordered, changed in kind, or a task and version the release no longer registers) and every
recorded step output that no longer decodes into the step's current return type, or decodes
into another value (type drift: the run would resume with something else than it recorded).
It also says, per patch, which runs still take the old branch of `ctx.patched` (`unpatched`):
when none does, the patch can become `ctx.deprecate_patch`.

The histories come from the engine's store (`live_histories`) or from files exported with
`umt runs export` (`read_histories`: a `.jsonl` file, or a directory of them).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from uuid import UUID

from attrs import frozen

from umt_sdk._engine import Engine
from umt_sdk._export import RunHistory
from umt_sdk._spi import RunStatus
from umt_sdk._task import Registry
from umt_sdk.exceptions import PayloadError, RunNotFoundError, UsageError
from umt_sdk.testing._replay import Replayer, ReplayResult

__all__ = ["LIVE_STATUSES", "DeployCheck", "check_deploy", "live_histories", "read_histories"]

LIVE_STATUSES: tuple[RunStatus, ...] = ("pending", "running", "waiting")
"""The statuses of runs that will still execute code: the ones a deploy must not break."""

_PAGE = 500
_READERS = 16
"""Histories read at once from the store (each one read of a run and its steps)."""


@frozen(kw_only=True)
class DeployCheck:
    """The outcome of a deploy check: one `ReplayResult` per run checked, in the order given."""

    results: tuple[ReplayResult, ...]

    @property
    def ok(self) -> bool:
        """True when no run would break: ship it."""
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> tuple[ReplayResult, ...]:
        """The runs the release would break (non-determinism, type drift, not registered)."""
        return tuple(r for r in self.results if not r.ok)

    def pairs(self) -> dict[str, int]:
        """How many runs were checked per `task@version`."""
        return dict(sorted(Counter(f"{r.task}@{r.version}" for r in self.results).items()))

    def unpatched(self, patch_id: str) -> tuple[ReplayResult, ...]:
        """The runs whose replay took the old branch of `ctx.patched(patch_id)`: while any is
        live, the old branch must stay."""
        return tuple(r for r in self.results if r.patches.get(patch_id) is False)

    def summary(self) -> str:
        """One line: how many runs of which pairs were checked, and how many would break."""
        pairs = ", ".join(f"{pair} ({count})" for pair, count in self.pairs().items())
        checked = f"checked {len(self.results)} run(s)" + (f" of {pairs}" if pairs else "")
        broken = len(self.failures)
        if broken:
            return f"{checked}: {broken} would break on this code"
        return f"{checked}: every one replays on this code"


async def check_deploy(registry: Registry, histories: Iterable[RunHistory]) -> DeployCheck:
    """Replay each history against `registry` (the code about to ship) and collect the
    outcome: non-determinism, type drift, unregistered pairs, and the patches' decisions."""
    replayer = Replayer(registry)
    return DeployCheck(results=tuple(await replayer.replay_many(histories)))


async def live_histories(
    engine: Engine,
    *,
    task_name: str | None = None,
    version: int | None = None,
    statuses: Sequence[RunStatus] = LIVE_STATUSES,
) -> list[RunHistory]:
    """The histories of the runs in `statuses` (the live ones by default), of one task (and
    version) or of all, oldest first. A run that ends and is pruned while this reads is left
    out."""
    found: set[UUID] = set()
    for status in statuses:
        cursor: UUID | None = None
        while True:
            page = await engine.list(
                task_name=task_name, version=version, status=status, limit=_PAGE, before=cursor
            )
            found.update(r.run_id for r in page.runs)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    readers = asyncio.Semaphore(_READERS)

    async def read(run_id: UUID) -> RunHistory | None:
        async with readers:
            try:
                return await engine.export_history(run_id)
            except RunNotFoundError:
                return None

    read_all = await asyncio.gather(*(read(run_id) for run_id in sorted(found)))
    return [history for history in read_all if history is not None]


def read_histories(path: str | Path) -> list[RunHistory]:
    """The histories in a `.jsonl` file from `umt runs export`, or in every `*.jsonl` file of
    a directory (sorted by name). `PayloadError` names the file, line and field of anything
    that is not a history; `UsageError` a path that is neither."""
    where = Path(path)
    if where.is_dir():
        files = sorted(where.glob("*.jsonl"))
        if not files:
            raise UsageError(f"{where} holds no *.jsonl history file", argument="path")
    elif where.is_file():
        files = [where]
    else:
        raise UsageError(f"{where} is neither a history file nor a directory", argument="path")
    histories: list[RunHistory] = []
    for file in files:
        try:
            text = file.read_bytes()
        except OSError as exc:
            raise PayloadError(f"{file}: cannot be read: {exc}") from exc
        histories += RunHistory.from_jsonl(text, source=str(file))
    return histories
