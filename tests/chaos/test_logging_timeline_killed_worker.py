"""A worker process SIGKILLed just after a step starts: what `umt runs show` and `umt runs list`
print while the lease runs out (`running (lease expired)`) and after another worker takes the
run over (the cut-off step shows as interrupted, though no regular heartbeat named it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli.test_cli import Umt, stop_worker, wait_until, worker_process


@pytest.fixture
def umt(pg_url: str, pg_schema: str) -> Umt:
    return Umt(pg_url, pg_schema)


def test_a_worker_killed_inside_a_fresh_step(umt: Umt, tmp_path: Path) -> None:
    marker = tmp_path / "dozes"
    run_id = umt.enqueue("nap", {"seconds": 1, "marker": str(marker)})
    # A 3 s lease: regular heartbeats every second, so the kill lands before the first one.
    with worker_process(umt, "--lease", "3s") as proc:
        wait_until(marker.exists, what="the doze step to start")
        proc.kill()
        proc.communicate(timeout=10)

    wait_until(
        lambda: umt.show(run_id)["lease_expired"],
        what="the run to read as lease expired",
    )
    shown = umt.show(run_id)
    assert shown["status"] == "running", "the stored status is unchanged"
    text = umt.ok("runs", "show", run_id).stdout
    assert "status             running (lease expired)" in text, text
    assert "waiting for a worker to claim it" in text
    listed = umt.ok("runs", "list").stdout
    assert "running (lease expired)" in listed, listed
    listed_json = json.loads(umt.ok("runs", "list", "--json").stdout)
    assert [r["lease_expired"] for r in listed_json] == [True]

    with worker_process(umt, "--lease", "3s") as proc:
        wait_until(lambda: umt.show(run_id)["status"] == "completed", what="the takeover")
        stop_worker(proc)

    info = umt.show(run_id)
    assert info["lease_expired"] is False
    assert [(s["name"], s["status"]) for s in info["timeline"]] == [
        ("doze", "interrupted"),
        ("doze", "completed"),
        ("wake", "completed"),
    ]
    first, second = info["executions"]
    assert info["timeline"][0]["fencing_token"] == first["fencing_token"]
    assert (first["outcome"], second["outcome"]) == ("interrupted", "completed")
    text = umt.ok("runs", "show", run_id).stdout
    assert "doze  step  interrupted !" in text, text
    assert "status             completed" in text
