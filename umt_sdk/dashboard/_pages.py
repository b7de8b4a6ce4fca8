"""What the dashboard's pages show, shaped from the engine's public reads: no web framework here.

Each page is one function of the engine (and what the request asked for) that returns plain
records the templates render. Payloads shown pass through the same redaction as `ctx.logger`
(`umt_sdk._logging.redact`): a value under a secret-looking key (`password`, `token`,
`api_key`, ...) reads `[REDACTED]`, and so does a secret inside a string (`Authorization:
Bearer ...`, a URL's password).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, get_args
from urllib.parse import urlencode
from uuid import UUID

from attrs import field, frozen

from umt_sdk._definition import TaskDefinition
from umt_sdk._engine import Engine
from umt_sdk._logging import redact, redact_text
from umt_sdk._spi import TERMINAL_STATUSES, ErrorInfo, ExecutionRecord, RunStatus, TaskPair
from umt_sdk._views import RunInfo, RunPage, StepView
from umt_sdk.exceptions import RunNotFoundError, UmtError, UsageError

__all__ = [
    "PAGE_SIZE",
    "STATUSES",
    "RunFilters",
    "RunKey",
    "Timeline",
    "build_timeline",
    "cell",
    "error_text",
    "fetch_events",
    "fetch_runs",
    "pretty_json",
    "run_keys",
]

STATUSES: tuple[str, ...] = (*get_args(RunStatus), "needs_attention")
"""The run list's status filter: the stored statuses, and `needs_attention` (waiting runs whose
step an operator must settle: `engine.list(needs_attention=True)`)."""
UNFINISHED: tuple[RunStatus, ...] = ("pending", "running", "waiting")
PAGE_SIZE = 50
CELL_LIMIT = 120
"""Characters of a value shown in a table cell (the run's page shows it whole)."""
SHOWN_LIMIT = 200_000
"""Characters of one payload shown on a run's page; the rest is cut, and the page says so."""


def _aware(text: str, name: str) -> datetime:
    """A time typed in a form (`2026-01-31T12:00`, as `datetime-local` sends it, or ISO with
    an offset): without an offset it is UTC, as every time the dashboard shows."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(
            f"{name}: expected a time such as 2026-01-31T12:00 (UTC), got {text[:60]!r}",
            argument=name,
        ) from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


@frozen(kw_only=True)
class RunFilters:
    """The runs list's filters, as given in the query string (all optional)."""

    status: str = ""
    task: str = ""
    """`name` or `name@version`."""
    run_id: str = ""
    idempotency_key: str = ""
    key: str = ""
    """The runs of a concurrency key (a task's `concurrency=`, a singleton, a sequence)."""
    worker: str = ""
    created_after: str = ""
    created_before: str = ""
    finished_after: str = ""
    finished_before: str = ""
    parent: str = ""
    """Only the children of this run."""
    before: str = ""
    """The page cursor (the last run id of the previous page)."""
    errors: Mapping[str, str] = field(factory=dict)
    """What is wrong with a filter, by its name (shown beside the field)."""

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> RunFilters:
        """The filters of a query string, each checked (errors kept by name, not raised)."""

        def text(name: str, limit: int = 512) -> str:
            return str(params.get(name, "")).strip()[:limit]

        return cls(
            status=text("status", 20),
            task=text("task", 220),
            run_id=text("run_id", 64),
            idempotency_key=text("idempotency_key"),
            key=text("key", 255),
            worker=text("worker", 255),
            created_after=text("created_after", 40),
            created_before=text("created_before", 40),
            finished_after=text("finished_after", 40),
            finished_before=text("finished_before", 40),
            parent=text("parent", 64),
            before=text("before", 64),
        )

    def query(self, **changes: str) -> str:
        """The query string of these filters, with `changes` (empty values left out)."""
        values = {
            "status": self.status,
            "task": self.task,
            "run_id": self.run_id,
            "idempotency_key": self.idempotency_key,
            "key": self.key,
            "worker": self.worker,
            "created_after": self.created_after,
            "created_before": self.created_before,
            "finished_after": self.finished_after,
            "finished_before": self.finished_before,
            "parent": self.parent,
            "before": self.before,
            **changes,
        }
        return urlencode({k: v for k, v in values.items() if v})

    @property
    def active(self) -> bool:
        """Whether any filter (not the cursor) is set."""
        return bool(self.query(before=""))

    def engine_arguments(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The keyword arguments of `engine.list` these filters mean, and the errors by field."""
        arguments: dict[str, Any] = {}
        errors: dict[str, str] = {}
        if self.status:
            if self.status == "needs_attention":
                arguments["needs_attention"] = True
            elif self.status in STATUSES:
                arguments["status"] = self.status
            else:
                errors["status"] = f"one of {', '.join(STATUSES)}"
        if self.task:
            name, at, version = self.task.partition("@")
            arguments["task_name"] = name
            if at:
                if version.isdigit() and int(version) >= 1:
                    arguments["version"] = int(version)
                else:
                    errors["task"] = "a task name, or name@version with a version >= 1"
        if self.idempotency_key:
            if not self.task:
                errors["idempotency_key"] = "keys are per task: give the task too"
            else:
                arguments["idempotency_key"] = self.idempotency_key
        if self.key:
            if not self.task:
                errors["key"] = "keys are per task: give the task too"
            else:
                arguments["concurrency_key"] = self.key
        if self.worker:
            arguments["worker_id"] = self.worker
        if self.parent:
            try:
                arguments["parent"] = UUID(self.parent)
            except ValueError:
                errors["parent"] = "not a run id (a UUID)"
        for name in ("created_after", "created_before", "finished_after", "finished_before"):
            value = getattr(self, name)
            if value:
                try:
                    arguments[name] = _aware(value, name)
                except UsageError as exc:
                    errors[name] = str(exc).split(": ", 1)[-1]
        if self.before:
            try:
                arguments["before"] = UUID(self.before)
            except ValueError:
                errors["before"] = "not a run id"
        return arguments, errors


@frozen(kw_only=True)
class RunsView:
    """One page of the runs list."""

    runs: Sequence[RunInfo]
    next_cursor: UUID | None
    filters: RunFilters
    error: str = ""


async def list_runs(engine: Engine, limit: int = PAGE_SIZE, **arguments: Any) -> RunPage:
    """`engine.list` with the arguments of `RunFilters.engine_arguments`."""
    return await engine.list(limit=limit, **arguments)


async def fetch_runs(engine: Engine, filters: RunFilters) -> RunsView:
    """The page of runs the filters select: newest first, `PAGE_SIZE` a page, keyset paged."""
    arguments, errors = filters.engine_arguments()
    if filters.run_id:
        try:
            run_id = UUID(filters.run_id)
        except ValueError:
            errors = {**errors, "run_id": "not a run id (a UUID)"}
        else:
            try:
                info = await engine.get(run_id)
            except RunNotFoundError:
                return RunsView(runs=(), next_cursor=None, filters=filters)
            return RunsView(runs=(info,), next_cursor=None, filters=filters)
    if errors:
        return RunsView(
            runs=(),
            next_cursor=None,
            filters=RunFilters(**{**_fields(filters), "errors": errors}),
            error="fix the filters marked below",
        )
    try:
        page = await list_runs(engine, **arguments)
    except UmtError as exc:
        return RunsView(runs=(), next_cursor=None, filters=filters, error=str(exc))
    return RunsView(runs=page.runs, next_cursor=page.next_cursor, filters=filters)


def _fields(filters: RunFilters) -> dict[str, Any]:
    return {
        name: getattr(filters, name)
        for name in (
            "status",
            "task",
            "run_id",
            "idempotency_key",
            "worker",
            "created_after",
            "created_before",
            "finished_after",
            "finished_before",
            "parent",
            "before",
        )
    }


# -- showing values ------------------------------------------------------------------------------


def pretty_json(text: str | None) -> str:
    """Stored JSON text, redacted and indented for a run's page (cut past `SHOWN_LIMIT`)."""
    if text is None:
        return ""
    try:
        value = json.loads(text)
    except ValueError:  # not JSON (a masked payload, say): shown as text
        shown = redact_text(text)
    else:
        shown = json.dumps(redact(value), indent=2, ensure_ascii=False, sort_keys=False)
    if len(shown) > SHOWN_LIMIT:
        return f"{shown[:SHOWN_LIMIT]}\n... ({len(shown) - SHOWN_LIMIT:,} more characters)"
    return shown


def cell(text: str | None, limit: int = CELL_LIMIT) -> str:
    """A stored JSON value (or text) on one line, redacted, cut to `limit` characters."""
    if text is None:
        return ""
    try:
        shown = json.dumps(redact(json.loads(text)), ensure_ascii=False)
    except ValueError:
        shown = redact_text(text)
    shown = " ".join(shown.split())
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def error_text(error: ErrorInfo | None, *, full: bool = False) -> str:
    """`Type: message` of a recorded error, redacted (the traceback too with `full`)."""
    if error is None:
        return ""
    text = f"{error.type}: {error.message}"
    if full and error.traceback:
        text = f"{error.traceback.rstrip()}"
    return redact_text(text)


# -- the step timeline ---------------------------------------------------------------------------

CHART_WIDTH = 1000
LABEL_WIDTH = 330
ROW_HEIGHT = 22
AXIS_HEIGHT = 26


@frozen(kw_only=True)
class Bar:
    """One row of the timeline: a bar from `x` over `width` on the time axis."""

    label: str
    detail: str
    css: str
    """The bar's class: its kind and status (`execution interrupted`, `step completed`...)."""
    x: float
    width: float
    y: float
    start: datetime | None
    end: datetime | None
    open_ended: bool = False
    """Still going (no end yet): drawn to now."""


@frozen(kw_only=True)
class Tick:
    x: float
    label: str


@frozen(kw_only=True)
class Timeline:
    """The run's executions and steps as bars on one time axis."""

    bars: Sequence[Bar]
    ticks: Sequence[Tick]
    width: int
    height: int
    label_width: int
    start: datetime
    end: datetime


def _step_end(view: StepView, now: datetime) -> tuple[datetime, bool]:
    if view.finished_at is not None:
        return view.finished_at, False
    if view.status == "waiting" and view.wake_at is not None:
        return view.wake_at, True
    return now, True


def _execution_label(execution: ExecutionRecord) -> str:
    return f"execution #{execution.fencing_token}"


def build_timeline(info: RunInfo, now: datetime) -> Timeline:
    """Bars for each execution (claim to end, with its worker and fencing token; an
    interrupted one says so) and each step try, sleep and fact wait, on an axis from the
    run's creation to its end (or now)."""
    spans: list[tuple[str, str, str, datetime | None, datetime | None, bool]] = []
    for execution in info.executions:
        end = execution.ended_at
        open_ended = end is None and execution.outcome == "running"
        outcome = execution.outcome
        detail = f"worker {execution.worker_id} · token {execution.fencing_token} · {outcome}"
        if outcome == "interrupted":
            detail += " (lease lost: the worker crashed or froze; another execution took over)"
        spans.append(
            (
                _execution_label(execution),
                detail,
                f"execution {outcome}",
                execution.claimed_at,
                end,
                open_ended,
            )
        )
    for view in info.timeline:
        kind = {"step": "step", "sleep": "sleep", "fact": "fact wait"}[view.kind]
        label = f"{kind} {view.name}"
        if view.kind == "step":
            label += f" · try {view.attempt}"
        end_at, open_ended = (
            _step_end(view, now) if view.started_at is not None else (view.finished_at, False)
        )
        detail = f"{view.status} · token {view.fencing_token}"
        if view.inferred:
            detail += " · cut off as it began (no heartbeat named it)"
        if view.error is not None:
            detail += f" · {error_text(view.error)}"
        if view.kind == "sleep" and view.wake_at is not None:
            detail += f" · wakes {view.wake_at.isoformat(timespec='seconds')}"
        spans.append(
            (
                label,
                detail,
                f"{view.kind} {view.status}",
                view.started_at,
                end_at if view.started_at is not None else view.finished_at,
                open_ended,
            )
        )
    start = info.created_at
    known = [t for _, _, _, a, b, _ in spans for t in (a, b) if t is not None]
    end = max([*known, info.finished_at or now, start])
    if info.finished_at is not None:
        end = max([*known, info.finished_at])
    total = max((end - start).total_seconds(), 0.001)
    plot = CHART_WIDTH - LABEL_WIDTH - 10

    def x_of(moment: datetime) -> float:
        seconds = (moment - start).total_seconds()
        return LABEL_WIDTH + max(0.0, min(1.0, seconds / total)) * plot

    bars: list[Bar] = []
    for index, (label, detail, css, begin, finish, open_ended) in enumerate(spans):
        y = AXIS_HEIGHT + index * ROW_HEIGHT
        if begin is None:  # an interrupted step whose start no heartbeat told: a marker
            at = x_of(finish or start)
            bars.append(
                Bar(
                    label=label,
                    detail=detail,
                    css=css + " unknown-start",
                    x=at - 3,
                    width=6,
                    y=y,
                    start=None,
                    end=finish,
                )
            )
            continue
        left = x_of(begin)
        right = x_of(finish if finish is not None else end)
        bars.append(
            Bar(
                label=label,
                detail=detail,
                css=css,
                x=left,
                width=max(right - left, 2.0),
                y=y,
                start=begin,
                end=finish,
                open_ended=open_ended,
            )
        )
    ticks = [
        Tick(x=LABEL_WIDTH + plot * i / 4, label=_offset(timedelta(seconds=total * i / 4)))
        for i in range(5)
    ]
    return Timeline(
        bars=tuple(bars),
        ticks=tuple(ticks),
        width=CHART_WIDTH,
        height=AXIS_HEIGHT + max(len(bars), 1) * ROW_HEIGHT + 6,
        label_width=LABEL_WIDTH,
        start=start,
        end=end,
    )


def _offset(delta: timedelta) -> str:
    """`+1.5s`, `+2m03s`, `+1h20m` from the run's creation."""
    seconds = delta.total_seconds()
    if seconds < 60:
        return f"+{seconds:.3g}s" if seconds else "0"
    if seconds < 3600:
        return f"+{int(seconds // 60)}m{int(seconds % 60):02d}s"
    if seconds < 86400 * 2:
        return f"+{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    return f"+{seconds / 86400:.1f}d"


def age(moment: datetime | None, now: datetime) -> str:
    """How long ago: `12s`, `3m`, `5h`, `2d` (empty for None)."""
    if moment is None:
        return ""
    seconds = max((now - moment).total_seconds(), 0.0)
    if seconds < 60:
        return f"{math.floor(seconds)}s"
    if seconds < 3600:
        return f"{math.floor(seconds / 60)}m"
    if seconds < 86400:
        return f"{math.floor(seconds / 3600)}h"
    return f"{math.floor(seconds / 86400)}d"


def when(moment: datetime | None) -> str:
    """A time as the dashboard shows it: UTC, to the millisecond."""
    if moment is None:
        return ""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def finished(status: str) -> bool:
    return status in TERMINAL_STATUSES


def pair_text(pair: TaskPair) -> str:
    return f"{pair.name}@{pair.version}"


# -- bulk cancel ---------------------------------------------------------------------------------

BULK_LIMIT = 10_000
"""At most this many runs are canceled by one "cancel all matching" (the page says when more
match: cancel again)."""


@frozen(kw_only=True)
class Matching:
    """The unfinished runs a filter selects (for a bulk cancel)."""

    run_ids: Sequence[UUID]
    capped: bool
    """More may match than `run_ids` holds (the limit was reached)."""
    error: str = ""


async def matching_unfinished(
    engine: Engine, filters: RunFilters, *, limit: int = BULK_LIMIT
) -> Matching:
    """The pending, running and waiting runs the filters select, at most `limit` (newest first
    within each status)."""
    arguments, errors = filters.engine_arguments()
    arguments.pop("before", None)
    if errors:
        return Matching(
            run_ids=(), capped=False, error="; ".join(f"{k}: {v}" for k, v in errors.items())
        )
    limit = max(0, min(limit, BULK_LIMIT))
    if filters.run_id:
        try:
            info = await engine.get(UUID(filters.run_id))
        except (ValueError, RunNotFoundError):
            return Matching(run_ids=(), capped=False, error="no run has that id")
        unfinished = info.status in UNFINISHED and limit >= 1
        return Matching(run_ids=(info.run_id,) if unfinished else (), capped=False)
    wanted = arguments.pop("status", None)
    statuses = [s for s in UNFINISHED if wanted is None or s == wanted]
    found: list[UUID] = []
    for status in statuses:
        cursor: UUID | None = None
        while len(found) < limit:
            page = await list_runs(
                engine,
                limit=min(1000, limit - len(found)),
                status=status,
                before=cursor,
                **arguments,
            )
            found += [r.run_id for r in page.runs]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    return Matching(run_ids=tuple(found), capped=len(found) >= limit and limit > 0)


async def cancel_all(engine: Engine, run_ids: Sequence[UUID], *, reason: str) -> dict[str, int]:
    """Cancel each run; how many ended canceled, were asked to stop, or had finished."""
    outcomes: dict[str, int] = {}
    for run_id in run_ids:
        outcome = await engine.cancel(run_id, reason=reason)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


# -- small charts --------------------------------------------------------------------------------


@frozen(kw_only=True)
class SparkBar:
    x: float
    width: float
    total_y: float
    total_height: float
    failed_y: float
    failed_height: float
    title: str


@frozen(kw_only=True)
class Spark:
    """Bars of the runs finished per bucket of the last hour (the failed part in red)."""

    bars: Sequence[SparkBar]
    width: int
    height: int
    peak: int


def spark(finished: Sequence[int], failed: Sequence[int], starts: Sequence[datetime] = ()) -> Spark:
    """A small bar chart of `finished` per bucket with `failed` drawn over it."""
    width, height, gap = 132, 28, 1
    peak = max([*finished, 1])
    step = width / max(len(finished), 1)
    bars = []
    for i, (total, bad) in enumerate(zip(finished, failed, strict=True)):
        total_height = height * total / peak
        failed_height = height * bad / peak
        label = f"{total} finished, {bad} failed"
        if i < len(starts):
            label = f"{starts[i].astimezone(UTC).strftime('%H:%M')}Z: {label}"
        bars.append(
            SparkBar(
                x=i * step,
                width=max(step - gap, 1.0),
                total_y=height - total_height,
                total_height=total_height,
                failed_y=height - failed_height,
                failed_height=failed_height,
                title=label,
            )
        )
    return Spark(bars=tuple(bars), width=width, height=height, peak=peak)


def duration(delta: timedelta | None) -> str:
    """`42s`, `3m 05s`, `2h 10m`, `3d 4h` (empty for None)."""
    if delta is None:
        return ""
    seconds = int(delta.total_seconds())
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d {seconds % 86400 // 3600}h"


@frozen(kw_only=True)
class RunKey:
    """One key of a run, as its page shows it: its label, the key, what it does, and the
    query string of the runs list that shows the key's runs (empty: none)."""

    kind: str
    key: str
    meaning: str
    runs_query: str = ""


def run_keys(info: RunInfo, definition: TaskDefinition[Any, Any] | None) -> list[RunKey]:
    """The keys a run was enqueued with: its idempotency key, its concurrency key (a fairness
    key when it has a weight, the task's `concurrency=` when the registered task has one, else
    a singleton's or a sequence's: the store keeps the key, not which of the two made it), its
    debounce key and its rate limit's bucket."""
    keys: list[RunKey] = []
    task = info.task_name
    if info.idempotency_key is not None:
        keys.append(
            RunKey(
                kind="Idempotency key",
                key=info.idempotency_key,
                meaning="the same key and input give back this run",
                runs_query=urlencode({"task": task, "idempotency_key": info.idempotency_key}),
            )
        )
    if info.concurrency_key is not None:
        query = urlencode({"task": task, "key": info.concurrency_key})
        concurrency = definition.concurrency if definition is not None else None
        if info.fairness_weight is not None:
            keys.append(
                RunKey(
                    kind="Fairness key",
                    key=info.concurrency_key,
                    meaning="takes turns with the task's other keys in the claim "
                    f"(weight {info.fairness_weight})",
                    runs_query=query,
                )
            )
        elif concurrency is not None:
            keys.append(
                RunKey(
                    kind="Concurrency key",
                    key=info.concurrency_key,
                    meaning=f"at most {concurrency.limit} run(s) of the key at once "
                    f"(the task's concurrency=, strategy {concurrency.strategy})",
                    runs_query=query,
                )
            )
        else:
            keys.append(
                RunKey(
                    kind="Singleton or sequence key",
                    key=info.concurrency_key,
                    meaning="one run of the key at a time (enqueue's singleton= or sequence=)",
                    runs_query=query,
                )
            )
    if info.debounce_key is not None:
        keys.append(
            RunKey(
                kind="Debounce key",
                key=info.debounce_key,
                meaning="triggers of the key before the run started joined it (the last input won)",
            )
        )
    if info.rate_limit is not None:
        bucket = info.rate_limit_key or ""
        keys.append(
            RunKey(
                kind="Rate limit",
                key=f"{info.rate_limit}" + (f" / {bucket}" if bucket else ""),
                meaning="each start takes a token of this bucket",
            )
        )
    return keys


EVENTS_PAGE_SIZE = 50


@frozen(kw_only=True)
class EventRow:
    """An event as the events page shows it (its payload as JSON text, for `cell`)."""

    event_id: UUID
    name: str
    key: str
    published_at: datetime
    payload_json: str
    runs: Sequence[Any]


async def fetch_events(engine: Engine, params: Mapping[str, str]) -> dict[str, Any]:
    """The events page's context: the newest events (of `name`), a page after `before`."""
    name = str(params.get("name", "")).strip()[:220]
    before_text = str(params.get("before", "")).strip()[:64]
    context: dict[str, Any] = {
        "name": name,
        "events": [],
        "error": "",
        "error_field": "",
        "next_cursor": None,
        "next_query": "",
    }
    before: UUID | None = None
    if before_text:
        try:
            before = UUID(before_text)
        except ValueError:
            context.update(error="before: not an event id (a UUID)", error_field="before")
            return context
    try:
        found = await engine.events(name=name or None, before=before, limit=EVENTS_PAGE_SIZE)
    except UsageError as exc:
        context.update(error=str(exc), error_field=exc.argument)
        return context
    context["events"] = [
        EventRow(
            event_id=e.event_id,
            name=e.name,
            key=e.key,
            published_at=e.published_at,
            payload_json=json.dumps(e.payload),
            runs=e.runs,
        )
        for e in found
    ]
    if len(found) == EVENTS_PAGE_SIZE:
        context["next_cursor"] = found[-1].event_id
        context["next_query"] = urlencode(
            {k: v for k, v in {"name": name, "before": str(found[-1].event_id)}.items() if v}
        )
    return context
