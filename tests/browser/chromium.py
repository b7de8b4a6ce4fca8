"""A real headless Chromium for the browser tests, driven by Selenium through chromedriver.

Debian's `chromium` and `chromium-driver` packages (the same version, so the driver always
speaks the browser's protocol) are what `.ci/run` installs; `UMT_CHROMIUM` and
`UMT_CHROMEDRIVER` point at others. Nothing is ever downloaded: Selenium is given both paths,
so its driver manager never runs.

With no browser the tests skip, saying why and how to get one; with `CI` set (as CI does) or
`UMT_REQUIRE_BROWSER=1`, a missing browser fails them instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

HOW_TO_INSTALL = (
    "install Debian's Chromium and its driver (`apt-get install chromium chromium-driver`, as "
    ".ci/run does), or point UMT_CHROMIUM and UMT_CHROMEDRIVER at a Chromium or Chrome and the "
    "chromedriver of the same version; Selenium comes with `pip install -e '.[test]'`"
)
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)
DRIVER_TIMEOUT = 120
"""Seconds Selenium waits for one answer of chromedriver (a new session: the browser's first
start on a fresh machine) before it fails the test."""


@attrs.frozen(kw_only=True)
class Found:
    """A browser and its driver, both executables."""

    browser: Path
    driver: Path
    version: str


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in ("", "0", "false", "no")


def browser_required(env: Mapping[str, str]) -> bool:
    """True when a missing browser must fail the tests: in CI (`CI` set, as CI runners set it)
    or when `UMT_REQUIRE_BROWSER=1`."""
    return _truthy(env.get("CI")) or _truthy(env.get("UMT_REQUIRE_BROWSER"))


def _executable(path: str | None) -> Path | None:
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        return Path(path)
    return None


def find_browser(env: Mapping[str, str]) -> Found | str:
    """The browser and driver to use, or a sentence saying what is missing and how to fix it."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return f"the Python package `selenium` is not installed; {HOW_TO_INSTALL}"
    search = env.get("PATH", os.defpath)
    if env.get("UMT_CHROMIUM"):
        browser = _executable(env["UMT_CHROMIUM"])
        if browser is None:
            return f"UMT_CHROMIUM={env['UMT_CHROMIUM']} is not an executable file; {HOW_TO_INSTALL}"
    else:
        found = (shutil.which(name, path=search) for name in BROWSER_NAMES)
        browser = _executable(next((p for p in found if p), None))
        if browser is None:
            return f"no Chromium found (looked for {', '.join(BROWSER_NAMES)}); {HOW_TO_INSTALL}"
    driver_path = env.get("UMT_CHROMEDRIVER") or shutil.which("chromedriver", path=search)
    driver = _executable(driver_path)
    if driver is None:
        what = f"UMT_CHROMEDRIVER={driver_path} is not" if env.get("UMT_CHROMEDRIVER") else "no"
        return f"{what} chromedriver found next to {browser}; {HOW_TO_INSTALL}"
    try:
        version = subprocess.run(
            [str(browser), "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{browser} does not run ({exc}); {HOW_TO_INSTALL}"
    return Found(browser=browser, driver=driver, version=version or str(browser))


@attrs.frozen(kw_only=True)
class ConsoleEntry:
    """One line of the browser's console (a console.* call, an uncaught error, a failed load)."""

    level: str
    source: str
    message: str


@contextlib.contextmanager
def start(found: Found) -> Iterator[Any]:
    """A headless Chromium with a fresh profile, quit and removed on leaving."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="umt-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(found.browser)
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    # Every console line and uncaught error, read back by console_entries().
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Selenium waits for chromedriver's answers without a limit by default (its client takes
    # the socket default, None): a browser that hangs on a fresh machine would hang the test.
    # Every command, the new session included, now fails after DRIVER_TIMEOUT instead.
    before = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DRIVER_TIMEOUT)
    try:
        driver = webdriver.Chrome(service=Service(str(found.driver)), options=options)
    finally:
        socket.setdefaulttimeout(before)
    driver.command_executor.client_config.timeout = DRIVER_TIMEOUT
    try:
        driver.set_page_load_timeout(60)
        driver.set_script_timeout(30)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def console_entries(driver: Any) -> list[ConsoleEntry]:
    """The console lines logged since the last call (chromedriver hands each one out once)."""
    return [
        ConsoleEntry(level=e["level"], source=e.get("source", ""), message=e["message"])
        for e in driver.get_log("browser")
    ]


def console_errors(entries: list[ConsoleEntry]) -> list[ConsoleEntry]:
    """The entries that are errors: SEVERE (console.error, uncaught exceptions, failed loads)."""
    return [e for e in entries if e.level == "SEVERE"]
