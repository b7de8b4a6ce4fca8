"""Shared Hypothesis strategies (and the records they build) for the property tests."""

from __future__ import annotations

from datetime import UTC, timedelta
from typing import Any, NoReturn

import attrs
from hypothesis import strategies as st

from umt_sdk import TaskPair

__all__ = [
    "CRASH_POINTS",
    "PAIRS",
    "FlowInput",
    "Hostile",
    "any_values",
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
deadlines = st.sampled_from(
    [timedelta(milliseconds=500), timedelta(seconds=2), timedelta(seconds=7), timedelta(seconds=40)]
)
"""Run deadlines, from before a first claim to after the longest sleep (`enqueue(deadline=)`)."""


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


# -- arguments ------------------------------------------------------------------------------------


class Hostile:
    """A value whose every dunder a check, a comparison or a message could touch raises."""

    def _raise(self, *args: object) -> NoReturn:
        raise RuntimeError("a hostile dunder ran")

    __repr__ = __str__ = __format__ = _raise
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _raise  # type: ignore[assignment]  # deliberately hostile: every comparison raises
    __hash__ = __bool__ = __len__ = __index__ = __int__ = __float__ = _raise  # type: ignore[assignment]  # deliberately hostile: as above


def _too_long_to_print() -> int:
    """An int whose repr raises ValueError (past the digit limit of int -> str)."""
    return 10**5000


def _a_function() -> None:
    """A callable among the values: taken where a function is, refused elsewhere."""


any_values: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([-(2**63), 2**63, 10**30, -(10**30)]),
    st.builds(_too_long_to_print),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=4),
    st.timedeltas(),
    st.sampled_from([timedelta.max, timedelta.min, timedelta(0), -timedelta(microseconds=1)]),
    st.datetimes(),
    st.datetimes(timezones=st.just(UTC)),
    st.uuids(),
    st.lists(st.integers(), max_size=2),
    st.tuples(st.integers()),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.decimals(),  # NaN and signaling NaN included: an sNaN cannot even be hashed
    st.fractions(),
    st.complex_numbers(),
    st.builds(Hostile),
    st.builds(object),
    st.just(_a_function),
    st.sampled_from([int, str, object, Hostile, list[int], type(None), Exception]),
)
"""Any value a caller might pass by mistake, of every kind; a case filters out what it takes."""
