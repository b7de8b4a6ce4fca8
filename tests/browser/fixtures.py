"""Fixtures of the browser tests (listed in tests/conftest.py): `chromium` (the browser found,
or a skip that says how to install one, or a failure in CI), `browser` (a fresh headless
Chromium per test) and `shots` (screenshots kept as test artifacts).

Screenshots go to `artifacts/browser/<test>/` in the checkout (ignored by git), or under
`UMT_ARTIFACTS_DIR` when set; a failing test also leaves a screenshot and the page's HTML
there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.chromium import Found, browser_required, find_browser, start

REPO = Path(__file__).resolve().parents[2]
_missing: list[str] = []


def artifacts_root() -> Path:
    """Where the browser tests leave screenshots."""
    return Path(os.environ.get("UMT_ARTIFACTS_DIR") or REPO / "artifacts") / "browser"


@pytest.fixture(scope="session")
def chromium() -> Found:
    found = find_browser(os.environ)
    if isinstance(found, Found):
        return found
    message = f"the browser tests need a headless Chromium: {found}"
    if browser_required(os.environ):
        pytest.fail(f"{message}. A browser is required here (CI or UMT_REQUIRE_BROWSER is set).")
    _missing.append(found)
    pytest.skip(message)


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Path:
    """This test's artifact directory (created)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:120]
    path = artifacts_root() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def browser(chromium: Found, request: pytest.FixtureRequest, artifacts: Path) -> Iterator[Any]:
    with start(chromium) as driver:
        yield driver
        report = getattr(request.node, "umt_call_report", None)
        if report is not None and report.failed:
            driver.save_screenshot(str(artifacts / "failure.png"))
            (artifacts / "failure.html").write_text(driver.page_source, encoding="utf-8")


@pytest.fixture
def shots(browser: Any, artifacts: Path) -> Callable[[str], Path]:
    """`shots("runs")` saves the browser's viewport as `<artifacts>/runs.png`."""

    def shot(name: str) -> Path:
        path = artifacts / f"{name}.png"
        assert browser.save_screenshot(str(path)), f"no screenshot saved at {path}"
        return path

    return shot


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.umt_call_report = report  # type: ignore[attr-defined]
    return report


def pytest_report_header(config: pytest.Config) -> str:
    found = find_browser(os.environ)
    if isinstance(found, Found):
        return f"browser tests: {found.version} ({found.browser}, {found.driver})"
    then = "FAIL (CI or UMT_REQUIRE_BROWSER set)" if browser_required(os.environ) else "SKIP"
    return f"browser tests: will {then}: {found}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _missing:
        terminalreporter.write_sep("=", "browser tests skipped", yellow=True)
        terminalreporter.write_line(f"The browser tests did not run: {_missing[0]}")
        terminalreporter.write_line(
            "CI sets CI=true, which turns this skip into a failure (so does UMT_REQUIRE_BROWSER=1)."
        )
