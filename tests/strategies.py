"""Shared Hypothesis strategies (and the records they build) for the property tests."""

from __future__ import annotations

from datetime import timedelta

import attrs
from hypothesis import strategies as st

from umt_sdk import TaskPair

__all__ = [
    "CRASH_POINTS",
    "PAIRS",
    "FlowInput",
    "clock_steps",
    "crash_points",
    "fact_payloads",
    "flow_inputs",
    "pair_subsets",
    "priorities",
]

PAIRS: tuple[TaskPair, ...] = (
    TaskPair(name="prop.flow", version=1),
    TaskPair(name="prop.flow", version=2),
    TaskPair(name="prop.other", version=1),
)
"""The (name, version) pairs the property tests register."""

CRASH_POINTS: tuple[tuple[str, str], ...] = tuple(
    (operation, phase)
    for operation in (
        "record_step",
        "park",
        "ledger.begin",
        "ledger.finish",
        "complete",
        "fail",
        "finish_canceled",
    )
    for phase in ("before", "after")
)
"""(operation, phase) pairs the memory backend's `crash_hook` is asked about, the operations
every run makes first (`crash_points` draws them more often)."""


@attrs.frozen
class FlowInput:
    """The shape of one run of the property tests' flow task.

    gates: where the run's bodies block until the test opens their gate: "prepare" (the first
        step), "act" (inside the fenced side effect, between the ledger's begin and finish) and
        "finish" (the last step, after earlier steps renewed the lease).
    fenced: run the fenced side effect (`with_attempt_token`) as the step "submit".
    sleep_s: a durable sleep of that many (virtual) seconds; 0 for none.
    wait_fact: wait for the run-scoped fact "go".
    fail_times: -1 for no flaky step; else the flaky step's first `fail_times` bodies raise
        (it has 3 attempts, so 3 means it may give up and fail the run).
    """

    gates: tuple[str, ...] = ()
    fenced: bool = True
    sleep_s: int = 0
    wait_fact: bool = False
    fail_times: int = -1


@st.composite
def flow_inputs(draw: st.DrawFn) -> FlowInput:
    fenced = draw(st.booleans())
    points = ["prepare", "act", "finish"] if fenced else ["prepare", "finish"]
    return FlowInput(
        gates=tuple(sorted(draw(st.sets(st.sampled_from(points))))),
        fenced=fenced,
        sleep_s=draw(st.sampled_from([0, 2, 30])),
        wait_fact=draw(st.booleans()),
        fail_times=draw(st.sampled_from([-1, 0, 1, 2, 3])),
    )


def pair_subsets() -> st.SearchStrategy[list[TaskPair]]:
    """The pairs a worker serves: a non-empty subset of `PAIRS`."""
    return st.sets(st.sampled_from(PAIRS), min_size=1).map(sorted)


crash_points = st.one_of(st.sampled_from(CRASH_POINTS[:8]), st.sampled_from(CRASH_POINTS))
clock_steps = st.sampled_from(
    [
        timedelta(milliseconds=500),
        timedelta(seconds=1),
        timedelta(seconds=2),
        timedelta(seconds=6),
        timedelta(seconds=31),
    ]
)
fact_payloads = st.integers(min_value=-1000, max_value=1000)
priorities = st.integers(min_value=-2, max_value=2)
