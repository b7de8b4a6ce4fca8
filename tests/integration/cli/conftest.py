"""Fixtures of the command-line tests."""

from __future__ import annotations

import pytest

from tests.integration.cli.test_cli import Umt


@pytest.fixture
def umt(pg_url: str, pg_schema: str) -> Umt:
    """`umt --database-url <the test database> --schema <this test's schema> ...`, in-process."""
    return Umt(pg_url, pg_schema)
