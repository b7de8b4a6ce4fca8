"""Recording an error never depends on the error behaving (issue 33, part 2): whatever a user's
exception does in `__str__` or `__repr__`, however long its message, whatever it holds (NUL,
lone surrogates) and however its `__cause__`/`__context__` chain loops, `error_info` returns a
record Postgres can store, and the message says what the error was."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from umt_sdk._error_info import MESSAGE_LIMIT, error_info


class UserError(Exception):
    """An exception whose printing is chosen by the test."""

    str_mode = "plain"
    repr_mode = "plain"

    def __str__(self) -> str:
        return _behave(self.str_mode, super().__str__())

    def __repr__(self) -> str:
        return _behave(self.repr_mode, super().__repr__())


def _behave(mode: str, text: str) -> Any:
    if mode == "raises":
        raise RuntimeError("printing this error fails")
    if mode == "not_str":
        return 42  # str() then raises TypeError
    if mode == "recursion":
        raise RecursionError("maximum recursion depth exceeded")
    return text


messages = st.one_of(
    st.text(max_size=200),
    st.text(alphabet=st.characters(codec=None), max_size=50),  # surrogates and NUL included
    st.integers(min_value=MESSAGE_LIMIT - 5, max_value=MESSAGE_LIMIT * 3).map(lambda n: "é" * n),
)
modes = st.sampled_from(["plain", "raises", "not_str", "recursion"])
chains = st.sampled_from(["none", "cause", "context", "self_cause", "loop", "deep"])


def _chained(exc: BaseException, chain: str) -> None:
    other = ValueError("the cause")
    if chain == "cause":
        exc.__cause__ = other
    elif chain == "context":
        exc.__context__ = other
    elif chain == "self_cause":
        exc.__cause__ = exc
    elif chain == "loop":
        exc.__cause__ = other
        other.__context__ = exc
    elif chain == "deep":
        link: BaseException = exc
        for n in range(3_000):
            nxt = KeyError(n)
            link.__cause__ = nxt
            link = nxt


@given(message=messages, str_mode=modes, repr_mode=modes, chain=chains, raised=st.booleans())
def test_any_error_is_recorded_as_storable_text(
    message: str, str_mode: str, repr_mode: str, chain: str, raised: bool
) -> None:
    exc = UserError(message)
    exc.str_mode = str_mode
    exc.repr_mode = repr_mode
    _chained(exc, chain)
    if raised:  # with a traceback of its own, as a step's error has
        try:
            raise exc
        except UserError as caught:
            exc = caught

    info = error_info(exc)

    assert info.type.endswith("UserError")
    for text in (info.type, info.message, info.traceback):
        assert isinstance(text, str)
        assert "\x00" not in text
        text.encode("utf-8")  # no lone surrogate: Postgres takes it
    json.dumps({"type": info.type, "message": info.message, "traceback": info.traceback})
    if str_mode == "plain":
        assert len(info.message) <= MESSAGE_LIMIT * 6 + 100  # escapes may widen what is kept
        if len(message) > MESSAGE_LIMIT:
            assert info.message.endswith(f"({len(message) - MESSAGE_LIMIT} more characters)")
    else:
        assert "unprintable UserError" in info.message
    assert len(info.traceback) <= 8_000 * 6


def test_an_error_whose_printing_raises_a_base_exception_is_still_recorded() -> None:
    """`__str__` raising something that is not an `Exception` (a `KeyboardInterrupt` of its own
    making, say) must not escape the failure path either."""

    class Rude(Exception):
        def __str__(self) -> str:
            raise KeyboardInterrupt

        def __repr__(self) -> str:
            raise SystemExit(3)

    info = error_info(Rude())
    assert "unprintable" in info.message
    assert info.type.endswith("Rude")
