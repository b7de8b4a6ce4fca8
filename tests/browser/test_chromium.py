"""The browser tests' own machinery: finding Chromium, skipping without one (failing in CI),
reading the console and keeping screenshots."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.browser.chromium import browser_required, console_entries, console_errors, find_browser

INNER_CONFTEST = 'pytest_plugins = ["tests.browser.fixtures"]\n'
INNER_TEST = "def test_needs_a_browser(browser):\n    assert browser.title is not None\n"


@pytest.mark.parametrize(
    ("env", "required"),
    [
        ({}, False),
        ({"CI": "true"}, True),
        ({"CI": "1"}, True),
        ({"CI": "false"}, False),
        ({"CI": ""}, False),
        ({"UMT_REQUIRE_BROWSER": "1"}, True),
        ({"UMT_REQUIRE_BROWSER": "0"}, False),
    ],
)
def test_a_browser_is_required_in_ci_or_when_asked(env: dict[str, str], required: bool) -> None:
    assert browser_required(env) is required


def test_a_missing_browser_is_named_with_how_to_install_one(tmp_path: Path) -> None:
    nothing_here = {"PATH": str(tmp_path)}
    said = find_browser(nothing_here)
    assert isinstance(said, str)
    assert "no Chromium found" in said
    assert "apt-get install chromium chromium-driver" in said
    said = find_browser({"PATH": str(tmp_path), "UMT_CHROMIUM": str(tmp_path / "chrome")})
    assert isinstance(said, str)
    assert f"UMT_CHROMIUM={tmp_path / 'chrome'} is not an executable file" in said


def _inner_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, **env: str) -> Any:
    for name in ("CI", "UMT_REQUIRE_BROWSER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("UMT_CHROMIUM", str(pytester.path / "no-chromium-here"))
    monkeypatch.setenv("UMT_ARTIFACTS_DIR", str(pytester.path / "artifacts"))
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_page=INNER_TEST)
    return pytester.runpytest_subprocess(
        "-rs", "-p", "no:cacheprovider", f"--rootdir={pytester.path}"
    )


@pytest.mark.slow
def test_without_a_browser_the_tests_skip_saying_how_to_install_one(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    result = _inner_run(pytester, monkeypatch)
    result.assert_outcomes(skipped=1)
    out = result.stdout.str()
    assert "the browser tests need a headless Chromium" in out
    assert "apt-get install chromium chromium-driver" in out
    assert "browser tests skipped" in out  # the closing section, not only the -rs line


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"CI": "true"}, {"UMT_REQUIRE_BROWSER": "1"}])
def test_without_a_browser_in_ci_the_tests_fail(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    result = _inner_run(pytester, monkeypatch, **env)
    result.assert_outcomes(errors=1)
    assert "A browser is required here" in result.stdout.str()


def _page(html: str) -> str:
    return "data:text/html;charset=utf-8," + quote(html)


def test_the_console_errors_of_a_page_are_read_back(
    browser: Any, shots: Callable[[str], Path]
) -> None:
    browser.get(_page("<title>calm</title><p id=p>calm</p><script>console.log('fine')</script>"))
    assert browser.find_element("id", "p").text == "calm"
    entries = console_entries(browser)
    assert [e.message for e in entries if "fine" in e.message], entries
    assert console_errors(entries) == []
    browser.get(
        _page("<p>broken</p><script>console.error('boom'); not_defined_anywhere()</script>")
    )
    errors = console_errors(console_entries(browser))
    assert any("boom" in e.message for e in errors), errors
    assert any("not_defined_anywhere" in e.message for e in errors), errors
    saved = shots("broken")
    assert saved.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
