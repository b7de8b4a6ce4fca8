"""The suite's guard against hangs (tests/fixtures/watchdog.py), in a run of its own: a test
whose teardown hangs after pytest-timeout's alarm ends in a failure that names it, with the
stack of the hang, at the end of the output, and the run goes on and ends."""

from __future__ import annotations

from pathlib import Path

import pytest

INNER_CONFTEST = 'pytest_plugins = ["tests.fixtures.watchdog"]\n'
INNER_TESTS = """
import time

import pytest


@pytest.fixture
def stubborn():
    yield
    while True:  # a teardown that waits forever and swallows the alarm's failure
        try:
            time.sleep(60)
        except BaseException:
            pass


@pytest.mark.timeout(1)
def test_hangs_in_its_teardown(stubborn):
    time.sleep(5)


def test_after_it():
    pass
"""


@pytest.mark.slow
def test_a_hang_past_the_timeout_fails_its_test_with_the_stack_and_the_run_ends(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    monkeypatch.setenv("UMT_ARTIFACTS_DIR", str(pytester.path / "artifacts"))
    monkeypatch.setenv("UMT_TEST_WATCHDOG_GRACE", "2")
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_stubborn=INNER_TESTS)
    result = pytester.runpytest_subprocess(
        *("-n", "1", "-ra", "-o", "timeout_method=signal", f"--rootdir={pytester.path}"),
        # A quick start for the worker processes: none of the suite's other plugins.
        *("-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:hypothesispytest"),
        *("-p", "no:asyncio", "-p", "no:anyio", "-p", "no:umt"),
        timeout=120,
    )
    out = result.stdout.str()
    # The call failed (pytest-timeout's alarm), then its teardown hung and the watchdog ended
    # the worker; not run again in the fresh worker, where the next test ran.
    result.assert_outcomes(failed=2, passed=1)
    summary = out[out.index("short test summary info") :]
    assert "FAILED test_stubborn.py::test_hangs_in_its_teardown - hung past its timeout" in (
        summary
    ), out
    failures = out[out.index("FAILURES") : out.index("short test summary info")]
    # Once: not run again in the fresh worker (the summary line may repeat the words, whole or
    # cut to the terminal's width, so only the failures section is counted).
    assert failures.count("crashed while running") == 1, out
    assert "the watchdog ended the test process" in failures, out
    assert "in stubborn" in failures, "the stack of the hang, in the fixture's teardown"
