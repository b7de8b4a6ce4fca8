from __future__ import annotations

import pytest

from tests.fixtures.pg import PostgresHarness
from umt_sdk.testing import BackendContract

pytestmark = pytest.mark.backend("pg")


class TestPostgresBackend(BackendContract):
    @pytest.fixture
    def harness(self, pg_harness: PostgresHarness) -> PostgresHarness:
        return pg_harness
