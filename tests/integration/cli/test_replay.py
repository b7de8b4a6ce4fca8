"""Histories recorded by real runs on the session's Postgres, exported through
`Engine.export_history` and `umt runs export`, replayed against changed code (the Replayer and
`umt replay`): a reordered step, a renamed one and a step turned into a sleep are caught with
the diff; a step appended at the end passes."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from tests.integration import replay_tasks
from tests.integration.cli.test_cli import Umt
from umt_sdk import RunHistory, connect
from umt_sdk.exceptions import NonDeterminismError
from umt_sdk.testing import Replayer

TASKS = "tests.integration.replay_tasks"


async def _record(umt: Umt) -> tuple[list[RunHistory], uuid.UUID]:
    """Two runs of `replay.order@1` to completion and one left waiting for its fact; their
    histories as `Engine.export_history` gives them, and the waiting run's id."""
    engine = await connect(
        umt.url, registry=replay_tasks.recorded_registry, schema=umt.schema, run_migrations=False
    )
    try:
        handles = [await engine.enqueue(replay_tasks.recorded, f"o-{n}") for n in range(3)]
        async with engine.worker(lease=timedelta(seconds=5), shutdown_grace=timedelta(0)):
            deadline = time.monotonic() + 30
            for handle in handles:
                while (await engine.get(handle.run_id)).status != "waiting":
                    assert time.monotonic() < deadline, "the runs never parked on their fact"
                    await asyncio.sleep(0.05)
            for handle in handles[:2]:
                await engine.signal(handle.run_id, "shipped", {"by": "ups"})
            for handle in handles[:2]:
                assert await handle.result(timeout=30) == "charged 42, shipped by ups"
        histories = [await engine.export_history(h.run_id) for h in handles]
    finally:
        await engine.close()
    return histories, handles[2].run_id


def test_histories_from_postgres_catch_incompatible_changes(umt: Umt, tmp_path: Path) -> None:
    histories, waiting_id = asyncio.run(_record(umt))
    completed, waiting = histories[:2], histories[2]
    assert [h.status for h in histories] == ["completed", "completed", "waiting"]
    assert [(s.name, s.kind, s.status) for s in completed[0].steps] == [
        ("fetch", "step", "completed"),
        ("charge", "step", "completed"),
        ("shipped", "fact", "completed"),
    ]
    assert completed[0].steps[2].output == {"fact": {"by": "ups"}, "source": "signal"}
    assert waiting.steps[2].status == "waiting"

    # The CLI exports the same histories, by id and by filter.
    by_id = umt.ok("runs", "export", *(str(h.run_id) for h in histories)).stdout
    assert RunHistory.from_jsonl(by_id) == histories
    assert by_id.splitlines()[0] == histories[0].to_json()
    in_flight = umt.ok("runs", "export", "--task", "replay.order@1", "--status", "running,waiting")
    assert [h.run_id for h in RunHistory.from_jsonl(in_flight.stdout)] == [waiting_id]
    every = umt.ok("runs", "export", "--since", "2000-01-01T00:00:00+00:00").stdout
    assert sorted(h.run_id for h in RunHistory.from_jsonl(every)) == sorted(
        h.run_id for h in histories
    )
    path = tmp_path / "histories.jsonl"
    path.write_text(by_id, encoding="utf-8")

    # Today's code, unchanged or with a step appended at the end: every run replays.
    for registry in (replay_tasks.recorded_registry, replay_tasks.appended_registry):
        results = asyncio.run(Replayer(registry).replay_many(histories))
        assert [r.ok for r in results] == [True, True, True]
    appended = asyncio.run(Replayer(replay_tasks.appended_registry).replay(completed[0]))
    assert (appended.outcome, appended.next_call) == ("goes_on_live", "step 'notify'")
    in_flight_result = asyncio.run(Replayer(replay_tasks.appended_registry).replay(waiting))
    assert (in_flight_result.outcome, in_flight_result.next_call) == (
        "goes_on_live",
        "fact 'shipped'",
    )

    # Incompatible changes: each caught at its position, with the diff.
    expected = {
        "reordered_registry": (1, "step 'fetch'", "step 'charge'"),
        "renamed_registry": (2, "step 'charge'", "step 'charge_card'"),
        "run_to_sleep_registry": (2, "step 'charge'", "sleep 'charge'"),
    }
    for name, (position, recorded, current) in expected.items():
        registry = getattr(replay_tasks, name)
        for history in histories:
            with pytest.raises(NonDeterminismError) as caught:
                asyncio.run(Replayer(registry).replay(history))
            error = caught.value
            assert (error.position, error.recorded, error.current) == (position, recorded, current)
            differs = str(error).splitlines()[1 + position]
            assert differs.split("<-")[0].split() == [
                str(position),
                *recorded.split(),
                *current.split(),
            ]
            assert differs.endswith("<- differs")

        # The same through `umt replay`: one FAILED line with the diff per run, exit 1.
        result = umt("replay", "--registry", f"{TASKS}:{name}", str(path))
        assert result.exit_code == 1, result.output
        assert result.stdout.count("FAILED run ") == 3
        assert f"{current}   <- differs" in result.stdout
        assert "3 of 3 run(s) no longer replay" in result.stderr

    ok = umt("replay", "--registry", f"{TASKS}:appended_registry", str(path))
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.count("ok run ") == 3
    assert "goes on live with step 'notify'" in ok.stdout
    assert replay_tasks.RAN == []


def test_umt_replay_refuses_a_bad_file_with_exit_2(umt: Umt, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"format": "umt.history", "format_version": 1}\n', encoding="utf-8")
    result = umt("replay", "--registry", f"{TASKS}:recorded_registry", str(path))
    assert result.exit_code == 2
    assert result.stderr.strip() == f"Error: {path} line 1: run_id: missing"
    path.write_text("not json\n", encoding="utf-8")
    result = umt("replay", "--registry", f"{TASKS}:recorded_registry", str(path))
    assert result.exit_code == 2
    assert f"{path} line 1 is not valid JSON" in result.stderr


def test_umt_runs_export_of_an_unknown_run_fails(umt: Umt) -> None:
    missing = uuid.uuid4()
    result = umt("runs", "export", str(missing))
    assert result.exit_code == 1
    assert f"no run {missing}" in result.stderr
    nothing = umt("runs", "export")
    assert nothing.exit_code == 2
    assert "name the runs to export" in nothing.stderr
