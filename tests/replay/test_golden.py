"""The golden histories of the examples (`tests/replay/*.jsonl`, written by
`python -m tests.replay.examples`) replay against the examples' code as it is now: a change to
an example's task that its recorded runs cannot replay fails here, as it would fail a deploy."""

from __future__ import annotations

import pytest

from tests.replay.examples import EXAMPLE_RUNS, GOLDEN, histories_of, load, registry_of
from umt_sdk import RunHistory
from umt_sdk.testing import Replayer


def test_every_example_with_runs_has_its_golden_file() -> None:
    files = sorted(p.stem for p in GOLDEN.glob("*.jsonl"))
    assert files == sorted(EXAMPLE_RUNS)


@pytest.mark.parametrize("stem", sorted(EXAMPLE_RUNS))
async def test_the_golden_histories_replay_against_the_example(stem: str) -> None:
    path = GOLDEN / f"{stem}.jsonl"
    histories = RunHistory.from_jsonl(path.read_bytes(), source=path.name)
    module = load(stem)
    expected = EXAMPLE_RUNS[stem](module)
    assert len(histories) == len(expected), (
        f"regenerate {path.name}: python -m tests.replay.examples"
    )
    assert all(h.status in ("completed", "failed") for h in histories)
    results = await Replayer(registry_of(module, expected)).replay_many(histories)
    failed = [r.summary() for r in results if not r.ok]
    assert failed == [], "\n".join(failed)
    assert [r.outcome for r in results] == ["finished"] * len(results)
    assert [r.steps_matched for r in results] == [r.steps_recorded for r in results]


@pytest.mark.parametrize("stem", sorted(EXAMPLE_RUNS))
async def test_the_golden_histories_are_what_the_examples_record_now(stem: str) -> None:
    """Same tasks, inputs, statuses, outputs and steps as a fresh recording (ids and times
    aside): a file that drifted from its example is regenerated on purpose, not by accident."""
    path = GOLDEN / f"{stem}.jsonl"
    golden = RunHistory.from_jsonl(path.read_bytes(), source=path.name)
    fresh = await histories_of(stem)

    def shape(h: RunHistory) -> object:
        steps = [(s.name, s.kind, s.status, s.attempt, s.output) for s in h.steps]
        return (h.task, h.version, h.status, h.input, h.output, steps)

    assert [shape(h) for h in golden] == [shape(h) for h in fresh]
