"""Callback tokens: a run mints an unguessable single-use token, hands it to the outside
world, and waits for someone to complete it with a payload.

Built on steps and facts, not beside them:
- `ctx.step.callback_token(name, timeout=...)` is a step: its record (kind `step`) keeps the
  token, the fact that completes it and when it expires, so a replay returns the same token;
- `ctx.step.wait_for_callback(token)` is a fact wait on that fact (a record named after it),
  parked in the store like any fact wait, with the token's expiry as its deadline;
- `engine.complete_callback(token, payload)` checks the token against the run's record and
  stores the fact: first write wins, so a token completes its wait exactly once.

A token is `umtcb1.<run id, 32 hex>.<secret, 43 url-safe characters>`: the secret is 256
random bits (`secrets.token_urlsafe(32)`), never derived from anything guessable; the run id
only says where to look. What a caller sends is checked for shape and size before anything
is read, and compared with the stored token in constant time.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
from collections.abc import Iterable
from datetime import datetime
from typing import Any
from uuid import UUID

from attrs import frozen

from umt_sdk._check import shown
from umt_sdk._spi import StepRecord
from umt_sdk.exceptions import CallbackTokenError

__all__ = [
    "CALLBACK_FACT_PREFIX",
    "MintedCallback",
    "callback_envelope",
    "find_minted",
    "mint_token",
    "minted_for",
    "minted_of",
    "parse_token",
]

CALLBACK_FACT_PREFIX = "umt.callback:"
"""The facts that complete callbacks: `umt.callback:<the callback step's name>`. Reserved:
`signal` and `broadcast` refuse them, so only a token completes a callback."""

_TOKEN_PREFIX = "umtcb1"
_TOKEN = re.compile(r"umtcb1\.([0-9a-f]{32})\.([A-Za-z0-9_-]{43})")
_TOKEN_LENGTH = len(_TOKEN_PREFIX) + 1 + 32 + 1 + 43
_ENVELOPE_KEY = "umt_callback"


@frozen(kw_only=True)
class MintedCallback:
    """What a callback step recorded: its token, the fact that completes it, its expiry."""

    step_name: str
    token: str
    fact: str
    expires_at: datetime


def mint_token(run_id: UUID) -> str:
    """A new token for the run: its id, then 256 random bits."""
    return f"{_TOKEN_PREFIX}.{run_id.hex}.{secrets.token_urlsafe(32)}"


def parse_token(token: object, *, where: str) -> UUID:
    """The run id a well-formed token names; `CallbackTokenError` for anything else (checked
    on the size first, so nothing long is scanned)."""
    if isinstance(token, str) and len(token) == _TOKEN_LENGTH:
        match = _TOKEN.fullmatch(token)
        if match is not None:
            return UUID(hex=match.group(1))
    what = (
        f"a {type(token).__name__}"
        if not isinstance(token, str)
        else f"{len(token)} characters"
        if len(token) != _TOKEN_LENGTH
        else shown(token[:12] + "...")
    )
    raise CallbackTokenError(
        f"{where}: token is malformed: a callback token is the text "
        f"ctx.step.callback_token() returned ('umtcb1.' and {_TOKEN_LENGTH - 7} more "
        f"characters), got {what}",
        reason="malformed",
    )


def callback_envelope(step_name: str, token: str, expires_at: datetime) -> str:
    """The output a callback step records (parsed back by `find_minted` and replays)."""
    return json.dumps(
        {
            _ENVELOPE_KEY: {
                "token": token,
                "fact": CALLBACK_FACT_PREFIX + step_name,
                "expires_at": expires_at.isoformat(),
            }
        }
    )


def minted_of(record: StepRecord) -> MintedCallback | None:
    """The callback a step record minted, or None for any other record."""
    if record.kind != "step" or record.status != "completed" or not record.output_json:
        return None
    if not record.output_json.startswith('{"' + _ENVELOPE_KEY + '"'):
        return None
    raw: Any = json.loads(record.output_json)
    body = raw.get(_ENVELOPE_KEY) if isinstance(raw, dict) else None
    if not isinstance(body, dict):
        return None
    return MintedCallback(
        step_name=record.name,
        token=str(body["token"]),
        fact=str(body["fact"]),
        expires_at=datetime.fromisoformat(str(body["expires_at"])),
    )


def minted_for(record: StepRecord, run_id: UUID) -> bool:
    """False for a callback record whose token is another run's (a fork copies the records
    it keeps): the fork mints its own. True for every other record (a plain step's record
    is the code's business: replay reports a changed kind as non-determinism)."""
    minted = minted_of(record)
    return minted is None or minted.token.startswith(f"{_TOKEN_PREFIX}.{run_id.hex}.")


def find_minted(records: Iterable[StepRecord], token: str) -> MintedCallback | None:
    """The callback among `records` whose token is `token`, compared in constant time (every
    candidate is compared, so the time says nothing about which one matched)."""
    found: MintedCallback | None = None
    for record in records:
        minted = minted_of(record)
        if minted is not None and hmac.compare_digest(
            minted.token.encode("ascii"), token.encode("ascii")
        ):
            found = minted
    return found
