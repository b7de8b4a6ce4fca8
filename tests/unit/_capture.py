"""A real logging handler that keeps what any handler would see, and a RunLogger to feed it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from umt_sdk._logging import RunLogger

# What a plain handler prints: the message, then the traceback (exc_text) and the stack.
FORMAT = "%(levelname)s %(name)s %(message)s"


class StrictCapture(logging.Handler):
    """Formats in `emit` without catching anything, as many custom handlers do: a record that
    cannot be formatted raises here (through `Logger.handle`) instead of being dropped."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter(FORMAT))
        self.records: list[logging.LogRecord] = []
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))
        self.records.append(record)

    def everything(self) -> str:
        """Every formatted line, and the text of everything every record holds (walked with a
        stack: an `extra` value may be nested deeper than `repr` can go)."""
        parts = list(self.lines)
        stack: list[Any] = [vars(r) for r in self.records]
        seen: set[int] = set()
        while stack:
            value = stack.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, dict):
                stack.extend(value.keys())
                stack.extend(value.values())
            elif isinstance(value, list | tuple | set | frozenset):
                stack.extend(value)
            else:
                parts.append(repr(value))
        return "\n".join(parts)


@contextmanager
def capturing(name: str) -> Iterator[StrictCapture]:
    handler = StrictCapture()
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    old_level, old_propagate = logger.level, logger.propagate
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate


def run_logger(name: str) -> RunLogger:
    return RunLogger(
        logging.getLogger(name),
        {"umt_run_id": "r", "umt_task": "t", "umt_version": 1, "umt_trace_id": "0" * 32},
        context=lambda: {"umt_step": None, "umt_span_id": None},
        replaying=lambda: False,
    )
