"""The dashboard's signed HTTP endpoint for callback tokens: `POST /callbacks/complete`.

A service outside the engine (your payment relay, another team's system) completes a
callback by POSTing `{"token": ..., "payload": ...}` as JSON, signed with a secret it shares
with the dashboard:

    Umt-Timestamp: <unix seconds>
    Umt-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>." + body)>

The signature covers the timestamp and the exact bytes of the body, so neither can be changed;
the timestamp must be within `TOLERANCE` of the server's clock, so a captured request cannot
be replayed later (and a replay within the window is refused anyway: a token completes once).
Nothing the caller sends is trusted before the signature matches: the content type and size
are checked first, the body is read up to `MAX_BODY` bytes, the signature compared in constant
time with every configured secret (several during a rotation), and only then is the JSON
parsed and `engine.complete_callback` called, which checks the token itself. Every refusal is
a JSON `{"error": {"reason": ..., "message": ...}}` with a 4xx status, and stores nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Sequence
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from umt_sdk._engine import Engine
from umt_sdk.exceptions import CallbackTokenError, PayloadError, UmtError, UsageError

__all__ = [
    "MAX_BODY",
    "MIN_SECRET_LENGTH",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "TOLERANCE",
    "check_secrets",
    "complete",
    "sign_callback",
]

SIGNATURE_HEADER = "Umt-Signature"
TIMESTAMP_HEADER = "Umt-Timestamp"
MAX_BODY = 65_536
"""The largest body accepted, in bytes (a token and a webhook's payload)."""
TOLERANCE = 300
"""How far, in seconds, a request's timestamp may be from the server's clock (either way)."""
MIN_SECRET_LENGTH = 32

_STATUS_OF_REASON = {
    "malformed": 400,
    "unknown": 404,
    "expired": 410,
    "completed": 409,
    "finished": 409,
}


def _mac(secret: str, timestamp: str, body: bytes) -> str:
    message = timestamp.encode("ascii") + b"." + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign_callback(secret: str, body: bytes, *, timestamp: int | None = None) -> dict[str, str]:
    """The headers that sign `body` for the dashboard's callback endpoint.

    Args:
        secret: the secret the dashboard was given (`create_app(callback_secret=...)`,
            `UMT_CALLBACK_SECRET`).
        body: the exact bytes you POST (`json.dumps({"token": t, "payload": p}).encode()`).
        timestamp: unix seconds; None: now.

    Returns:
        `Umt-Timestamp`, `Umt-Signature` and `Content-Type` headers to send with the body.
    """
    if not isinstance(secret, str) or not secret:
        raise UsageError("sign_callback(secret=...) needs the secret, a string", argument="secret")
    if not isinstance(body, bytes | bytearray):
        raise UsageError(
            f"sign_callback(body=...) needs the exact bytes you send, got {type(body).__name__}",
            argument="body",
        )
    stamp = str(int(time.time()) if timestamp is None else int(timestamp))
    return {
        TIMESTAMP_HEADER: stamp,
        SIGNATURE_HEADER: f"v1={_mac(secret, stamp, bytes(body))}",
        "Content-Type": "application/json",
    }


def check_secrets(secret: str | Sequence[str] | None) -> tuple[str, ...]:
    """The configured secrets (a rotation may give several), each checked; () for None."""
    if secret is None:
        return ()
    secrets = [secret] if isinstance(secret, str) else secret
    if not isinstance(secrets, Sequence) or not secrets:
        raise UsageError(
            "create_app(callback_secret=...) takes a secret (a string) or a list of them "
            "(during a rotation), or None for no callback endpoint",
            argument="callback_secret",
        )
    for one in secrets:
        if not isinstance(one, str) or len(one) < MIN_SECRET_LENGTH:
            raise UsageError(
                f"create_app(callback_secret=...): each secret needs at least "
                f"{MIN_SECRET_LENGTH} characters (such as the output of `python -c 'import "
                "secrets; print(secrets.token_urlsafe(32))'`)",
                argument="callback_secret",
            )
    return tuple(secrets)


def _refuse(status: int, reason: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"reason": reason, "message": message}}, status_code=status)


async def _body(request: Request) -> bytes | JSONResponse:
    """The body, read up to `MAX_BODY` bytes (a longer one is refused without reading it
    all, whatever its Content-Length claims)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            return _refuse(400, "bad_request", "Content-Length is not a number")
        if int(declared) > MAX_BODY:
            return _refuse(413, "too_large", f"the body is larger than {MAX_BODY} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                return _refuse(413, "too_large", f"the body is larger than {MAX_BODY} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        return _refuse(400, "bad_request", "the client disconnected before the body's end")
    return b"".join(chunks)


def _signed(request: Request, body: bytes, secrets: Sequence[str]) -> JSONResponse | None:
    """None when the request is signed by one of `secrets` within the tolerance; else the
    refusal."""
    stamp = request.headers.get(TIMESTAMP_HEADER, "")
    if not stamp:
        return _refuse(401, "unsigned", f"the request has no {TIMESTAMP_HEADER} header")
    if not stamp.isdigit() or len(stamp) > 12:
        return _refuse(401, "bad_timestamp", f"{TIMESTAMP_HEADER} must be unix seconds")
    if abs(time.time() - int(stamp)) > TOLERANCE:
        return _refuse(
            401,
            "stale",
            f"{TIMESTAMP_HEADER} is more than {TOLERANCE} s from the server's clock: sign "
            "each request when you send it (and check your clock)",
        )
    given = request.headers.get(SIGNATURE_HEADER, "")
    if not given:
        return _refuse(401, "unsigned", f"the request has no {SIGNATURE_HEADER} header")
    # `v1=<hex>`, possibly several comma-separated (a sender signing with two secrets).
    candidates = [part.strip().removeprefix("v1=") for part in given.split(",")[:4]]
    matched = False
    for secret in secrets:  # every pair compared: the time says nothing about which matched
        expected = _mac(secret, stamp, body).encode()
        for candidate in candidates:
            if hmac.compare_digest(expected, candidate.encode("ascii", "replace")):
                matched = True
    if not matched:
        return _refuse(
            401,
            "bad_signature",
            f"{SIGNATURE_HEADER} does not match: sign '<timestamp>.<body>' with HMAC-SHA256 "
            "and the dashboard's callback secret, and send the body unchanged",
        )
    return None


async def complete(engine: Engine, request: Request, secrets: Sequence[str]) -> JSONResponse:
    """Handle `POST /callbacks/complete`: check, verify, then `engine.complete_callback`."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        return _refuse(415, "bad_content_type", "send the body as Content-Type: application/json")
    body = await _body(request)
    if isinstance(body, JSONResponse):
        return body
    refused = _signed(request, body, secrets)
    if refused is not None:
        return refused
    try:
        document: Any = json.loads(body)
    except (ValueError, RecursionError):
        return _refuse(400, "bad_json", "the body is not JSON")
    if not isinstance(document, dict) or not isinstance(document.get("token"), str):
        return _refuse(
            400,
            "bad_request",
            'the body must be a JSON object {"token": "<the callback token>", "payload": ...}',
        )
    unknown = sorted(set(document) - {"token", "payload"})
    if unknown:
        return _refuse(
            400, "bad_request", f"the body has fields besides token and payload: {unknown[:5]}"
        )
    try:
        await engine.complete_callback(document["token"], document.get("payload"))
    except CallbackTokenError as exc:
        return _refuse(_STATUS_OF_REASON.get(exc.reason, 400), exc.reason or "refused", str(exc))
    except (PayloadError, UsageError) as exc:
        return _refuse(400, "bad_payload", str(exc))
    except UmtError as exc:
        return _refuse(503, "unavailable", f"the engine could not store it: {exc}")
    return JSONResponse({"completed": True})
