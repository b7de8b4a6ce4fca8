"""`umt tasks pause|resume|paused` and `umt runs rerun|fork`, one run or every run a filter
matches (docs/lifecycle.md)."""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import click
from attrs import frozen

from umt_sdk._engine import Engine
from umt_sdk._lifecycle import ForkPlan, restartable
from umt_sdk._spi import TERMINAL_STATUSES, PausedTask, RunStatus
from umt_sdk._views import RunInfo
from umt_sdk.cli._app import (
    CliConfig,
    CliError,
    InputError,
    _run_id,
    cli,
    open_engine,
    parse_duration,
    pass_config,
    run,
)
from umt_sdk.cli._commands import _task_filter, runs, status_option, task_option
from umt_sdk.cli._render import _dump, _table, _when
from umt_sdk.exceptions import UsageError

__all__ = ["BULK_LIMIT"]

BULK_LIMIT = 10_000
"""The most runs one `umt runs rerun|fork` with a filter starts again (`--limit`)."""

_PAGE = 1000

# -- umt tasks ----------------------------------------------------------------------------------


@cli.group()
def tasks() -> None:
    """Pause and resume tasks: a paused task's runs wait, unharmed, until it is resumed."""


def _paused_json(paused: PausedTask) -> dict[str, Any]:
    return {
        "task": paused.task_name,
        "version": paused.task_version,
        "paused_at": paused.paused_at.isoformat(),
    }


@tasks.command("pause")
@click.argument("task", metavar="TASK[@VERSION]")
@pass_config
def tasks_pause(cfg: CliConfig, task: str) -> None:
    """Pause TASK (every version) or TASK@VERSION: no worker starts its runs until `umt tasks
    resume`; runs already executing go on until they end or park."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            stored = await engine.pause(task)
        if stored:
            click.echo(f"paused {task}: its runs wait until `umt tasks resume {task}`")
        else:
            click.echo(f"{task} was paused already")

    run(go(), cfg)


@tasks.command("resume")
@click.argument("task", metavar="TASK[@VERSION]")
@pass_config
def tasks_resume(cfg: CliConfig, task: str) -> None:
    """Resume TASK (every pause of it) or TASK@VERSION: its waiting runs start again."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            removed = await engine.resume(task)
        click.echo(f"resumed {task}" if removed else f"{task} was not paused; nothing to resume")

    run(go(), cfg)


@tasks.command("paused")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_config
def tasks_paused(cfg: CliConfig, as_json: bool) -> None:
    """List the paused tasks."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            paused = await engine.paused()
        if as_json:
            click.echo(_dump([_paused_json(p) for p in paused]))
        elif not paused:
            click.echo("no paused tasks")
        else:
            rows = [
                [p.task_name, "all" if p.task_version is None else str(p.task_version)]
                for p in paused
            ]
            for row, p in zip(rows, paused, strict=True):
                row.append(_when(p.paused_at))
            click.echo(_table(["TASK", "VERSION", "PAUSED"], rows))

    run(go(), cfg)


# -- umt runs rerun | fork ----------------------------------------------------------------------


def _moment(ctx: click.Context, param: click.Parameter, value: Any) -> datetime | None:
    """An ISO time with an offset, or a duration (`2h`: that long ago)."""
    if value is None or isinstance(value, datetime):
        return value
    text = str(value).strip()
    try:
        return datetime.now(UTC) - parse_duration(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(
            f"expected a duration such as 2h (that long ago) or an ISO time such as "
            f"2030-01-01T03:00:00+00:00, got {value!r}",
            ctx,
            param,
        ) from None
    if moment.utcoffset() is None:
        raise click.BadParameter(
            f"{value!r} has no UTC offset; add one such as +00:00 or Z", ctx, param
        )
    return moment


@frozen(kw_only=True)
class _Filter:
    task: str | None
    status: RunStatus | None
    since: datetime | None
    until: datetime | None
    limit: int

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.task, self.status, self.since, self.until))

    def words(self) -> str:
        parts = [f"--task {self.task}"] if self.task else []
        parts += [f"--status {self.status}"] if self.status else []
        parts += [f"--since {self.since.isoformat()}"] if self.since else []
        parts += [f"--until {self.until.isoformat()}"] if self.until else []
        return " ".join(parts)


async def _matching(engine: Engine, where: _Filter) -> AsyncIterator[RunInfo]:
    """The finished runs the filter matches, newest first, at most `limit` (run ids are
    time-ordered: the listing stops at the first run created before `since`)."""
    name, version = _task_filter(where.task)
    before: UUID | None = None
    found = 0
    while True:
        page = await engine.list(
            task_name=name, version=version, status=where.status, limit=_PAGE, before=before
        )
        for info in page.runs:
            if where.since is not None and info.created_at < where.since:
                return
            if where.until is not None and info.created_at > where.until:
                continue
            if info.status not in TERMINAL_STATUSES:
                continue
            yield info
            found += 1
            if found >= where.limit:
                return
        if page.next_cursor is None:
            return
        before = page.next_cursor


def filter_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(
        [
            task_option,
            status_option,
            click.option(
                "--since",
                callback=_moment,
                metavar="WHEN",
                help="Only runs created at or after WHEN (2h: two hours ago; or an ISO time).",
            ),
            click.option(
                "--until",
                callback=_moment,
                metavar="WHEN",
                help="Only runs created at or before WHEN.",
            ),
            click.option(
                "--limit",
                type=click.IntRange(1, BULK_LIMIT),
                default=BULK_LIMIT,
                show_default=True,
                help="At most this many runs (newest first).",
            ),
            click.option(
                "--version",
                "version",
                type=click.IntRange(1),
                help="Run on this version (default: each run's own; never an older one).",
            ),
            click.option(
                "--dry-run", is_flag=True, help="Say what would start again; start nothing."
            ),
            click.option(
                "--yes", "-y", is_flag=True, help="Do not ask before starting many runs again."
            ),
        ]
    ):
        fn = option(fn)
    return fn


def _check_target(run_id: UUID | None, where: _Filter, command: str) -> None:
    if run_id is None and not where.given:
        raise InputError(
            f"runs {command} needs a RUN, or a filter that picks the runs (--task, --status, "
            "--since, --until): without one it would start every finished run again"
        )
    if run_id is not None and where.given:
        raise InputError(f"runs {command}: give a RUN or filters, not both")


def _confirm(count: int, what: str, yes: bool) -> None:
    if yes or count == 0:
        return
    if not click.confirm(f"{what} {count} run(s)?", default=False, err=True):
        raise CliError("nothing started (answer y, or pass --yes)")


async def _one_or_matching(
    engine: Engine, run_id: UUID | None, where: _Filter
) -> builtins.list[RunInfo]:
    if run_id is not None:
        return [await engine.get(run_id)]
    return [info async for info in _matching(engine, where)]


@runs.command("rerun")
@click.argument("run_id", callback=_run_id, metavar="[RUN]", required=False)
@filter_options
@pass_config
def runs_rerun(
    cfg: CliConfig,
    run_id: UUID | None,
    task: str | None,
    status: Any,
    since: datetime | None,
    until: datetime | None,
    limit: int,
    version: int | None,
    dry_run: bool,
    yes: bool,
) -> None:
    """Start RUN again from the start (same input, linked to it), or every finished run the
    filters match. Prints the new run ids, one per line (`old new`)."""
    where = _Filter(task=task, status=status, since=since, until=until, limit=limit)
    _check_target(run_id, where, "rerun")

    async def go() -> None:
        async with open_engine(cfg) as engine:
            chosen = await _one_or_matching(engine, run_id, where)
            if run_id is None:
                try:
                    for info in chosen:
                        restartable(info, version, "rerun")
                except UsageError as exc:
                    raise InputError(str(exc)) from exc
            if dry_run:
                for info in chosen:
                    click.echo(f"{info.run_id}  would rerun ({info.task_name}@{info.task_version})")
                click.echo(f"would rerun {len(chosen)} run(s)", err=True)
                return
            _confirm(len(chosen), "rerun", yes or run_id is not None)
            for info in chosen:
                handle = await engine.rerun(info.run_id, version=version)
                click.echo(f"{info.run_id} {handle.run_id}" if run_id is None else handle.run_id)
            click.echo(f"reran {len(chosen)} run(s)", err=True)

    run(go(), cfg)


@runs.command("fork")
@click.argument("run_id", callback=_run_id, metavar="[RUN]", required=False)
@click.option(
    "--from-step",
    "from_step",
    required=True,
    metavar="STEP",
    help="The step to execute from; the steps recorded before it are kept (replayed).",
)
@filter_options
@pass_config
def runs_fork(
    cfg: CliConfig,
    run_id: UUID | None,
    from_step: str,
    task: str | None,
    status: Any,
    since: datetime | None,
    until: datetime | None,
    limit: int,
    version: int | None,
    dry_run: bool,
    yes: bool,
) -> None:
    """Start RUN again from its step STEP, keeping what it recorded before (docs/lifecycle.md),
    or every finished run the filters match that recorded STEP (the others are skipped, and
    counted). Prints the new run ids (`old new` per line for a filter)."""
    where = _Filter(task=task, status=status, since=since, until=until, limit=limit)
    _check_target(run_id, where, "fork")

    async def go() -> None:
        async with open_engine(cfg) as engine:
            if run_id is not None:
                if dry_run:
                    plan = await _plan(engine, run_id, from_step, version)
                    if isinstance(plan, str):
                        raise InputError(plan)
                    _say_plan(run_id, plan)
                    return
                handle = await engine.fork(run_id, from_step, version=version)
                click.echo(handle.run_id)
                return
            planned: builtins.list[tuple[UUID, ForkPlan]] = []
            skipped: dict[str, int] = {}
            async for info in _matching(engine, where):
                plan = await _plan(engine, info.run_id, from_step, version)
                if isinstance(plan, str):
                    reason = "never recorded the step" if "never recorded" in plan else plan
                    skipped[reason] = skipped.get(reason, 0) + 1
                else:
                    planned.append((info.run_id, plan))
            if dry_run:
                for old, plan in planned:
                    _say_plan(old, plan)
                click.echo(_summary("would fork", len(planned), skipped, from_step), err=True)
                return
            _confirm(len(planned), f"fork from step {from_step!r}", yes)
            for old, _ in planned:
                handle = await engine.fork(old, from_step, version=version)
                click.echo(f"{old} {handle.run_id}")
            click.echo(_summary("forked", len(planned), skipped, from_step), err=True)

    run(go(), cfg)


async def _plan(
    engine: Engine, run_id: UUID, from_step: str, version: int | None
) -> ForkPlan | str:
    record = await engine.backend.get_run(run_id)
    if record is None:
        return f"no run {run_id}"
    try:
        restartable(record, version, "fork")
    except UsageError as exc:
        return str(exc)
    return await engine._fork_plan(record, from_step)


def _say_plan(run_id: UUID, plan: ForkPlan) -> None:
    kept = ", ".join(dict.fromkeys(name for name, _ in plan.kept_steps)) or "none"
    again = (
        f"; starts again the children of {', '.join(plan.restarted_children)}"
        if plan.restarted_children
        else ""
    )
    click.echo(f"{run_id}  would fork from {plan.from_step!r}, keeping {kept}{again}")


def _summary(done: str, count: int, skipped: dict[str, int], from_step: str) -> str:
    text = f"{done} {count} run(s) from step {from_step!r}"
    for reason, n in sorted(skipped.items()):
        text += f"; skipped {n}: {reason}"
    return text
