"""`umt dashboard`: where it may listen without a token, and a real server it starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from umt_sdk.cli import cli
from umt_sdk.cli._app import InputError
from umt_sdk.cli._dashboard import check_exposure
from umt_sdk.dashboard import sign_callback

ROOT = Path(__file__).resolve().parents[2]
CALLBACK_SECRET = "a-callback-secret-of-enough-characters"


@pytest.mark.parametrize(
    ("host", "token", "read_only", "no_auth"),
    [
        ("127.0.0.1", None, False, False),
        ("localhost", None, False, False),
        ("::1", None, False, False),
        ("0.0.0.0", "a-long-token", False, False),
        ("0.0.0.0", None, True, True),
    ],
)
def test_where_the_dashboard_may_listen(
    host: str, token: str | None, read_only: bool, no_auth: bool
) -> None:
    check_exposure(host=host, token=token, read_only=read_only, no_auth=no_auth)


@pytest.mark.parametrize(
    ("host", "token", "read_only", "no_auth", "says"),
    [
        ("0.0.0.0", None, False, False, "without an access token"),
        ("10.1.2.3", None, True, False, "without an access token"),
        ("0.0.0.0", None, False, True, "needs --read-only"),
        ("0.0.0.0", "a-long-token", True, True, "contradict"),
    ],
)
def test_a_dashboard_on_the_network_needs_a_token_or_an_explicit_no_auth(
    host: str, token: str | None, read_only: bool, no_auth: bool, says: str
) -> None:
    with pytest.raises(InputError, match=says):
        check_exposure(host=host, token=token, read_only=read_only, no_auth=no_auth)


def test_the_command_refuses_a_public_host_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != "UMT_DASHBOARD_TOKEN"}
    result = CliRunner().invoke(
        cli, ["--database-url", "memory://", "dashboard", "--host", "0.0.0.0"], env=env
    )
    assert result.exit_code == 2, result.output
    assert "UMT_DASHBOARD_TOKEN" in result.output
    short = CliRunner().invoke(
        cli,
        ["--database-url", "memory://", "dashboard", "--host", "0.0.0.0"],
        env={**env, "UMT_DASHBOARD_TOKEN": "short"},
    )
    assert short.exit_code == 2
    assert "at least 8 characters" in short.output


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "umt_sdk.cli",
            "--database-url",
            "memory://",
            "dashboard",
            "--port",
            str(port),
            "--registry",
            "tests.dashboard.tasks:TASKS_REGISTRY",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "UMT_CALLBACK_SECRET": CALLBACK_SECRET},
    )
    try:
        yield process, port
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()


def test_umt_dashboard_serves_until_interrupted(
    served: tuple[subprocess.Popen[str], int],
) -> None:
    process, port = served
    assert process.stdout is not None
    first = process.stdout.readline()
    assert f"umt dashboard on http://127.0.0.1:{port}/" in first, first
    assert "(callbacks: POST /callbacks/complete)" in first, first
    body = ""
    for _ in range(200):  # the line comes just before the socket is bound
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/runs", timeout=5) as page:
                body = page.read().decode()
                break
        except OSError:
            time.sleep(0.05)
    assert "<title>Runs · umt</title>" in body
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        form = client.get("/tasks/dash.ship/1/enqueue")
        assert 'name="field.customer"' in form.text
        enqueued = client.post(
            "/tasks/dash.ship/1/enqueue",
            data={
                "csrf": client.cookies["umt_csrf"],
                "field.customer": "cli",
                "field.quantity": "1",
            },
        )
        assert enqueued.status_code == 303, enqueued.text
        metrics = client.get("/metrics").text
        # The signed callback endpoint: unsigned is refused; signed, the token is checked.
        body = b'{"token": "hello"}'
        unsigned = client.post(
            "/callbacks/complete", content=body, headers={"Content-Type": "application/json"}
        )
        assert (unsigned.status_code, unsigned.json()["error"]["reason"]) == (401, "unsigned")
        signed = client.post(
            "/callbacks/complete", content=body, headers=sign_callback(CALLBACK_SECRET, body)
        )
        assert (signed.status_code, signed.json()["error"]["reason"]) == (400, "malformed")
    assert 'umt_runs_unfinished{status="pending",task="dash.ship",version="1"} 1.0' in metrics
    # The engine's own OpenTelemetry counter, through the OpenTelemetry Prometheus exporter.
    assert "umt_runs_enqueued" in metrics
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0
    assert process.stdout.read().strip().endswith("umt dashboard stopped")
