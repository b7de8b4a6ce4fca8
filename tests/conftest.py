"""Shared test configuration: fixture modules are listed here."""

from __future__ import annotations

import os

from hypothesis import settings

pytest_plugins = ["tests.fixtures.pg", "tests.fixtures.private_pg"]

settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile("ci", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
