"""Shared Hypothesis strategies (and the records they build) for the property tests."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

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
    "json_values",
    "pair_subsets",
    "planted_bad_strings",
    "priorities",
    "storable_text",
    "unstorable_text",
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
        "end_execution:waiting",
        "ledger.begin",
        "ledger.finish",
        "end_execution:retrying",
        "end_execution:completed",
        "end_execution:failed",
        "end_execution:canceled",
        "end_execution:released",
    )
    for phase in ("before", "after")
)
"""(operation, phase) pairs the memory backend's `crash_hook` is asked about, the operations
every run makes first (`crash_points` draws them more often)."""


@attrs.frozen
class FlowInput:
    """The shape of one run of the property tests' flow task.

    gates: where the run blocks until the test opens its gate (or the abort signal fires, then
        `ctx.throw_if_canceled()`): "prepare" (the first step), "handler" (the handler itself,
        between two steps), "act" (inside the fenced side effect, between the ledger's begin
        and finish) and "finish" (the last step, after earlier steps renewed the lease).
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
    points = ["prepare", "handler", "act", "finish"] if fenced else ["prepare", "handler", "finish"]
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


# -- payloads -------------------------------------------------------------------------------------

storable_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"))
"""Strings a backend can store: any character but NUL and the surrogates."""

_BAD_CHARACTERS = st.one_of(
    st.just("\x00"), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
)
unstorable_text = st.builds(
    lambda before, bad, after: before + bad + after,
    storable_text,
    _BAD_CHARACTERS,
    storable_text,
)
"""Strings no backend can store: a NUL or a lone surrogate somewhere."""

_KEYS = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)

json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | storable_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(storable_text, inner, max_size=4),
    max_leaves=20,
)
"""Values of JSON's own types that a backend can store (nesting stays far below the limit)."""


@st.composite
def planted_bad_strings(draw: st.DrawFn) -> tuple[Any, str, bool]:
    """(value, path, as_key): a JSON value with one unstorable string (a value, or a key when
    `as_key`) planted at `path` (".a[2].b" after the root), among storable siblings."""
    as_key = draw(st.booleans())
    bad = draw(unstorable_text)
    value: Any = {bad: draw(json_values)} if as_key else bad
    segments: list[str] = []
    for _ in range(draw(st.integers(min_value=0, max_value=6))):
        if draw(st.booleans()):
            siblings = draw(st.lists(json_values, max_size=3))
            index = draw(st.integers(min_value=0, max_value=len(siblings)))
            value = [*siblings[:index], value, *siblings[index:]]
            segments.append(f"[{index}]")
        else:
            key = draw(_KEYS)
            others = draw(
                st.dictionaries(_KEYS.filter(lambda k, key=key: k != key), json_values, max_size=3)
            )
            value = {**others, key: value}
            segments.append(f".{key}")
    return value, "".join(reversed(segments)), as_key
