"""The command line under bad input and unreachable servers (issue 11, part 10): one clear line
and a non-zero exit, never a traceback, never a password; nothing stored.

Each case runs in-process (click's CliRunner) and, where the terminal is the point, as the real
`umt` console script in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.integration.cli.test_cli import REGISTRY, REPO, Umt, one_error_line, umt_command
from umt_sdk.cli import _app as _cli
from umt_sdk.cli import redact_url

SECRET = "hunter2"
UNREACHABLE = [
    # The password in the userinfo, in the query string, percent-encoded, and quoted oddly.
    f"postgresql://ops:{SECRET}@127.0.0.1:1/umt",
    f"postgresql://ops@127.0.0.1:1/umt?password={SECRET}",
    f"postgresql://ops@127.0.0.1:1/umt?sslmode=disable&PASSWORD={SECRET}&application_name=x",
    "postgresql://ops:hun%74er2@127.0.0.1:1/umt",
    f"postgresql://ops:{SECRET}@127.0.0.1:notaport/umt",
    f"host=127.0.0.1 port=1 password={SECRET} dbname=umt",
    f"host=127.0.0.1 port=1 password='{SECRET}' dbname=umt",
]


def run_umt(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    # A coroutine left un-awaited on an error path prints a traceback: one more failure.
    env = {**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"}
    return subprocess.run(
        [*umt_command(), *args], cwd=cwd, capture_output=True, text=True, timeout=60, env=env
    )


def assert_one_clean_line(stderr: str, stdout: str = "") -> str:
    text = stderr + stdout
    assert "Traceback" not in text, text
    assert SECRET not in text, text
    lines = [line for line in stderr.strip().splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("url", UNREACHABLE)
def test_an_unreachable_server_prints_no_password_and_no_traceback(url: str) -> None:
    result = Umt(url, "umt")("runs", "list")
    assert result.exit_code == 1, result.output
    assert SECRET not in result.output
    assert "Traceback" not in result.output
    one_error_line(result)


@pytest.mark.parametrize("url", UNREACHABLE[:3])
def test_the_console_script_against_an_unreachable_server(url: str) -> None:
    for args in (["runs", "list"], ["cancel", str(uuid.uuid4())]):
        done = run_umt("--database-url", url, *args)
        assert done.returncode == 1, done.stderr
        line = assert_one_clean_line(done.stderr, done.stdout)
        assert "cannot reach the database" in line


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"postgresql://ops:{SECRET}@db:5432/app", "postgresql://ops:***@db:5432/app"),
        (
            f"postgresql://ops@db/app?password={SECRET}&x=1",
            "postgresql://ops@db/app?password=***&x=1",
        ),
        (f"host=db password='{SECRET} x' dbname=app", "host=db password=*** dbname=app"),
        ("postgresql://ops@db/app", "postgresql://ops@db/app"),
    ],
)
def test_redact_hides_every_form_of_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_scrub_removes_the_password_as_typed_and_as_decoded() -> None:
    secrets = _cli._secrets("postgresql://ops:hun%74er2@db/app?password=other%20one")
    text = "a hunter2 b hun%74er2 c other one d other%20one"
    assert _cli._scrub(text, secrets) == "a *** b *** c *** d ***"


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (_deep(100_000), "nested deeper than 64 levels (the limit) at line 1 column 65"),
        ('{"name": "a\\u0000b"}', "--input.name is a string that holds a NUL character"),
        ('{"name": "a\\ud800b"}', "--input.name is a string that holds a lone surrogate"),
        ('{"name": "' + "x" * (17 * 1024 * 1024) + '"}', "more than the limit of 16,777,216"),
        ("1" * 5000, "not valid JSON"),
    ],
    ids=["100k-deep", "nul", "surrogate", "17MiB", "huge-int"],
)
def test_enqueue_refuses_an_input_that_cannot_be_stored(
    umt: Umt, tmp_path: Path, payload: str, says: str
) -> None:
    source = tmp_path / "input.json"
    source.write_text(payload, encoding="utf-8")
    result = umt("enqueue", "greet@1", "--input", f"@{source}", "--registry", REGISTRY)
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert line.startswith("Error: Invalid value for '--input': "), line
    assert says in line, line
    assert json.loads(umt.ok("runs", "list", "--json").stdout) == []


def test_the_console_script_refuses_deep_input_from_a_file_and_stdin(
    umt: Umt, tmp_path: Path
) -> None:
    source = tmp_path / "deep.json"
    source.write_text(_deep(100_000), encoding="utf-8")
    done = run_umt(
        "--database-url", umt.url, "--schema", umt.schema,
        "enqueue", "greet@1", "--input", f"@{source}", "--registry", REGISTRY,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "nested deeper than 64 levels" in assert_one_clean_line(done.stderr, done.stdout)
    piped = subprocess.run(
        [*umt_command(), "--database-url", umt.url, "--schema", umt.schema,
         "enqueue", "greet@1", "--input", "-", "--registry", REGISTRY],
        cwd=REPO, input=_deep(100_000), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert piped.returncode == 2, piped.stderr
    assert "nested deeper than 64 levels" in assert_one_clean_line(piped.stderr, piped.stdout)
    assert json.loads(umt.ok("runs", "list", "--json").stdout) == []


def test_input_that_is_not_utf8_is_refused(umt: Umt, tmp_path: Path) -> None:
    source = tmp_path / "latin1.json"
    source.write_bytes(b'{"name": "caf\xe9"}')
    result = umt("enqueue", "greet@1", "--input", f"@{source}", "--registry", REGISTRY)
    assert result.exit_code == 2, result.output
    assert "not valid UTF-8 (byte 13" in one_error_line(result)


def test_a_signal_payload_that_cannot_be_stored_is_refused(umt: Umt) -> None:
    run_id = str(uuid.uuid4())
    for payload, says in [
        ('"\\u0000"', "holds a NUL character"),
        ('{"a": "\\udfff"}', "--payload.a is a string that holds a lone surrogate"),
        (_deep(70), "nested deeper than 64 levels"),
    ]:
        result = umt("signal", run_id, "go", "--payload", payload)
        assert result.exit_code == 2, result.output
        assert says in one_error_line(result)


def test_an_unexpected_error_is_one_line_without_the_password(
    umt: Umt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The net under everything else: an error no command expected (a bug of ours, a driver
    failure past the preflight) still ends as one scrubbed line, exit 1."""

    async def broken(*args: object, **kwargs: object) -> None:
        raise RecursionError(f"maximum recursion depth exceeded near {SECRET}")

    monkeypatch.setattr(_cli, "connect", broken)
    url = umt.url + ("&" if "?" in umt.url else "?") + f"password={SECRET}"
    result = Umt(url, umt.schema)("runs", "list")
    assert result.exit_code == 1, result.output
    line = one_error_line(result)
    assert line.startswith("Error: unexpected error: RecursionError: maximum recursion"), line
    assert "UMT_DEBUG=1" in line
    assert SECRET not in result.output
    assert "Traceback" not in result.output
    debug = Umt(url, umt.schema)("runs", "list", UMT_DEBUG="1")
    assert debug.exit_code == 1
    assert "Traceback" in debug.stderr, "UMT_DEBUG=1 prints the traceback"
    assert SECRET not in debug.output
