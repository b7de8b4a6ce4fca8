"""`umt events publish|list`: publish an event, and the recent events with the runs each
started (docs/writing-tasks.md, "Event triggers")."""

from __future__ import annotations

import re
from typing import Any
from uuid import UUID

import click

from umt_sdk._event_list import MAX_LIMIT, EventInfo
from umt_sdk._events import check_event_name
from umt_sdk.cli._app import (
    CliConfig,
    InputError,
    _json,
    cli,
    load_registry,
    open_engine,
    pass_config,
    run,
)
from umt_sdk.cli._render import _dump, _shorten, _table, _when
from umt_sdk.exceptions import UsageError

__all__: list[str] = []

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _printable(text: str) -> str:
    """A stored value as the terminal shows it: control characters as `\\xNN` (a key could
    hold an escape sequence)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _name(ctx: click.Context, param: click.Parameter, value: Any) -> str | None:
    if value is None:
        return None
    shown = "NAME" if param.param_type_name == "argument" else "--name"
    try:
        return check_event_name(value, shown, where="umt events")
    except UsageError as exc:
        raise InputError(str(exc).removeprefix("umt events: ")) from None


def _event_id(ctx: click.Context, param: click.Parameter, value: Any) -> UUID | None:
    if value is None:
        return None
    try:
        return UUID(str(value).strip())
    except ValueError:
        raise InputError(f"--before must be an event id (a UUID), got {value!r}") from None


@cli.group()
def events() -> None:
    """Events: publish one (its subscribers start once), list the recent ones."""


@events.command("publish")
@click.argument("name", callback=_name)
@click.option(
    "--payload",
    callback=_json,
    default="null",
    metavar="JSON",
    help="The event's payload as JSON (@file reads a file, - reads stdin); each subscriber "
    "gets it as its input.",
)
@click.option(
    "--key",
    metavar="KEY",
    help="Publish once per (NAME, KEY): a repeat starts nothing. Without it every publish is a "
    "new event.",
)
@click.option(
    "--registry",
    "registry_ref",
    envvar="UMT_REGISTRY",
    metavar="MODULE:REGISTRY",
    help="Your tasks (env UMT_REGISTRY): the runs of the subscribers it knows are stored with "
    "the event, their inputs checked first. Without it the event is stored alone, and the "
    "workers serving its subscribers start them (within the event window).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_config
def events_publish(
    cfg: CliConfig,
    name: str,
    payload: Any,
    key: str | None,
    registry_ref: str | None,
    as_json: bool,
) -> None:
    """Publish the event NAME: every task subscribed to it (@task(on_event=NAME)) gets one run.

    Prints the event's id, then one line per run started. A repeat of (NAME, --key) starts
    nothing (and with another payload is refused, exit 1); a payload a known subscriber's input
    type refuses is refused naming the task (exit 2), and nothing is stored.
    """
    if key is not None and (not key or len(key) > 512):
        raise InputError("--key must be 1 to 512 characters")
    registry = load_registry(registry_ref) if registry_ref else None

    async def go() -> None:
        async with open_engine(cfg, registry) as engine:
            published = await engine.publish(name, payload, key=key)
        if as_json:
            click.echo(
                _dump(
                    {
                        "event_id": str(published.event_id),
                        "name": published.name,
                        "key": published.key,
                        "created": published.created,
                        "runs": [
                            {
                                "run_id": str(h.run_id),
                                "task": h.task_name,
                                "version": h.task_version,
                            }
                            for h in published.runs
                        ],
                    }
                )
            )
            return
        click.echo(str(published.event_id))
        if not published.created:
            click.echo(
                f"(event {name} with key {_printable(published.key)!r} was already published: "
                "nothing started)",
                err=True,
            )
        for handle in published.runs:
            click.echo(f"started {handle.task_name}@{handle.task_version} {handle.run_id}")
        if published.created and registry is None:
            click.echo(
                "(no --registry: stored alone; the workers serving its subscribers start them)",
                err=True,
            )

    run(go(), cfg)


def _event_json(event: EventInfo) -> dict[str, Any]:
    return {
        "event_id": str(event.event_id),
        "name": event.name,
        "key": event.key,
        "published_at": event.published_at.isoformat(),
        "payload": event.payload,
        "runs": [
            {
                "run_id": str(r.run_id),
                "task": r.task_name,
                "version": r.task_version,
                "status": r.status,
            }
            for r in event.runs
        ],
    }


def _event_rows(event: EventInfo) -> list[list[str]]:
    head = [
        str(event.event_id),
        event.name,
        _shorten(_printable(event.key), 40),
        _when(event.published_at),
    ]
    if not event.runs:
        return [[*head, "(no run)", "", ""]]
    rows = []
    for i, r in enumerate(event.runs):
        cells = head if i == 0 else ["", "", "", ""]
        rows.append([*cells, f"{r.task_name}@{r.task_version}", r.status, str(r.run_id)])
    return rows


@events.command("list")
@click.option("--name", callback=_name, metavar="NAME", help="Only the events of this name.")
@click.option(
    "--limit", type=click.IntRange(1, MAX_LIMIT), default=20, show_default=True, metavar="N"
)
@click.option(
    "--before", callback=_event_id, metavar="EVENT", help="The events older than this event id."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one array).")
@pass_config
def events_list(
    cfg: CliConfig, name: str | None, limit: int, before: UUID | None, as_json: bool
) -> None:
    """List the recent events, newest first, each with the runs it started (task, status)."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            found = await engine.events(name=name, before=before, limit=limit)
        if as_json:
            click.echo(_dump([_event_json(e) for e in found]))
            return
        if not found:
            click.echo("no events")
            return
        headers = ["EVENT", "NAME", "KEY", "PUBLISHED", "RUN OF", "STATUS", "RUN"]
        click.echo(_table(headers, [row for e in found for row in _event_rows(e)]))
        if len(found) == limit:
            more = f" --name {name}" if name else ""
            click.echo(
                f"(more: umt events list{more} --limit {limit} --before {found[-1].event_id})",
                err=True,
            )

    run(go(), cfg)
