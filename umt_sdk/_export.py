"""A run's recorded history as a documented, versioned JSON record (format `umt.history`,
version 1): what `Engine.export_history` returns, what `umt runs export` prints one per line,
and what `umt_sdk.testing.Replayer` replays against today's code.

It carries what the run stored and nothing more: the task, its version and input, the run's
status, output and error, and each step record (its name, kind, status, attempt, output or
error, and times). Tracebacks are left out. Reading refuses anything that is not such a record,
naming the line and the field, and a `format_version` it does not know.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NoReturn, get_args
from uuid import UUID

from attrs import field, frozen

from umt_sdk import _serde
from umt_sdk._check import shown
from umt_sdk._spi import ErrorInfo, RunRecord, RunStatus, StepKind, StepRecord, StepStatus
from umt_sdk.exceptions import PayloadError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HistoryStep",
    "RunHistory",
    "history_of",
    "step_records",
]

FORMAT = "umt.history"
FORMAT_VERSION = 1

_RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)
_STEP_KINDS: tuple[str, ...] = get_args(StepKind)
_STEP_STATUSES: tuple[str, ...] = get_args(StepStatus)

# A history line holds payloads (the input, each output) inside its own few levels, and many
# of them: larger limits than one payload's, still bounded.
_LINE_DEPTH = _serde.MAX_DEPTH + 8
_LINE_BYTES = 256 * 1024 * 1024


def _tz_aware(_: object, attribute: Any, value: datetime | None) -> None:
    if value is not None and value.tzinfo is None:
        raise ValueError(f"{attribute.name} must be timezone-aware, got {value!r}")


def _tz_aware_required(_: object, attribute: Any, value: datetime) -> None:
    _tz_aware(_, attribute, value)


@frozen(kw_only=True)
class HistoryStep:
    """One recorded step attempt of an exported history (a step, a sleep or a fact wait)."""

    name: str
    """As recorded: `name`, or `name#2` for the second use of a name in one execution."""
    kind: StepKind
    status: StepStatus
    attempt: int = 1
    output: Any = None
    """The recorded output, parsed JSON (None when there is none). A fact wait's output is
    `{"fact": payload, "source": "signal" | "check"}`, or `{"timeout": true}`."""
    error: ErrorInfo | None = None
    """For a `failed` or `retrying` attempt: the error's type and message (no traceback)."""
    started_at: datetime | None = field(default=None, validator=_tz_aware)
    finished_at: datetime | None = field(default=None, validator=_tz_aware)
    wake_at: datetime | None = field(default=None, validator=_tz_aware)
    """Sleeps and fact waits: when the sleep ends or the wait times out."""


@frozen(kw_only=True)
class RunHistory:
    """A run's recorded history, as `Engine.export_history` exports it.

    `to_json()` writes it as one line of JSON (format `umt.history`, version 1, documented
    field by field in docs/testing.md); `from_json()` and `from_jsonl()` read it back and
    refuse anything else with a `PayloadError` naming the line and the field.
    """

    run_id: UUID
    task: str
    version: int
    status: RunStatus
    input: Any
    """The run's input, parsed JSON."""
    created_at: datetime = field(validator=_tz_aware_required)
    finished_at: datetime | None = field(default=None, validator=_tz_aware)
    output: Any = None
    """The run's output (parsed JSON) once it completed, else None."""
    error: ErrorInfo | None = None
    """The run's last error (type and message), if any."""
    steps: tuple[HistoryStep, ...] = ()
    """Every step attempt, in the order each step was first recorded."""

    def to_json(self) -> str:
        """This history as one line of JSON (no newline)."""
        return json.dumps(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "run_id": str(self.run_id),
                "task": self.task,
                "version": self.version,
                "status": self.status,
                "created_at": _time_text(self.created_at),
                "finished_at": _time_text(self.finished_at),
                "input": self.input,
                "output": self.output,
                "error": _error_json(self.error),
                "steps": [
                    {
                        "name": s.name,
                        "kind": s.kind,
                        "status": s.status,
                        "attempt": s.attempt,
                        "output": s.output,
                        "error": _error_json(s.error),
                        "started_at": _time_text(s.started_at),
                        "finished_at": _time_text(s.finished_at),
                        "wake_at": _time_text(s.wake_at),
                    }
                    for s in self.steps
                ],
            },
            ensure_ascii=False,
            allow_nan=False,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "history") -> RunHistory:
        """Read one history written by `to_json()`; `where` names it in errors (a file and
        line, say). Raises `PayloadError` naming the field for anything else."""
        raw = _serde.parse_json(text, what=where, max_depth=_LINE_DEPTH, max_bytes=_LINE_BYTES)
        return _Reader(where).history(raw)

    @classmethod
    def from_jsonl(cls, text: str | bytes, *, source: str = "histories") -> list[RunHistory]:
        """Read every history of a JSON Lines text (one per line, blank lines skipped), as
        `umt runs export` writes them; errors name `source` and the line."""
        if isinstance(text, bytes | bytearray):
            data = bytes(text)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                line = data.count(b"\n", 0, exc.start) + 1
                raise PayloadError(
                    f"{source} line {line}: not valid UTF-8 ({exc.reason})", field=source
                ) from None
        if not isinstance(text, str):
            raise PayloadError(
                f"{source}: expected JSON Lines text, got {shown(text)}", field=source
            )
        # Lines end at "\n" only (JSON Lines): U+2028 and the like may stand in a payload.
        return [
            cls.from_json(line.removesuffix("\r"), where=f"{source} line {number}")
            for number, line in enumerate(text.split("\n"), start=1)
            if line.strip()
        ]


def history_of(record: RunRecord) -> RunHistory:
    """The history of a run as `get_run` read it (with its steps)."""
    return RunHistory(
        run_id=record.run_id,
        task=record.task_name,
        version=record.task_version,
        status=record.status,
        input=json.loads(record.input_json),
        created_at=record.created_at,
        finished_at=record.finished_at,
        output=None if record.output_json is None else json.loads(record.output_json),
        error=_short(record.error),
        steps=tuple(
            HistoryStep(
                name=s.name,
                kind=s.kind,
                status=s.status,
                attempt=s.attempt,
                output=None if s.output_json is None else json.loads(s.output_json),
                error=_short(s.error),
                started_at=s.started_at,
                finished_at=s.finished_at,
                wake_at=s.wake_at,
            )
            for s in record.steps
        ),
    )


def step_records(history: RunHistory) -> list[StepRecord]:
    """The step records a replay of `history` starts from."""
    return [
        StepRecord(
            name=s.name,
            kind=s.kind,
            status=s.status,
            attempt=s.attempt,
            fencing_token=1,
            output_json=None if s.output is None else _serde_text(s.output),
            error=s.error,
            started_at=s.started_at,
            finished_at=s.finished_at,
            wake_at=s.wake_at,
        )
        for s in history.steps
    ]


def _serde_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _short(error: ErrorInfo | None) -> ErrorInfo | None:
    return None if error is None else ErrorInfo(type=error.type, message=error.message)


def _error_json(error: ErrorInfo | None) -> dict[str, str] | None:
    return None if error is None else {"type": error.type, "message": error.message}


def _time_text(when: datetime | None) -> str | None:
    return None if when is None else when.isoformat()


class _Reader:
    """Reads parsed JSON into a `RunHistory`, refusing anything else by field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, expected: str, value: object) -> NoReturn:
        raise PayloadError(
            f"{self.where}: {path}: expected {expected}, got {_json_shown(value)}", field=path
        )

    def obj(self, value: object, path: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            self.fail(path or "the line", "a JSON object", value)
        return value

    def get(self, raw: Mapping[str, Any], key: str, path: str) -> Any:
        if key not in raw:
            raise PayloadError(f"{self.where}: {path}{key}: missing", field=f"{path}{key}")
        return raw[key]

    def text(self, raw: Mapping[str, Any], key: str, path: str = "") -> str:
        value = self.get(raw, key, path)
        if not isinstance(value, str) or not value:
            self.fail(f"{path}{key}", "a non-empty string", value)
        return value

    def integer(self, raw: Mapping[str, Any], key: str, path: str = "") -> int:
        value = self.get(raw, key, path)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(f"{path}{key}", "an integer >= 1", value)
        return value

    def choice(
        self, raw: Mapping[str, Any], key: str, options: tuple[str, ...], path: str = ""
    ) -> Any:
        value = self.get(raw, key, path)
        if value not in options or not isinstance(value, str):
            self.fail(f"{path}{key}", "one of " + ", ".join(repr(o) for o in options), value)
        return value

    def time(self, raw: Mapping[str, Any], key: str, path: str = "") -> datetime | None:
        if raw.get(key) is None:
            return None
        return self.required_time(raw, key, path)

    def required_time(self, raw: Mapping[str, Any], key: str, path: str = "") -> datetime:
        value = raw.get(key)
        expected = "an ISO 8601 time with its UTC offset, such as 2025-01-31T12:00:00+00:00"
        if not isinstance(value, str):
            self.fail(f"{path}{key}", expected, value)
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            self.fail(f"{path}{key}", expected, value)
        if when.tzinfo is None:
            self.fail(f"{path}{key}", expected, value)
        return when

    def error(self, raw: Mapping[str, Any], key: str, path: str = "") -> ErrorInfo | None:
        value = raw.get(key)
        if value is None:
            return None
        error = self.obj(value, f"{path}{key}")
        inner = f"{path}{key}."
        message = self.get(error, "message", inner)
        if not isinstance(message, str):
            self.fail(f"{inner}message", "a string", message)
        return ErrorInfo(type=self.text(error, "type", inner), message=message)

    def history(self, value: object) -> RunHistory:
        raw = self.obj(value, "")
        fmt = raw.get("format")
        if fmt != FORMAT:
            self.fail("format", f"{FORMAT!r} (a history written by `umt runs export`)", fmt)
        version = raw.get("format_version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise PayloadError(
                f"{self.where}: format_version {_json_shown(version)} is not one this umt reads "
                f"(it reads {FORMAT_VERSION}); export the history with the same umt, or upgrade",
                field="format_version",
            )
        run_id_text = self.text(raw, "run_id")
        try:
            run_id = UUID(run_id_text)
        except ValueError:
            self.fail("run_id", "a run id (a UUID)", run_id_text)
        steps = self.get(raw, "steps", "")
        if not isinstance(steps, list):
            self.fail("steps", "a list of step records", steps)
        return RunHistory(
            run_id=run_id,
            task=self.text(raw, "task"),
            version=self.integer(raw, "version"),
            status=self.choice(raw, "status", _RUN_STATUSES),
            input=self.get(raw, "input", ""),
            created_at=self.required_time(raw, "created_at"),
            finished_at=self.time(raw, "finished_at"),
            output=raw.get("output"),
            error=self.error(raw, "error"),
            steps=tuple(self.step(item, f"steps[{i}].") for i, item in enumerate(steps)),
        )

    def step(self, value: object, path: str) -> HistoryStep:
        raw = self.obj(value, path.rstrip("."))
        return HistoryStep(
            name=self.text(raw, "name", path),
            kind=self.choice(raw, "kind", _STEP_KINDS, path),
            status=self.choice(raw, "status", _STEP_STATUSES, path),
            attempt=self.integer(raw, "attempt", path),
            output=raw.get("output"),
            error=self.error(raw, "error", path),
            started_at=self.time(raw, "started_at", path),
            finished_at=self.time(raw, "finished_at", path),
            wake_at=self.time(raw, "wake_at", path),
        )


def _json_shown(value: object) -> str:
    """`value` as JSON for a message, cut short."""
    if value is None:
        return "null (or nothing)"
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        return shown(value)
    return text if len(text) <= 80 else f"{text[:80]}..."
