"""`umt schedules ...`: list, show, create, pause, resume, delete, trigger and backfill."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, get_args

import click

from umt_sdk._schedules import ScheduleInfo
from umt_sdk._spi import OverlapPolicy
from umt_sdk._task import Registry, Schedule
from umt_sdk.cli._app import (
    CliConfig,
    InputError,
    _duration,
    _json,
    _translated,
    cli,
    load_registry,
    open_engine,
    pass_config,
    run,
)
from umt_sdk.cli._render import _dump, _table, _when


@cli.group()
def schedules() -> None:
    """Manage schedules: cron expressions that start runs (docs/schedules.md)."""


def _registry(ref: str | None, command: str) -> Registry:
    if not ref:
        raise InputError(
            f"schedules {command} starts or checks runs of the schedule's task, so it needs the "
            "task's registry: pass --registry app.tasks:registry or set UMT_REGISTRY"
        )
    return load_registry(ref)


registry_option = click.option(
    "--registry",
    "registry_ref",
    envvar="UMT_REGISTRY",
    metavar="MODULE:REGISTRY",
    help="Where the schedule's task is defined (env UMT_REGISTRY).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _schedule_json(info: ScheduleInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "task": info.task_name,
        "cron": info.cron,
        "timezone": info.timezone,
        "input": info.input,
        "overlap": info.overlap,
        "catchup_window_seconds": info.catchup_window.total_seconds(),
        "paused": info.paused,
        "next_tick": _iso(info.next_tick),
        "last_tick": _iso(info.last_tick),
        "last_run_id": None if info.last_run_id is None else str(info.last_run_id),
        "buffered_tick": _iso(info.buffered_tick),
        "created_at": _iso(info.created_at),
        "updated_at": _iso(info.updated_at),
        "version": info.version,
    }


def _list_text(infos: list[ScheduleInfo]) -> str:
    rows = [
        [
            i.name,
            i.task_name,
            i.cron,
            i.timezone,
            i.overlap,
            "paused" if i.paused else "active",
            _when(i.next_tick),
            _when(i.last_tick),
        ]
        for i in infos
    ]
    headers = ["NAME", "TASK", "CRON", "TIMEZONE", "OVERLAP", "STATE", "NEXT", "LAST"]
    return _table(headers, rows)


def _show(info: ScheduleInfo, as_json: bool) -> None:
    if as_json:
        click.echo(_dump(_schedule_json(info)))
        return
    data = _schedule_json(info)
    width = max(len(k) for k in data)
    for key, value in data.items():
        shown = _dump(value) if isinstance(value, dict | list) else value
        click.echo(f"{key.ljust(width)}  {'-' if shown is None else shown}")


def _moment(ctx: click.Context, param: click.Parameter, value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    try:
        moment = datetime.fromisoformat(str(value).strip().replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(
            f"expected an ISO time such as 2030-01-01T03:00:00+00:00, got {value!r}", ctx, param
        ) from None
    if moment.utcoffset() is None:
        raise click.BadParameter(
            f"{value!r} has no UTC offset; add one such as +00:00 or Z", ctx, param
        )
    return moment


@schedules.command("list")
@click.option("--task", metavar="TASK", help="Only schedules of this task.")
@json_option
@pass_config
def schedules_list(cfg: CliConfig, task: str | None, as_json: bool) -> None:
    """List the stored schedules, by name."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            infos = await engine.schedules.list(task_name=task)
        if as_json:
            click.echo(_dump([_schedule_json(i) for i in infos]))
        else:
            click.echo(_list_text(infos) if infos else "no schedules")

    run(go(), cfg)


@schedules.command("show")
@click.argument("name")
@json_option
@pass_config
def schedules_show(cfg: CliConfig, name: str, as_json: bool) -> None:
    """Show the schedule NAME: its definition and where it stands (times in UTC)."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            _show(await engine.schedules.get(name), as_json)

    run(go(), cfg)


@schedules.command("create")
@click.argument("name")
@click.argument("task_name", metavar="TASK")
@click.option("--cron", required=True, help="A cron expression, e.g. '0 3 * * *'.")
@click.option(
    "--input",
    "input_",
    callback=_json,
    default="null",
    show_default=True,
    metavar="JSON",
    help="The input of every run (@file reads a file, - reads stdin).",
)
@click.option("--timezone", default="UTC", show_default=True, help="An IANA time zone.")
@click.option(
    "--overlap",
    type=click.Choice(get_args(OverlapPolicy)),
    default="skip",
    show_default=True,
    help="What a tick does while the previous run has not finished.",
)
@click.option(
    "--catchup-window",
    callback=_duration,
    default="0s",
    show_default=True,
    metavar="DURATION",
    help="After downtime, start every missed tick this recent (0: only the last one).",
)
@click.option("--paused", is_flag=True, help="Create it paused.")
@registry_option
@json_option
@pass_config
def schedules_create(
    cfg: CliConfig,
    name: str,
    task_name: str,
    cron: str,
    input_: Any,
    timezone: str,
    overlap: Any,
    catchup_window: timedelta,
    paused: bool,
    registry_ref: str | None,
    as_json: bool,
) -> None:
    """Store the schedule NAME of TASK, or bring the stored one up to these options.

    Idempotent: a schedule that exists keeps where it stands (paused or not, its last run);
    a new cron expression or time zone moves its next tick to the new expression's next.
    """
    registry = _registry(registry_ref, "create")
    with _translated():
        schedule = Schedule(
            name=name,
            task=registry.latest(task_name),
            cron=cron,
            input=input_,
            timezone=timezone,
            overlap=overlap,
            catchup_window=catchup_window,
            paused=paused,
        )

    async def go() -> None:
        async with open_engine(cfg, registry) as engine:
            _show(await engine.schedules.create(schedule), as_json)

    run(go(), cfg)


def _simple(command: str, doc: str) -> None:
    @schedules.command(command, help=doc)
    @click.argument("name")
    @json_option
    @pass_config
    def change(cfg: CliConfig, name: str, as_json: bool) -> None:
        async def go() -> None:
            async with open_engine(cfg) as engine:
                _show(await getattr(engine.schedules, command)(name), as_json)

        run(go(), cfg)


_simple("pause", "Pause the schedule NAME: no run starts until it is resumed.")
_simple(
    "resume",
    "Resume the schedule NAME from its next tick after now (ticks missed while paused are "
    "not run).",
)


@schedules.command("delete")
@click.argument("name")
@pass_config
def schedules_delete(cfg: CliConfig, name: str) -> None:
    """Delete the schedule NAME (its runs stay). One still declared in a registry comes back
    when a worker of its task starts."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            deleted = await engine.schedules.delete(name)
        click.echo(f"deleted schedule {name!r}" if deleted else f"no schedule named {name!r}")

    run(go(), cfg)


@schedules.command("trigger")
@click.argument("name")
@registry_option
@pass_config
def schedules_trigger(cfg: CliConfig, name: str, registry_ref: str | None) -> None:
    """Start a run of the schedule NAME now (whatever its overlap policy) and print its id."""
    registry = _registry(registry_ref, "trigger")

    async def go() -> None:
        async with open_engine(cfg, registry) as engine:
            handle = await engine.schedules.trigger(name)
        click.echo(str(handle.run_id))

    run(go(), cfg)


@schedules.command("backfill")
@click.argument("name")
@click.option("--start", callback=_moment, required=True, metavar="TIME", help="ISO, inclusive.")
@click.option("--end", callback=_moment, required=True, metavar="TIME", help="ISO, exclusive.")
@registry_option
@pass_config
def schedules_backfill(
    cfg: CliConfig, name: str, start: datetime, end: datetime, registry_ref: str | None
) -> None:
    """Start a run for every tick of NAME in [--start, --end) that has none yet; print each
    run's id (a tick that already ran keeps its run)."""
    registry = _registry(registry_ref, "backfill")

    async def go() -> None:
        async with open_engine(cfg, registry) as engine:
            handles = await engine.schedules.backfill(name, start, end)
        for handle in handles:
            click.echo(str(handle.run_id))
        made = sum(h.created for h in handles)
        click.echo(f"{made} new run(s), {len(handles) - made} tick(s) had one already", err=True)

    run(go(), cfg)
