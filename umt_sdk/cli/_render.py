"""How the command line shows runs: text tables for people, JSON for programs."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

from attrs import frozen

from umt_sdk._attention import parse_attention_fact, settlement_of
from umt_sdk._spi import ErrorInfo, ExecutionRecord
from umt_sdk._streams import StreamItem
from umt_sdk._views import RunInfo, StepView


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _when(value: datetime | None, *, precise: bool = False) -> str:
    if value is None:
        return "-"
    local = value.astimezone()
    if precise:
        return local.strftime("%H:%M:%S.%f")[:-3]
    return local.strftime("%Y-%m-%d %H:%M:%S")


def _took(start: datetime | None, end: datetime | None) -> str:
    if start is None or end is None:
        return "-"
    seconds = (end - start).total_seconds()
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in [headers, *rows]
    ]
    return "\n".join(lines)


def _error_text(error: ErrorInfo | None) -> str:
    if error is None:
        return ""
    return f"{error.type}: {error.message}" if error.message else error.type


def _note(info: RunInfo) -> str:
    if info.needs_attention is not None:
        return f"step {info.needs_attention!r} needs settling (umt runs settle)"
    if info.status == "waiting":
        return f"waiting for fact {info.waiting_for!r}" if info.waiting_for else "sleeping"
    if info.deadline_passed:
        return "past its deadline: a worker of its task ends it failed when it claims it"
    if info.cancel_requested and info.status not in ("canceled",):
        return f"cancel requested: {info.cancel_reason or ''}".rstrip(": ")
    if info.status == "canceled":
        return f"canceled: {info.cancel_reason}" if info.cancel_reason else "canceled"
    if info.error is not None:
        return _error_text(info.error)
    return ""


def _list_text(runs: Sequence[RunInfo], progress: Mapping[UUID, StreamItem] | None = None) -> str:
    """The runs as a table; with `progress` (`runs watch`), the newest value of each run's
    `progress` stream in a PROGRESS column."""
    headers = ["RUN", "TASK", "STATUS", "ATTEMPTS", "FAILURES", "CREATED"]
    headers += ["PROGRESS", "NOTE"] if progress is not None else ["NOTE"]
    rows = []
    for r in runs:
        row = [
            str(r.run_id),
            f"{r.task_name}@{r.task_version}",
            r.display_status,
            str(r.attempts),
            str(r.failures),
            _when(r.created_at),
        ]
        if progress is not None:
            item = progress.get(r.run_id)
            row.append("-" if item is None else progress_text(item.value))
        rows.append([*row, _shorten(_note(r), 60)])
    return _table(headers, rows)


def progress_text(value: Any) -> str:
    """A stream value in a table cell: `{"done": 40, "total": 100}` as `40/100 40%`, a
    number or text as it is, anything else as compact JSON; at most 30 characters."""
    if isinstance(value, dict):
        done, total = value.get("done"), value.get("total")
        if isinstance(done, (int, float)) and isinstance(total, (int, float)):
            percent = f" {100 * done / total:.0f}%" if total > 0 else ""
            return _shorten(f"{done:g}/{total:g}{percent}", 30)
    if isinstance(value, str):
        return _shorten(value, 30)
    if _number(value):
        return f"{value:g}"
    return _shorten(json.dumps(value, ensure_ascii=False, separators=(",", ":")), 30)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _streams_lines(streams: Mapping[str, StreamItem]) -> list[str]:
    rows = [
        [name, str(item.seq), _when(item.written_at), progress_text(item.value)]
        for name, item in sorted(streams.items())
    ]
    return [_table(["STREAM", "VALUES", "LAST WRITTEN", "LAST VALUE"], rows, indent="  ")]


_MARK = "!"


def _step_status(view: StepView) -> str:
    return f"{view.status} {_MARK}" if view.status == "interrupted" else view.status


def _settled_note(view: StepView) -> str | None:
    """`settled done by dana` for the record of a settlement (`umt runs settle`)."""
    if view.kind != "fact" or parse_attention_fact(view.name) is None or not view.output_json:
        return None
    settlement = settlement_of(view.output_json)
    if settlement is None:
        return None
    return f"settled {'done' if settlement.done else 'not done'} by {settlement.by}"


def _step_note(view: StepView) -> str:
    settled = _settled_note(view)
    if settled is not None:
        return settled
    if view.status == "interrupted":
        where = "at or before this step" if view.inferred else "cut off"
        return f"{where}: lease lost (noticed {_when(view.finished_at, precise=True)})"
    if view.status == "canceled" and view.kind == "step":
        return "the cancel stopped it"
    if view.status in ("canceled", "abandoned"):
        return "the run ended while it waited"
    if view.error is not None:
        return _shorten(_error_text(view.error), 50)
    if view.status == "waiting" and view.wake_at is not None:
        return f"until {_when(view.wake_at)}"
    return ""


@frozen(kw_only=True)
class ChildTree:
    """A run's children as `runs show` draws them: each child with its own, a few levels
    deep (`more`: children left out past the limit)."""

    info: RunInfo
    children: tuple[ChildTree, ...] = ()
    more: int = 0


def _tree_lines(trees: Sequence[ChildTree], more: int, indent: str = "  ") -> list[str]:
    lines: list[str] = []
    entries: list[ChildTree | int] = [*trees, *([more] if more else [])]
    for index, entry in enumerate(entries):
        last = index == len(entries) - 1
        branch, below = ("└─ ", "   ") if last else ("├─ ", "│  ")
        if isinstance(entry, int):
            lines.append(f"{indent}{branch}... {entry} more")
            continue
        child = entry.info
        lines.append(
            f"{indent}{branch}{child.run_id}  {child.task_name}@{child.task_version}  "
            f"{child.display_status}"
        )
        lines += _tree_lines(entry.children, entry.more, indent + below)
    return lines


def _show_text(
    info: RunInfo,
    children: Sequence[ChildTree] = (),
    more: int = 0,
    streams: Mapping[str, StreamItem] | None = None,
) -> str:
    interrupted = info.interrupted_attempts
    attempts = f"{info.attempts}" + (f" ({interrupted} interrupted)" if interrupted else "")
    fields: list[tuple[str, str]] = [
        ("run", str(info.run_id)),
        ("task", f"{info.task_name}@{info.task_version}"),
        ("status", info.display_status),
        ("priority", str(info.priority)),
        ("attempts", attempts),
        ("failures", str(info.failures)),
        ("lease expirations", str(info.lease_expirations)),
        ("created", _when(info.created_at)),
        ("updated", _when(info.updated_at)),
        ("input", _shorten(info.input_json, 200)),
    ]
    if info.finished_at is not None:
        fields.append(("finished", _when(info.finished_at)))
    if info.parent_run_id is not None:
        fields.append(("parent", f"{info.parent_run_id}  (umt runs show {info.parent_run_id})"))
    if info.rerun_of is not None:
        fields.append(("rerun of", f"{info.rerun_of}  (umt runs show {info.rerun_of})"))
    if info.forked_from is not None:
        fields.append(
            (
                "forked from",
                f"{info.forked_from} at step {info.forked_at_step!r}  "
                f"(umt runs show {info.forked_from})",
            )
        )
    if info.idempotency_key is not None:
        fields.append(("idempotency key", info.idempotency_key))
    if info.tags:
        fields.append(("tags", ", ".join(f"{k}={v}" for k, v in sorted(info.tags.items()))))
    if info.concurrency_key is not None:
        fields.append(("concurrency key", info.concurrency_key))
    if info.debounce_key is not None:
        fields.append(("debounce key", info.debounce_key))
    if info.rate_limit is not None:
        bucket = f" (bucket {info.rate_limit_key!r})" if info.rate_limit_key else ""
        fields.append(
            ("rate limit", f"{info.rate_limit}{bucket}  (umt limits show {info.rate_limit})")
        )
    if info.status == "waiting" and info.waiting_for:
        fields.append(("waiting for", f"fact {info.waiting_for!r}"))
    if info.status in ("pending", "waiting") and info.available_at is not None:
        fields.append(("next attempt", _when(info.available_at)))
    if info.deadline_at is not None:
        passed = "  (passed: a worker of its task ends it failed)" if info.deadline_passed else ""
        fields.append(("deadline", _when(info.deadline_at) + passed))
    if info.start_by is not None:
        fields.append(("start by", _when(info.start_by)))
    if info.lease_expired:
        fields.append(
            ("lease", f"expired {_when(info.lease_expires_at)}; waiting for a worker to claim it")
        )
    if info.cancel_requested:
        fields.append(("cancel", f"requested: {info.cancel_reason or '(no reason)'}"))
    if info.error is not None:
        fields.append(("error", _error_text(info.error)))
    if info.output_json is not None:
        fields.append(("output", _shorten(info.output_json, 200)))
    width = max(len(k) for k, _ in fields)
    lines = [f"{k.ljust(width)}  {v}" for k, v in fields]

    lines += ["", "steps:"]
    if info.timeline:
        rows = [
            [
                v.name,
                v.kind,
                _step_status(v),
                str(v.attempt),
                str(v.fencing_token),
                _when(v.started_at, precise=True),
                "-" if v.status == "interrupted" else _took(v.started_at, v.finished_at),
                _step_note(v),
            ]
            for v in info.timeline
        ]
        lines.append(
            _table(
                ["STEP", "KIND", "STATUS", "TRY", "TOKEN", "STARTED", "TOOK", "NOTE"],
                rows,
                indent="  ",
            )
        )
    else:
        lines.append("  (none yet)")

    if children or more:
        lines += ["", "children:", *_tree_lines(children, more)]

    if streams:
        lines += ["", "streams:", *_streams_lines(streams)]

    lines += ["", "attempts:"]
    if info.executions:
        lines.append(
            _table(
                ["TOKEN", "OUTCOME", "WORKER", "CLAIMED", "ENDED", "IN STEP"],
                [_execution_row(e) for e in info.executions],
                indent="  ",
            )
        )
    else:
        lines.append("  (not claimed yet)")
    if any(v.status == "interrupted" for v in info.timeline) or interrupted:
        lines += [
            "",
            f"{_MARK} interrupted: the attempt lost its lease (the worker crashed, froze or was "
            "cut off) in the middle of this step; a later attempt ran it again.",
        ]
    return "\n".join(lines)


def _execution_row(e: ExecutionRecord) -> list[str]:
    outcome = f"{e.outcome} {_MARK}" if e.outcome == "interrupted" else e.outcome
    return [
        str(e.fencing_token),
        outcome,
        e.worker_id,
        _when(e.claimed_at),
        _when(e.ended_at),
        e.current_step or "-",
    ]


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _error_json(error: ErrorInfo | None) -> dict[str, str] | None:
    if error is None:
        return None
    return {"type": error.type, "message": error.message, "traceback": error.traceback}


def _run_json(info: RunInfo, *, detail: bool) -> dict[str, Any]:
    data: dict[str, Any] = {
        "run_id": str(info.run_id),
        "task": info.task_name,
        "version": info.task_version,
        "status": info.status,
        "lease_expired": info.lease_expired,
        "priority": info.priority,
        "attempts": info.attempts,
        "failures": info.failures,
        "lease_expirations": info.lease_expirations,
        "created_at": _iso(info.created_at),
        "updated_at": _iso(info.updated_at),
        "finished_at": _iso(info.finished_at),
        "available_at": _iso(info.available_at),
        "lease_expires_at": _iso(info.lease_expires_at),
        "idempotency_key": info.idempotency_key,
        "waiting_for": info.waiting_for,
        "needs_attention": info.needs_attention,
        "cancel_requested": info.cancel_requested,
        "cancel_reason": info.cancel_reason,
        "error": _error_json(info.error),
        "output": info.output,
        "parent_run_id": None if info.parent_run_id is None else str(info.parent_run_id),
        "tags": dict(info.tags),
        "concurrency_key": info.concurrency_key,
        "debounce_key": info.debounce_key,
        "rate_limit": info.rate_limit,
        "rate_limit_key": info.rate_limit_key,
        "deadline_at": _iso(info.deadline_at),
        "start_by": _iso(info.start_by),
        "deadline_passed": info.deadline_passed,
        "rerun_of": None if info.rerun_of is None else str(info.rerun_of),
        "forked_from": None if info.forked_from is None else str(info.forked_from),
        "forked_at_step": info.forked_at_step,
    }
    if detail:
        data["input"] = info.input
        data["interrupted_attempts"] = info.interrupted_attempts
        data["timeline"] = [
            {
                "name": v.name,
                "kind": v.kind,
                "status": v.status,
                "attempt": v.attempt,
                "fencing_token": v.fencing_token,
                "started_at": _iso(v.started_at),
                "finished_at": _iso(v.finished_at),
                "wake_at": _iso(v.wake_at),
                "error": _error_json(v.error),
                "inferred": v.inferred,
                **({"settled": _settled_note(v)} if _settled_note(v) is not None else {}),
            }
            for v in info.timeline
        ]
        data["executions"] = [
            {
                "fencing_token": e.fencing_token,
                "worker_id": e.worker_id,
                "claimed_at": _iso(e.claimed_at),
                "ended_at": _iso(e.ended_at),
                "outcome": e.outcome,
                "current_step": e.current_step,
                "step_started_at": _iso(e.step_started_at),
            }
            for e in info.executions
        ]
    return data


def _streams_json(streams: Mapping[str, StreamItem]) -> dict[str, Any]:
    return {
        name: {"values": item.seq, "last": item.value, "written_at": _iso(item.written_at)}
        for name, item in sorted(streams.items())
    }


def _dump(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False)


def _tree_json(trees: Sequence[ChildTree]) -> list[dict[str, Any]]:
    return [
        {**_run_json(tree.info, detail=False), "children": _tree_json(tree.children)}
        for tree in trees
    ]
