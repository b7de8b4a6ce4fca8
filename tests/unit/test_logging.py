"""ctx.logger: identity on every record, secrets redacted before handlers, quiet replays."""

from __future__ import annotations

import logging
from datetime import timedelta

import attrs
import pytest

from umt_sdk import Registry, TaskContext, connect, task
from umt_sdk._logging import REDACTED, redact, redact_text
from umt_sdk.testing import FakeClock


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def texts(self) -> list[str]:
        return [self.format(r) for r in self.records]


@pytest.fixture
def capture() -> Capture:
    handler = Capture()
    logger = logging.getLogger("umt.task")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("GET https://t.example/announce?passkey=abc123&info=1", "abc123"),
        ("https://api.example/v1?x=1&TOKEN=tok-9", "tok-9"),
        ("https://api.example/v1?access_token=at-5#frag", "at-5"),
        ("url https://h/p?api_key=k-1;session=2", "k-1"),
        ("Authorization: Bearer eyJhbGciOi", "eyJhbGciOi"),
        ("password=hunter2 and more", "hunter2"),
        ("Cookie: sid=abc", "sid=abc"),
        ("client_secret: s3cr3t", "s3cr3t"),
    ],
)
def test_redact_text(text: str, secret: str) -> None:
    redacted = redact_text(text)
    assert secret not in redacted
    assert REDACTED in redacted


def test_redact_nested_keys_case_insensitive() -> None:
    value = {
        "Token": "a",
        "user": "bob",
        "nested": {"API_KEY": "b", "items": [{"Cookie": "c"}, "http://x?secret=d", 5]},
        "tuple": ("password=e",),
    }
    assert redact(value) == {
        "Token": REDACTED,
        "user": "bob",
        "nested": {
            "API_KEY": REDACTED,
            "items": [{"Cookie": REDACTED}, f"http://x?secret={REDACTED}", 5],
        },
        "tuple": (f"password={REDACTED}",),
    }
    assert value["Token"] == "a", "the caller's data is not changed"


@attrs.frozen
class In:
    url: str


@task("logs", version=1)
async def logs(ctx: TaskContext[In]) -> None:
    ctx.logger.info("starting %s", ctx.input.url)
    ctx.logger.info("config %s", {"user": "bob", "password": "p4ss"}, extra={"token": "t0k"})
    ctx.logger.info("mapping %(url)s", {"url": ctx.input.url})

    async def fetch() -> str:
        ctx.logger.warning("fetching %s", ctx.input.url)
        try:
            raise ConnectionError(f"GET {ctx.input.url} failed")
        except ConnectionError:
            ctx.logger.exception("fetch failed")
        return "ok"

    await ctx.step.run("fetch", fetch)
    await ctx.step.sleep("nap", timedelta(seconds=30))
    ctx.logger.info("after the nap")


async def test_task_logger_redacts_and_skips_replays(capture: Capture) -> None:
    engine = await connect(
        "memory://", registry=Registry([logs]), clock=FakeClock(auto_advance=True)
    )
    url = "https://tracker.example/announce?passkey=SECRET1&id=7"
    handle = await engine.enqueue(logs, In(url))
    async with engine.worker():
        await handle.result(timeout=10)
    await engine.close()

    texts = capture.texts()
    joined = "\n".join(texts)
    assert "SECRET1" not in joined
    assert "p4ss" not in joined
    assert all("t0k" not in str(vars(r)) for r in capture.records), "extra fields too"
    assert any("Traceback" in t and "ConnectionError" in t for t in texts), (
        "redacted traceback kept"
    )
    assert all(r.exc_info is None for r in capture.records), "raw exceptions never reach handlers"
    messages = [r.getMessage() for r in capture.records]
    # First execution: everything up to the sleep; the resumed one replays silently, then logs on.
    assert [m.split(" ")[0] for m in messages] == [
        "starting",
        "config",
        "mapping",
        "fetching",
        "fetch",
        "after",
    ], messages
    record = capture.records[0]
    assert record.umt_run_id == str(handle.run_id)  # type: ignore[attr-defined]
    assert record.umt_task == "logs"  # type: ignore[attr-defined]
    assert record.umt_version == 1  # type: ignore[attr-defined]
    assert len(record.umt_trace_id) == 32  # type: ignore[attr-defined]
    fetching = capture.records[3]
    assert fetching.umt_step == "fetch"  # type: ignore[attr-defined]
