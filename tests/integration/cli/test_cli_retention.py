"""`umt enqueue --tag`, `umt runs list` with its new filters, and `umt runs prune`."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from tests.integration.cli.test_cli import Umt, one_error_line


def _ids(umt: Umt, *args: str) -> list[str]:
    return [r["run_id"] for r in json.loads(umt.ok("runs", "list", "--json", *args).stdout)]


def test_tags_are_given_shown_and_listed(umt: Umt) -> None:
    t7 = umt.enqueue("greet", {"name": "Ada"}, "--tag", "tenant=t7", "--tag", "region=eu")
    t8 = umt.enqueue("greet", {"name": "Bo"}, "--tag", "tenant=t8")
    plain = umt.enqueue("approval", {"order_id": "o1"}, "--idempotency-key", "order-o1")
    assert umt.show(t7)["tags"] == {"tenant": "t7", "region": "eu"}
    assert "tags               region=eu, tenant=t7" in umt.ok("runs", "show", t7).stdout
    assert _ids(umt, "--tag", "tenant=t7") == [t7]
    assert _ids(umt, "--tag", "region=eu", "--tag", "tenant=t8") == []
    assert _ids(umt, "--task", "approval", "--idempotency-key", "order-o1") == [plain]
    assert _ids(umt, "--created-after", "1h") == [plain, t8, t7]
    assert _ids(umt, "--created-before", "1h") == []
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert _ids(umt, "--created-before", future, "--task", "greet") == [t8, t7]
    assert _ids(umt, "--finished-after", "1d") == [], "none has finished"

    for bad in (["--tag", "tenant"], ["--tag", "=x"]):
        result = umt("enqueue", "greet", "--input", '{"name": "x"}', "--registry", "x:y", *bad)
        assert result.exit_code == 2, result.output
        assert "expected KEY=VALUE" in result.stderr
    refused = umt(
        "enqueue",
        "greet",
        "--input",
        '{"name": "x"}',
        "--registry",
        "tests.integration.cli.app_tasks:registry",
        "--tag",
        "tenant id=x",
    )
    assert refused.exit_code == 2, refused.output
    assert "tag keys of 1 to 64 letters" in one_error_line(refused)
    no_task = umt("runs", "list", "--idempotency-key", "order-o1")
    assert no_task.exit_code == 2
    assert "--idempotency-key needs --task" in one_error_line(no_task)


def test_paging_repeats_every_filter(umt: Umt) -> None:
    first = umt.enqueue("greet", {"name": "Ada"}, "--tag", "tenant=t7")
    second = umt.enqueue("greet", {"name": "Bo"}, "--tag", "tenant=t7")
    page = umt.ok("runs", "list", "--tag", "tenant=t7", "--task", "greet", "--limit", "1")
    hint = page.stderr.strip().removeprefix("(more: ").removesuffix(")")
    assert "--tag tenant=t7" in hint
    assert "--task greet" in hint
    assert f"--before {second}" in hint
    words = hint.split()
    args = words[words.index("list") + 1 :]
    assert _ids(umt, *args) == [first]


def test_runs_prune_deletes_old_finished_runs_and_says_so(umt: Umt) -> None:
    done = [umt.enqueue("greet", {"name": str(i)}) for i in range(3)]
    for run_id in done:
        umt.ok("cancel", run_id)
    kept = umt.enqueue("approval", {"order_id": "o1"})
    dry = umt.ok("runs", "prune", "--older-than", "0s", "--dry-run")
    assert dry.stdout.strip() == "would delete 3 runs finished more than 0s ago"
    assert len(_ids(umt)) == 4
    assert umt.ok("runs", "prune", "--older-than", "30d").stdout.strip() == (
        "deleted 0 runs finished more than 30d ago (0 batches)"
    )
    out = umt.ok("runs", "prune", "--older-than", "0s", "--task", "greet", "--batch-size", "2")
    assert out.stdout.strip() == "deleted 3 runs of greet finished more than 0s ago (2 batches)"
    assert _ids(umt) == [kept]
    gone = umt("runs", "show", done[0])
    assert gone.exit_code == 1
    line = one_error_line(gone)
    assert f"run {done[0]} (greet@2) finished canceled at" in line
    assert "deleted by retention" in line
    bad = umt("runs", "prune", "--older-than", "0s", "--task", "greet@1")
    assert bad.exit_code == 2
    assert "--task takes a task name ('greet')" in one_error_line(bad)
    missing = umt("runs", "prune")
    assert missing.exit_code == 2
    assert "--older-than" in missing.stderr
