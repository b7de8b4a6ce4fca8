"""Property: a secret, in any of the shapes a log line carries it, never reaches a handler.

Each example draws a secret made of three distinctive pieces with arbitrary characters between
them (so a redaction that stops early is caught: the later pieces leak), a secret key spelled
any way, and a shape: `key=value` text, a format argument, JSON and dict reprs nested up to 200
levels (also as arguments and `extra`), JSON inside a JSON string, an object's repr, HTTP
headers, URLs, an exception's message, and the same inside a logged traceback.
"""

from __future__ import annotations

import json
import string
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit._capture import capturing, run_logger

NAME = "umt.test.redaction.property"

KEYS = [
    "password",
    "Password",
    "DB_PASSWORD",
    "passwd",
    "passphrase",
    "passkey",
    "secret",
    "client_secret",
    "token",
    "access_token",
    "Refresh-Token",
    "api_key",
    "api-key",
    "apiKey",
    "APIKEY",
    "X-Api-Key",
    "x_api_key",
    "private_key",
    "privateKey",
    "authorization",
    "cookie",
]
# Characters an unquoted value may hold (it ends at whitespace or , ; & ' " < > ( ) [ ] { }).
UNQUOTED = string.ascii_letters + string.digits + "-_.~+/=!@$%^*:|"
# A URL's password: no / ? # (they end the authority), percent-encoded otherwise.
USERINFO = string.ascii_letters + string.digits + "-_.~+=!$%*:@"


@st.composite
def secrets(draw: st.DrawFn, alphabet: str | None) -> tuple[str, tuple[str, ...]]:
    """(secret, pieces): the pieces must never appear in anything a handler receives."""
    pieces = tuple(f"{tag}{draw(st.integers(16**7, 16**8 - 1)):08x}" for tag in ("Zx", "Wy", "Vu"))
    chars = (
        st.characters(blacklist_categories=("Cs",))
        if alphabet is None
        else st.sampled_from(alphabet)
    )
    noise = [draw(st.text(chars, max_size=6)) for _ in range(2)]
    return pieces[0] + noise[0] + pieces[1] + noise[1] + pieces[2], pieces


def nest(draw: st.DrawFn, key: str, secret: str) -> Any:
    """The secret under `key`, at the bottom of up to 200 levels of dicts and lists."""
    value: Any = {key: secret, "keepme": 1}
    if draw(st.booleans()):
        value = {key: [{"inner": secret}], "keepme": 1}
    for level in range(draw(st.integers(0, 200))):
        value = [value, level] if level % 3 == 2 else {f"k{level}": value, "n": level}
    return value


class Vault:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"<Vault {self.text}>"


@st.composite
def log_calls(draw: st.DrawFn) -> tuple[tuple[str, ...], Any]:
    """(pieces, call): `call(logger)` logs a line that carries the secret in one shape."""
    key = draw(st.sampled_from(KEYS))
    shape = draw(
        st.sampled_from(
            [
                "pair",
                "argument",
                "json",
                "repr",
                "structured",
                "extra",
                "json-in-json",
                "object",
                "header",
                "url",
                "query",
                "exception",
                "traceback",
            ]
        )
    )
    quoted = shape in ("argument", "json", "repr", "structured", "extra", "json-in-json")
    alphabet = None if quoted else USERINFO if shape == "url" else UNQUOTED
    secret, pieces = draw(secrets(alphabet))
    sep = draw(st.sampled_from(["=", ": ", " = ", ":", "\t=\t"]))
    pair = f"keepme {key}{sep}{secret} keepme"
    if shape in ("exception", "traceback"):
        inner = draw(st.sampled_from(["pair", "json", "repr", "header"]))
        if inner == "json":
            pair = json.dumps(nest(draw, key, secret))
        elif inner == "repr":
            pair = repr(nest(draw, key, secret))
        elif inner == "header":
            pair = f"keepme\r\nX-Api-Key: {secret}\r\nAuthorization: Bearer {secret}\r\n"

    nested = nest(draw, key, secret)
    ascii_only = draw(st.booleans())
    header = draw(
        st.sampled_from(
            [
                f"X-Api-Key: {secret}",
                f"Authorization: Bearer {secret}",
                f"Proxy-Authorization: Basic {secret}",
                f"Cookie: theme=dark; sid={secret}",
                f"Set-Cookie: sid={secret}; Path=/",
            ]
        )
    )

    def call(log: Any) -> None:
        if shape == "pair":
            log.info(pair)
        elif shape == "argument":
            log.info(f"keepme {key}{sep}%s keepme", secret)
        elif shape == "json":
            log.info("body " + json.dumps(nested, ensure_ascii=ascii_only))
        elif shape == "repr":
            log.info("state " + repr(nested))
        elif shape == "structured":
            log.info("config %s", nested)
        elif shape == "extra":
            log.info("keepme", extra={"config": nested})
        elif shape == "json-in-json":
            log.info(json.dumps({"body": json.dumps(nested)}))
        elif shape == "object":
            log.info("vault %r", Vault(f"{key}={secret}"), extra={"vault": Vault(pair)})
        elif shape == "header":
            log.info(f"keepme\r\nHost: api\r\n{header}\r\nAccept: */*")
        elif shape == "url":
            log.info(f"keepme postgresql://app:{secret}@db:5432/main keepme")
        elif shape == "query":
            log.info(f"GET https://api.example/v1?keepme=1&{key}={secret}&x=2 keepme")
        elif shape == "exception":
            log.error(ValueError(pair))
        else:
            try:
                try:
                    raise KeyError(pair)
                except KeyError as exc:
                    raise RuntimeError(pair) from exc
            except RuntimeError:
                log.exception("keepme")

    return pieces, _Described(call, f"shape={shape} key={key!r} sep={sep!r} secret={secret!r}")


class _Described:
    def __init__(self, call: Any, text: str) -> None:
        self.call = call
        self.text = text

    def __call__(self, log: Any) -> None:
        self.call(log)

    def __repr__(self) -> str:
        return self.text


@settings(max_examples=500, deadline=None)  # about a second: each example is cheap
@given(log_calls())
def test_no_secret_reaches_a_handler(case: tuple[tuple[str, ...], Any]) -> None:
    pieces, call = case
    with capturing(NAME) as handler:
        call(run_logger(NAME))
    assert len(handler.records) == 1, "the line is logged, not lost"
    received = handler.everything()
    for piece in pieces:
        assert piece not in received, received
    assert "keepme" in received, "the rest of the text is kept"
