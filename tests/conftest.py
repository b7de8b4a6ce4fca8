"""Shared test configuration: fixture modules are listed here."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

pytest_plugins = [
    "pytester",
    "tests.fixtures.pg",
    "tests.fixtures.private_pg",
    "tests.fixtures.pgbouncer",
    "tests.fixtures.dashboard",
    "tests.browser.fixtures",
    "tests.fixtures.watchdog",
]

settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile("ci", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


BACKENDS = ("memory", "pg")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        choices=[*BACKENDS, "all"],
        default="all",
        help="run the contract suite against this backend only (default: all); the other's "
        "tests are deselected, and the summary counts them",
    )


# `make test` runs the suite in worker processes (pytest-xdist, `--dist loadgroup`). The tests
# that kill, freeze or crash processes, or time a window, run one after another in one of them
# (the group below), beside the rest: two of them at once on a 2-core machine would starve
# each other's leases. Each worker process has a Postgres of its own (tests/fixtures/pg.py).
SERIAL_GROUP = "processes"
SERIAL_PATHS = (
    "tests/chaos/",
    "tests/bench/",
    "tests/browser/",
    "tests/integration/test_pg_crashes.py",
    "tests/integration/test_pg_restart.py",
    "tests/integration/test_concurrency_keys_pg.py",
    "tests/integration/test_rate_limits_pg.py",
    "tests/integration/test_fenced_side_effects.py",
    "tests/integration/test_frozen_transaction.py",
    "tests/integration/outbox/test_relay_processes.py",
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(SERIAL_PATHS):
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))
    chosen = config.getoption("--backend")
    if chosen == "all":
        return
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("backend")
        (dropped if marker is not None and marker.args[0] != chosen else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
