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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
