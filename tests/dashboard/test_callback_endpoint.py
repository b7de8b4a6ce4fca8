"""The dashboard's signed callback endpoint (`POST /callbacks/complete`): a signed request
completes a waiting run's callback once; anything unsigned, stale, tampered, oversized, of
the wrong type or shape, or with a token that is forged or used, is refused with a 4xx that
says why, and changes nothing."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.dashboard.tasks import MINTED, pay
from tests.fixtures.dashboard import browser_for
from umt_sdk import Engine, RunHandle, UsageError
from umt_sdk.cli._app import InputError
from umt_sdk.cli._dashboard import callback_secrets
from umt_sdk.dashboard import create_app, sign_callback

SECRET = "s" * 16 + "-the-callback-secret-0123456789"
OLD_SECRET = "o" * 40
ACCESS_TOKEN = "operators-only-token"
PATH = "/callbacks/complete"


@pytest.fixture
async def endpoint(dash_engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    """The dashboard behind an access token, with the callback endpoint (two secrets: a
    rotation), and a client that carries no access token (as a webhook sender would not)."""
    app = create_app(dash_engine, token=ACCESS_TOKEN, callback_secret=[SECRET, OLD_SECRET])
    async with browser_for(app) as client:
        client.headers.pop("accept")
        yield client


async def _waiting(engine: Engine, name: str) -> tuple[RunHandle[Any], str]:
    run = await engine.enqueue(pay, name)
    for _ in range(400):
        if (await engine.get(run.run_id)).status == "waiting" and name in MINTED:
            return run, MINTED[name]
        await asyncio.sleep(0.02)
    raise AssertionError(f"run {run.run_id} never waited for its callback")


def _signed(document: Any, *, secret: str = SECRET, **kwargs: Any) -> dict[str, Any]:
    body = json.dumps(document).encode()
    return {"content": body, "headers": sign_callback(secret, body, **kwargs)}


async def test_a_signed_request_completes_the_callback_once(
    dash_engine: Engine, endpoint: httpx.AsyncClient
) -> None:
    async with dash_engine.worker():
        run, token = await _waiting(dash_engine, "once")
        done = await endpoint.post(PATH, **_signed({"token": token, "payload": {"paid": 42}}))
        assert done.status_code == 200, done.text
        assert done.json() == {"completed": True}
        assert await run.result(timeout=30) == {"paid": 42}
        again = await endpoint.post(PATH, **_signed({"token": token, "payload": {"paid": 1}}))
        assert again.status_code == 409
        assert again.json()["error"]["reason"] == "completed"
        assert await run.result(timeout=30) == {"paid": 42}


async def test_a_request_signed_with_the_previous_secret_is_accepted_during_a_rotation(
    dash_engine: Engine, endpoint: httpx.AsyncClient
) -> None:
    async with dash_engine.worker():
        run, token = await _waiting(dash_engine, "rotated")
        done = await endpoint.post(PATH, **_signed({"token": token}, secret=OLD_SECRET))
        assert done.status_code == 200, done.text
        assert await run.result(timeout=30) is None


def _tampered(token: str) -> dict[str, Any]:
    request = _signed({"token": token, "payload": 1})
    request["content"] = json.dumps({"token": token, "payload": 1000}).encode()
    return request


def _bad_requests(token: str) -> list[tuple[str, int, str, dict[str, Any]]]:
    """(what, status, reason, request) for every way a request is refused."""
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    good = _signed({"token": token, "payload": 1})
    raw = json.dumps({"token": token}).encode()
    unsigned_type = {**good["headers"], "Content-Type": "text/plain"}
    return [
        ("not JSON content", 415, "bad_content_type", {**good, "headers": unsigned_type}),
        (
            "too large",
            413,
            "too_large",
            _signed({"token": token, "payload": "x" * 70_000}),
        ),
        (
            "unsigned",
            401,
            "unsigned",
            {"content": raw, "headers": {"Content-Type": "application/json"}},
        ),
        (
            "no signature",
            401,
            "unsigned",
            {
                "content": raw,
                "headers": {
                    "Content-Type": "application/json",
                    "Umt-Timestamp": str(int(time.time())),
                },
            },
        ),
        ("stale", 401, "stale", _signed({"token": token}, timestamp=int(time.time()) - 3600)),
        (
            "from the future",
            401,
            "stale",
            _signed({"token": token}, timestamp=int(time.time()) + 3600),
        ),
        (
            "timestamp not a number",
            401,
            "bad_timestamp",
            {**good, "headers": {**good["headers"], "Umt-Timestamp": "soon"}},
        ),
        ("another secret", 401, "bad_signature", _signed({"token": token}, secret="x" * 40)),
        ("tampered body", 401, "bad_signature", _tampered(token)),
        (
            "signed, not JSON",
            400,
            "bad_json",
            {"content": b"{nope", "headers": sign_callback(SECRET, b"{nope")},
        ),
        ("signed, not an object", 400, "bad_request", _signed([token])),
        ("signed, no token", 400, "bad_request", _signed({"payload": 1})),
        ("signed, other fields", 400, "bad_request", _signed({"token": token, "run": "x"})),
        ("malformed token", 400, "malformed", _signed({"token": "hello"})),
        ("forged token", 404, "unknown", _signed({"token": forged})),
    ]


async def test_every_bad_request_is_refused_with_its_reason_and_changes_nothing(
    dash_engine: Engine, endpoint: httpx.AsyncClient
) -> None:
    async with dash_engine.worker():
        run, token = await _waiting(dash_engine, "refused")
        for what, status, reason, request in _bad_requests(token):
            response = await endpoint.post(PATH, **request)
            assert (response.status_code, response.json()["error"]["reason"]) == (
                status,
                reason,
            ), (what, response.text)
            assert response.json()["error"]["message"], what
        info = await dash_engine.get(run.run_id)
        assert info.status == "waiting"
        assert [v.status for v in info.timeline if v.kind == "fact"] == ["waiting"]
        # The token still works: nothing above used it.
        done = await endpoint.post(PATH, **_signed({"token": token, "payload": "ok"}))
        assert done.status_code == 200, done.text
        assert await run.result(timeout=30) == "ok"


async def test_a_body_without_a_length_is_cut_off_at_the_limit(
    endpoint: httpx.AsyncClient,
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(100):  # 100 KiB, no Content-Length: read until the limit, then refused
            yield b" " * 1024

    response = await endpoint.post(
        PATH,
        content=chunks(),
        headers={"Content-Type": "application/json", "Umt-Timestamp": str(int(time.time()))},
    )
    assert response.status_code == 413, response.text
    assert "content-length" not in response.request.headers


async def test_the_endpoint_needs_no_access_token_but_the_pages_still_do(
    endpoint: httpx.AsyncClient,
) -> None:
    assert (await endpoint.get("/runs")).status_code == 401
    assert (await endpoint.post(PATH, **_signed({"token": "hello"}))).status_code == 400
    assert (await endpoint.get(PATH)).status_code == 405


async def test_without_a_secret_there_is_no_endpoint(dash_engine: Engine) -> None:
    async with browser_for(create_app(dash_engine)) as client:
        assert (await client.post(PATH, **_signed({"token": "hello"}))).status_code == 404


async def test_create_app_refuses_a_short_secret_and_read_only_with_a_secret(
    dash_engine: Engine,
) -> None:
    for secret in ("short", ["s" * 40, "short"], [], 42):
        with pytest.raises(UsageError, match="callback_secret") as caught:
            create_app(dash_engine, callback_secret=secret)  # type: ignore[arg-type]  # under test
        assert caught.value.argument == "callback_secret"
    with pytest.raises(UsageError, match="read-only") as caught:
        create_app(dash_engine, read_only=True, callback_secret=SECRET)
    assert caught.value.argument == "callback_secret"


def test_the_command_reads_its_secrets_from_the_environment() -> None:
    assert callback_secrets(None, read_only=False) is None
    assert callback_secrets(f"{SECRET},{OLD_SECRET}", read_only=False) == [SECRET, OLD_SECRET]
    with pytest.raises(InputError, match="at least 32 characters"):
        callback_secrets("short", read_only=False)
    with pytest.raises(InputError, match="contradict"):
        callback_secrets(SECRET, read_only=True)


def test_sign_callback_refuses_what_it_cannot_sign() -> None:
    with pytest.raises(UsageError, match="secret"):
        sign_callback("", b"{}")
    with pytest.raises(UsageError, match="bytes"):
        sign_callback(SECRET, "{}")  # type: ignore[arg-type]  # under test
