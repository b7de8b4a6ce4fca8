"""A run's recorded steps as replay reads them: records by name, occurrences, non-determinism.

Pure: no backend, no clock, no telemetry. The step semantics (`_steps`) ask it what a step's
last record is and tell it what they recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from uuid import UUID

from umt_sdk._spi import StepKind, StepRecord
from umt_sdk.exceptions import NonDeterminismError

__all__ = ["History"]


class History:
    """The records of one run by step name, each name's tries in order."""

    def __init__(self, run_id: UUID, records: Iterable[StepRecord]) -> None:
        self._run_id = run_id
        self._records: dict[str, list[StepRecord]] = {}
        for record in records:
            self._records.setdefault(record.name, []).append(record)
        for tries in self._records.values():
            tries.sort(key=lambda r: r.attempt)
        self._occurrences: dict[str, int] = {}

    def occurrence(self, name: str) -> str:
        """The name under which this use of `name` is recorded: the n-th use in one execution
        of the handler is `name#n` (n > 1), so a step called in a loop replays per call."""
        count = self._occurrences.get(name, 0) + 1
        self._occurrences[name] = count
        return name if count == 1 else f"{name}#{count}"

    def calls(self) -> int:
        """How many steps, sleeps, fact waits and child results this execution of the
        handler asked for so far (a replay asks for the same, in the same order)."""
        return sum(self._occurrences.values())

    def asked(self, full: str) -> bool:
        """Whether this execution of the handler has asked for the recorded name `full`
        (`name`, or `name#n`) yet."""
        name, _, count = full.partition("#")
        return self._occurrences.get(name, 0) >= (int(count) if count.isdigit() else 1)

    def unasked(self) -> list[str]:
        """The recorded names this execution of the handler has not asked for yet, in the
        order first recorded (umt's own records included: the caller tells them apart)."""
        return [full for full in self._records if not self.asked(full)]

    def next_occurrence(self, name: str) -> str:
        """The name the next `occurrence(name)` will return, without taking it."""
        count = self._occurrences.get(name, 0) + 1
        return name if count == 1 else f"{name}#{count}"

    def last(self, name: str, kind: StepKind) -> StepRecord | None:
        """The newest record of step `name`, which the code now makes a `kind`; None if the
        step never ran. A record of another kind means the code changed under the run."""
        tries = self._records.get(name)
        if not tries:
            return None
        last = tries[-1]
        if last.kind != kind:
            raise NonDeterminismError(
                f"step {name!r} of run {self._run_id} was recorded as a {last.kind!r} "
                f"but the code now makes it a {kind!r}; bump the task's version for "
                "incompatible changes and keep the old version registered until its runs drain",
                step_name=name,
                recorded_kind=last.kind,
                current_kind=kind,
            )
        return last

    def latest(self) -> Iterator[StepRecord]:
        """Each step's newest record."""
        for tries in self._records.values():
            yield tries[-1]

    def remember(self, record: StepRecord) -> None:
        """A record this execution stored (it replaces the same try of the same step)."""
        tries = self._records.setdefault(record.name, [])
        tries[:] = [r for r in tries if r.attempt != record.attempt]
        tries.append(record)
        tries.sort(key=lambda r: r.attempt)
