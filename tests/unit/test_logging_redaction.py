"""ctx.logger redacts what handlers receive (formatted text, tracebacks, extras) in every shape
the issue lists, and logging never fails a run."""

from __future__ import annotations

import json
import logging
from typing import Any, cast

import attrs
import pytest

from tests.unit._capture import StrictCapture, capturing, run_logger
from umt_sdk import Registry, TaskContext, connect, task
from umt_sdk._logging import REDACTED, redact, redact_text
from umt_sdk.testing import FakeClock

SECRET = "hunter2-Zx81f0"
NAME = "umt.test.redaction"


def _nested(depth: int, leaf: Any) -> dict[str, Any]:
    value: Any = leaf
    for i in range(depth):
        value = {f"level{i}": value} if i % 2 else {f"level{i}": [value]}
    return cast(dict[str, Any], value)


@attrs.frozen
class Credentials:
    user: str
    password: str


class Connection:
    def __repr__(self) -> str:
        return f"<Connection db=main password={SECRET}>"


def _logged(call: Any) -> StrictCapture:
    with capturing(NAME) as handler:
        call(run_logger(NAME))
    assert handler.records, "the record reached the handler"
    assert SECRET not in handler.everything(), handler.everything()
    return handler


def test_an_exception_logged_as_the_message() -> None:
    handler = _logged(lambda log: log.error(ConnectionError(f"login password={SECRET} refused")))
    assert handler.lines == [f"ERROR {NAME} login password={REDACTED} refused"]


def test_a_secret_key_deeper_than_twenty_levels() -> None:
    deep = _nested(60, {"password": SECRET, "user": "bob"})
    handler = _logged(lambda log: log.info("config %s", deep, extra={"config": deep}))
    assert "'user': 'bob'" in handler.lines[0]


def test_no_recursion_limit_on_structured_values() -> None:
    deep = _nested(10_000, {"Api-Key": SECRET})
    redacted = redact(deep)
    for _ in range(10_000):
        (redacted,) = redacted.values()
        if isinstance(redacted, list):
            (redacted,) = redacted
    assert redacted == {"Api-Key": REDACTED}
    _logged(lambda log: log.info("deep %s", deep, extra={"deep": deep}))


def test_a_dict_that_contains_itself() -> None:
    cyclic: dict[str, Any] = {"token": SECRET}
    cyclic["self"] = cyclic
    assert redact(cyclic) == {"token": REDACTED, "self": "<...>"}
    _logged(lambda log: log.info("cyclic %s", cyclic, extra={"cyclic": cyclic}))


@pytest.mark.parametrize(
    "text",
    [
        json.dumps({"request": {"headers": {"password": SECRET}}}),
        json.dumps({"password": {"nested": [SECRET]}}),
        repr({"request": {"password": SECRET}}),
        repr({"secret": (SECRET, 1)}),
        json.dumps(json.dumps({"token": SECRET})),  # JSON inside a JSON string
        f"X-Api-Key: {SECRET}",
        f"GET /v1 HTTP/1.1\r\nx-api-key: {SECRET}\r\nHost: api",
        f"Cookie: theme=dark; session={SECRET}",
        f"postgresql://app:{SECRET}@db.internal:5432/main",
        f"https://api.example/v1?user=bob&apikey={SECRET}",
        f"privateKey = {SECRET}",
    ],
)
def test_secrets_in_message_text(text: str) -> None:
    _logged(lambda log: log.warning("request failed: %s", text))
    _logged(lambda log: log.warning(f"request failed: {text}"))


def test_an_object_whose_repr_holds_a_password() -> None:
    creds = Credentials(user="bob", password=SECRET)
    handler = _logged(lambda log: log.info("connecting as %r", creds))
    assert handler.lines == [
        f"INFO {NAME} connecting as Credentials(user='bob', password='{REDACTED}')"
    ]
    _logged(lambda log: log.info(Connection()))
    _logged(lambda log: log.info("using %s", Connection(), extra={"conn": Connection()}))


def test_a_logged_traceback() -> None:
    def fail() -> None:
        try:
            raise KeyError({"password": SECRET})
        except KeyError as exc:
            raise RuntimeError(f"X-Api-Key: {SECRET}") from exc

    def log_it(log: Any) -> None:
        try:
            fail()
        except RuntimeError as exc:
            log.exception("call failed")
            log.error("again", exc_info=exc)
            log.warning("and the stack", stack_info=True)

    handler = _logged(log_it)
    assert "Traceback (most recent call last)" in handler.lines[0]
    assert "RuntimeError: X-Api-Key: [REDACTED]" in handler.lines[0]
    assert all(r.exc_info is None for r in handler.records)
    assert "Stack (most recent call last)" in handler.lines[2]


def test_a_secret_argument_is_formatted_then_redacted() -> None:
    # Before: the message was redacted first ("user password=[REDACTED]"), then `% args`
    # raised TypeError ("not all arguments converted").
    handler = _logged(lambda log: log.info("user password=%s", SECRET))
    assert handler.lines == [f"INFO {NAME} user password={REDACTED}"]
    spaced = "two words " + SECRET
    with capturing(NAME) as handler:
        run_logger(NAME).info("token: %s; again: %s", spaced, spaced)
    assert handler.lines == [f"INFO {NAME} token: {REDACTED}; again: {REDACTED}"]
    handler = _logged(
        lambda log: log.info(
            "%(user)s logs in with %(password)s", {"user": "bob", "password": SECRET}
        )
    )
    assert handler.lines == [f"INFO {NAME} bob logs in with {REDACTED}"]


def test_arguments_that_do_not_fit_the_format_are_kept() -> None:
    with capturing(NAME) as handler:
        log = run_logger(NAME)
        log.info("%s and %s", "one")
        log.info("%d items", "many")
        log.info("count %(n)d", {"n": "x", "token": SECRET})
        log.info("fine", extra={"message": "clashes with LogRecord", "args": 1})
    assert handler.lines[0] == (
        f"INFO {NAME} %s and %s [log arguments that do not fit the format (TypeError): 'one']"
    )
    assert handler.lines[1].startswith(f"INFO {NAME} %d items [log arguments")
    assert "'many'" in handler.lines[1]
    assert SECRET not in handler.everything()
    assert handler.records[3].extra_message == "clashes with LogRecord"  # type: ignore[attr-defined]  # set from `extra` at run time


def test_redact_keeps_everything_else() -> None:
    text = "GET /a?x=1 by bob (token expired) took 3 ms: ok"
    assert redact_text(text) == text
    assert redact_text("if token == expected: pass") == "if token == expected: pass"
    assert redact_text("password=[REDACTED] again") == "password=[REDACTED] again"


# -- a run that logs badly still completes --------------------------------------------------------


class BrokenHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("this handler is broken")


@attrs.frozen
class Login:
    password: str


@task("logs.badly", version=1)
async def logs_badly(ctx: TaskContext[Login]) -> str:
    ctx.logger.info("user password=%s", ctx.input.password)
    ctx.logger.info("%s and %s", "one")
    ctx.logger.info("%d", "x")
    ctx.logger.info("clash", extra={"message": 1, "msg": 2})
    ctx.logger.error(ValueError(f"password={ctx.input.password}"))

    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("no")

        __repr__ = __str__

    ctx.logger.info(Unprintable())
    ctx.logger.info("value %s", Unprintable())
    return "done"


async def test_logging_never_fails_a_run() -> None:
    strict = StrictCapture()
    broken = BrokenHandler()
    logger = logging.getLogger("umt.task")
    logger.addHandler(strict)
    logger.addHandler(broken)
    logger.setLevel(logging.DEBUG)
    try:
        engine = await connect(
            "memory://", registry=Registry([logs_badly]), clock=FakeClock(auto_advance=True)
        )
        handle = await engine.enqueue(logs_badly, Login(SECRET))
        async with engine.worker():
            assert await handle.result(timeout=10) == "done"
        info = await engine.get(handle.run_id)
        await engine.close()
    finally:
        logger.removeHandler(strict)
        logger.removeHandler(broken)
    assert info.attempts == 1
    assert info.failures == 0
    assert [line.split(" ", 2)[2] for line in strict.lines] == [
        f"user password={REDACTED}",
        "%s and %s [log arguments that do not fit the format (TypeError): 'one']",
        "%d [log arguments that do not fit the format (TypeError): 'x']",
        "clash",
        f"password={REDACTED}",
        "<Unprintable object that cannot be printed>",
        "value %s [log arguments that do not fit the format (RuntimeError): "
        "<Unprintable object that cannot be printed>]",
    ]
    assert SECRET not in strict.everything()
