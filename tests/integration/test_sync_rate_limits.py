"""`SyncEngine.rate_limits`: the rate limits' management API, blocking, on both backends."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from umt_sdk import RateLimit, RateLimitInfo, Registry, SyncEngine, SyncRateLimits, connect_sync
from umt_sdk.exceptions import UsageError

OPENAI = RateLimit("openai", limit=600, per=timedelta(minutes=1))


@pytest.fixture(
    params=[
        pytest.param("memory", marks=pytest.mark.backend("memory")),
        pytest.param("pg", marks=pytest.mark.backend("pg")),
    ]
)
def facade(request: pytest.FixtureRequest) -> Iterator[SyncEngine]:
    if request.param == "memory":
        engine = connect_sync("memory://", registry=Registry([]))
    else:
        pg_url: str = request.getfixturevalue("pg_url")
        schema: str = request.getfixturevalue("pg_schema")
        engine = connect_sync(pg_url, registry=Registry([]), schema=schema, run_migrations=False)
    with engine:
        yield engine


def _shape(info: RateLimitInfo | None) -> tuple[str, int, timedelta, bool] | None:
    return None if info is None else (info.name, info.limit, info.per, info.paused)


def test_limits_are_set_read_and_listed_from_plain_code(facade: SyncEngine) -> None:
    limits = facade.rate_limits
    assert isinstance(limits, SyncRateLimits)
    assert limits.list() == []
    assert limits.get("openai") is None

    stored = limits.set(OPENAI)
    assert _shape(stored) == ("openai", 600, timedelta(minutes=1), False)
    assert _shape(limits.set("mail", limit=5, per=timedelta(seconds=1))) == (
        "mail",
        5,
        timedelta(seconds=1),
        False,
    )
    changed = limits.set("openai", limit=300, per=timedelta(minutes=1))
    assert _shape(changed) == ("openai", 300, timedelta(minutes=1), False)
    assert _shape(limits.get("openai")) == _shape(changed)
    assert [info.name for info in limits.list()] == ["mail", "openai"]


def test_limits_are_paused_and_resumed_from_plain_code(facade: SyncEngine) -> None:
    limits = facade.rate_limits
    limits.set(OPENAI)
    assert limits.pause("openai") is True
    assert limits.pause("openai") is False
    assert _shape(limits.get("openai")) == ("openai", 600, timedelta(minutes=1), True)
    # A change keeps the pause (as the async API does).
    assert limits.set("openai", limit=10, per=timedelta(seconds=1)).paused is True
    assert limits.resume("openai") is True
    assert limits.resume("openai") is False
    assert [(info.name, info.paused) for info in limits.list()] == [("openai", False)]


def test_the_async_apis_errors_reach_plain_code_unchanged(facade: SyncEngine) -> None:
    limits = facade.rate_limits
    with pytest.raises(UsageError, match="no rate limit of that name is stored"):
        limits.pause("nobody")
    with pytest.raises(UsageError, match="give both limit="):
        limits.set("openai", limit=5)
    with pytest.raises(UsageError, match="rate limit's name"):
        limits.get("not a name!")
    assert limits.list() == []


def test_a_closed_facades_limits_refuse_calls_cleanly() -> None:
    engine = connect_sync("memory://", registry=Registry([]))
    limits = engine.rate_limits
    engine.close()
    with pytest.raises(RuntimeError, match="SyncEngine is closed"):
        limits.list()
