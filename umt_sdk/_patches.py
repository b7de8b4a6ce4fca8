"""Patches: changing a task's code under the runs already in flight, within one version.

`ctx.patched("new-fraud-check")` chooses between the old code and the new at one point of a
handler, the same way on every execution of a run. The rule is Temporal's (`patched`), said in
umt's terms of named records:

- a run whose history holds the patch's marker (a step record `umt.patch:<id>`) took the new
  code there before: True, on every replay;
- else, a run whose history holds a record this execution has not replayed yet was already
  past this point, on code without the patch: False, and nothing is recorded (the records
  past the point never go away, so every later execution decides False again);
- else the run reaches the point for the first time, on code that has the patch: the marker is
  recorded, then True.

`ctx.deprecate_patch(id)` is for the release after, once no live run takes the old branch: the
code keeps only the new branch, and still records the marker for new runs, so that workers
of the previous release (which still ask `patched(id)`) take the new branch on these runs
too. A marker the code no longer asks for is passed over by a replay. Compensation
bookkeeping (`umt.compensating`, `umt.compensate:<step>`) comes after the handler and never
counts as "past the point"; a compensation's registration counts as its step.

One patch id marks one point of a run: the same call site asked again (a loop) gets the
decision already made; another call site with the same id is refused with `UsageError`
before anything is stored.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Generator
from typing import Any, NoReturn

from umt_sdk._history import History
from umt_sdk._sagas import COMPENSATE_PREFIX, COMPENSATION_PREFIX, umt_record
from umt_sdk.exceptions import UsageError

__all__ = [
    "PATCH_PREFIX",
    "CallSite",
    "PatchCheck",
    "PatchDecisions",
    "is_marker",
    "marker_envelope",
    "marker_name",
    "patch_of_marker",
    "went_past",
]

PATCH_PREFIX = "umt.patch:"
"""A patch's marker: the step record `umt.patch:<id>`, stored when a run takes the new code."""

CallSite = tuple[str, int]
"""Where a patch is asked: (file, line) of the handler's call."""


def marker_name(patch_id: str) -> str:
    return f"{PATCH_PREFIX}{patch_id}"


def is_marker(name: str) -> bool:
    return name.startswith(PATCH_PREFIX)


def patch_of_marker(name: str) -> str:
    """The patch id of the marker `name` (`umt.patch:<id>`)."""
    return name[len(PATCH_PREFIX) :]


def marker_envelope(patch_id: str, *, deprecated: bool) -> str:
    """The marker's stored output: which patch, and whether `deprecate_patch` recorded it."""
    return json.dumps({"umt_patch": patch_id, "deprecated": deprecated}, separators=(",", ":"))


def went_past(history: History) -> bool:
    """The run holds a record this execution has not replayed yet: it was past this point
    before (on the code it ran then)."""
    for name in history.unasked():
        if name == "umt.compensating" or name.startswith(COMPENSATE_PREFIX):
            continue  # made after the handler gave up: not a point of the handler
        if name.startswith(COMPENSATION_PREFIX):
            if history.asked(name[len(COMPENSATION_PREFIX) :]):
                continue  # its step is replayed already: it stands where its step does
            return True
        if umt_record(name):  # pragma: no cover - the two cases above are all of them
            continue
        return True
    return False


class PatchDecisions:
    """The patches one execution asked for: where, and what was decided."""

    def __init__(self) -> None:
        self._decided: dict[str, tuple[CallSite, str, bool]] = {}

    def known(self, patch_id: str, site: CallSite, call: str) -> bool | None:
        """The decision already made for `patch_id` at `site`; None if none was made. The
        same id asked at another site (or by the other call) is refused, nothing stored."""
        seen = self._decided.get(patch_id)
        if seen is None:
            return None
        where, how, decision = seen
        if where != site or how != call:
            raise UsageError(
                f"patch {patch_id!r} is asked by {call}() at {_shown_site(site)} but was "
                f"asked by {how}() at {_shown_site(where)} in this run already: a patch id "
                "marks one point of a task; give each point its own id",
                argument="patch_id",
            )
        return decision

    def decisions(self) -> dict[str, bool]:
        """Every patch asked so far, by id, and its decision."""
        return {patch_id: decided for patch_id, (_, _, decided) in self._decided.items()}

    def decide(self, patch_id: str, site: CallSite, call: str, decision: bool) -> bool:
        self._decided[patch_id] = (site, call, decision)
        return decision


def _shown_site(site: CallSite) -> str:
    return f"{site[0]}:{site[1]}"


class PatchCheck:
    """What `ctx.patched(id)` returns in an async task: await it for the decision. Taking its
    truth without `await` is refused (a coroutine is always true: the old branch would be
    dropped silently)."""

    __slots__ = ("_decide", "_patch_id")

    def __init__(self, patch_id: str, decide: Callable[[], Coroutine[Any, Any, bool]]) -> None:
        self._patch_id = patch_id
        self._decide = decide

    def __await__(self) -> Generator[Any, None, bool]:
        return self._decide().__await__()

    def __bool__(self) -> NoReturn:
        raise UsageError(
            f"ctx.patched({self._patch_id!r}) was used without await: in an async task write "
            f"`if await ctx.patched({self._patch_id!r}):`",
            argument="patch_id",
        )

    def __repr__(self) -> str:
        return f"<PatchCheck {self._patch_id!r} (await it)>"
