"""Who may look and who may act: the access token, the CSRF check and the response headers.

With a token (`create_app(token=...)`, `UMT_DASHBOARD_TOKEN`), every request needs it: in an
`Authorization: Bearer` header, or in the cookie that `/login` sets once the token was typed.
Every action (a POST) also needs the CSRF token of the form (double-submit: the form's hidden
field must equal the `umt_csrf` cookie, which another site can neither read nor set), and an
`Origin`, when the browser sends one, of this very host.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

__all__ = [
    "CSRF_COOKIE",
    "CSRF_FIELD",
    "TOKEN_COOKIE",
    "csrf_ok",
    "csrf_token",
    "is_loopback",
    "same_origin",
    "security_headers",
    "token_matches",
]

TOKEN_COOKIE = "umt_dashboard_token"
CSRF_COOKIE = "umt_csrf"
CSRF_FIELD = "csrf"

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
"""No inline script or style runs, whatever a stored value holds: even an escaping mistake
could not execute."""


def token_matches(request: Request, token: str) -> bool:
    """Whether the request carries the access token (header or cookie), compared in constant
    time."""
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return True
    cookie = request.cookies.get(TOKEN_COOKIE, "")
    return bool(cookie) and hmac.compare_digest(cookie.encode(), token.encode())


def csrf_token(request: Request) -> str:
    """The CSRF token of this browser (its cookie's), or a new one (set on the response by
    `security_headers`)."""
    existing = request.cookies.get(CSRF_COOKIE, "")
    if len(existing) == 43 and existing.replace("-", "").replace("_", "").isalnum():
        return existing
    fresh: str | None = getattr(request.state, "new_csrf", None)
    if fresh is None:
        fresh = secrets.token_urlsafe(32)
        request.state.new_csrf = fresh
    return fresh


def csrf_ok(request: Request, submitted: str) -> bool:
    """Whether the form's CSRF field equals the browser's cookie (double submit)."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    return bool(cookie) and bool(submitted) and hmac.compare_digest(cookie, submitted)


def same_origin(request: Request) -> bool:
    """An `Origin` (or, without one, a `Referer`) the browser sent names this host."""
    origin = request.headers.get("origin") or request.headers.get("referer")
    if not origin or origin == "null":
        return origin is None
    host = request.headers.get("host", "")
    return urlsplit(origin).netloc == host


def is_loopback(host: str) -> bool:
    """Whether `host` only listens on this machine."""
    return host in {"127.0.0.1", "::1", "localhost"} or host.startswith("127.")


async def security_headers(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """Middleware: the content security policy and friends on every response, and the CSRF
    cookie when this browser has none."""
    response = await call_next(request)
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers.setdefault("Cache-Control", "no-store")
    fresh = getattr(request.state, "new_csrf", None)
    if fresh:
        response.set_cookie(
            CSRF_COOKIE,
            fresh,
            httponly=True,
            samesite="strict",
            path=request.scope.get("root_path", "") or "/",
        )
    return response
