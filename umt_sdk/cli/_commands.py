"""The commands every backend gets: `umt worker`, producing runs and inspecting them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn
from uuid import UUID

import click

from umt_sdk import _serde
from umt_sdk._engine import Engine
from umt_sdk._export import RunHistory
from umt_sdk._spi import StreamStore, TaskPair
from umt_sdk._streams import StreamItem
from umt_sdk.cli._app import (
    _STATUSES,
    CliConfig,
    CliError,
    InputError,
    _duration,
    _json,
    _run_id,
    _translated,
    cli,
    load_registry,
    open_engine,
    parse_duration,
    pass_config,
    redact_url,
    run,
    typed_command,
)
from umt_sdk.cli._keys import flow_key_options
from umt_sdk.cli._render import (
    ChildTree,
    _dump,
    _list_text,
    _run_json,
    _show_text,
    _streams_json,
    _tree_json,
)
from umt_sdk.exceptions import PayloadError, TaskDefinitionError

PROGRESS_STREAM = "progress"
"""The stream whose newest value `umt runs watch` shows in its PROGRESS column."""

# -- umt worker ---------------------------------------------------------------------------------


def _parse_versions(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise InputError("--versions needs at least one task@version, such as greet@1")
    return items


@cli.command()
@click.argument("registry_ref", metavar="MODULE:REGISTRY")
@click.option(
    "--versions",
    metavar="TASK@V,...",
    help="Serve only these (name, version) pairs, e.g. greet@1,bill@2. Default: every task "
    "in the registry.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Runs executed at once.",
)
@click.option(
    "--lease",
    callback=_duration,
    metavar="DURATION",
    default="10s",
    show_default=True,
    help="How long a claim holds a run without a heartbeat (500ms, 10s, 2m).",
)
@click.option(
    "--grace",
    callback=_duration,
    metavar="DURATION",
    default="10s",
    show_default=True,
    help="On SIGTERM/SIGINT: how long running steps may take to finish before their runs "
    "are given back.",
)
@click.option(
    "--poll-interval",
    callback=_duration,
    metavar="DURATION",
    default="1s",
    show_default=True,
    help="How often to look for work when no notification arrives.",
)
@click.option("--worker-id", help="Name in the runs' attempts (default: host:pid:random).")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    show_default=True,
)
@pass_config
def worker(
    cfg: CliConfig,
    registry_ref: str,
    versions: str | None,
    concurrency: int,
    lease: timedelta,
    grace: timedelta,
    poll_interval: timedelta,
    worker_id: str | None,
    log_level: str,
) -> None:
    """Serve the tasks of the Registry at MODULE:REGISTRY (e.g. app.tasks:registry).

    The module is imported with the current directory on sys.path. The first SIGTERM or SIGINT
    stops claiming, lets running steps finish for up to --grace, gives the remaining runs back
    (another worker resumes them) and exits 0; a second one exits at once, leaving the runs
    to be retried when their leases expire.
    """
    if lease < timedelta(milliseconds=100):
        raise InputError(f"--lease must be at least 100ms, got {_human(lease)}")
    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("umt.cli")
    registry = load_registry(registry_ref)
    wanted = _parse_versions(versions)
    try:
        pairs = registry.select(wanted)
    except TaskDefinitionError as exc:
        raise (CliError if isinstance(exc, LookupError) else InputError)(str(exc)) from exc

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        first_signal_at: float | None = None

        def on_signal(signum: int) -> None:
            nonlocal first_signal_at
            if first_signal_at is None:
                first_signal_at = time.monotonic()
                log.info(
                    "%s: stopping; running steps have %s to finish",
                    signal.Signals(signum).name,
                    _human(grace),
                )
                stop.set()
            elif time.monotonic() - first_signal_at >= 1.0:
                # Within a second it is likely the same signal twice (a wrapper forwarding
                # it to the process group we are also in), not an impatient operator.
                log.warning(
                    "second signal: exiting now; the runs still held are retried when their "
                    "leases expire"
                )
                _hard_exit(1)

        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, on_signal, signum)
            except NotImplementedError:  # pragma: no cover - Windows event loops
                signal.signal(signum, lambda n, _: loop.call_soon_threadsafe(on_signal, n))
        async with open_engine(cfg, registry, worker=True, concurrency=concurrency) as engine:
            w = engine.worker(
                versions=[str(p) for p in pairs],
                concurrency=concurrency,
                lease=lease,
                worker_id=worker_id,
                poll_interval=poll_interval,
                shutdown_grace=grace,
            )
            await w.start()
            where = cfg.where()
            log.info(
                "worker %s serving %s (concurrency %d, lease %s) on %s%s",
                w.worker_id,
                ", ".join(str(p) for p in pairs),
                concurrency,
                _human(lease),
                redact_url(cfg.url()),
                f", {where}" if where else "",
            )
            await stop.wait()
            held = len(w.running_runs)
            await w.stop()
            log.info("stopped (%d run(s) were in progress)", held)

    _serve(serve())


def _age(duration: timedelta) -> str:
    """A retention age as people say it: 30d, 12h, 90m, 45s."""
    seconds = duration.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _human(duration: timedelta) -> str:
    seconds = duration.total_seconds()
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    if seconds < 120 or seconds % 60:
        return f"{seconds:g}s"
    return f"{seconds / 60:g}m"


def _hard_exit(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(coro: Coroutine[Any, Any, None]) -> None:
    """Like `_run`, but without waiting for step bodies still running in threads at the end.

    A plain (sync) step cannot be interrupted: once the worker has given its run back after
    the grace, waiting for the thread would only delay the exit (`asyncio.run` would).
    """
    loop = asyncio.new_event_loop()
    executor = ThreadPoolExecutor(thread_name_prefix="umt-step")
    loop.set_default_executor(executor)
    finished = False
    try:
        with _translated():
            loop.run_until_complete(coro)
        finished = True
    finally:
        leftover = asyncio.all_tasks(loop)
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + 1.0
        busy = []
        for thread in threading.enumerate():
            if thread is threading.main_thread() or thread.daemon:
                continue
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                busy.append(thread)
        loop.close()
        if busy and finished:
            logging.getLogger("umt.cli").warning(
                "exiting with %d step body(ies) still running in threads; their runs were "
                "given back",
                len(busy),
            )
            _hard_exit(0)


# -- producing --------------------------------------------------------------------------------


def _tags(ctx: click.Context, param: click.Parameter, value: Any) -> dict[str, str]:
    """`--tag KEY=VALUE`, repeated: a dict (checked again, fully, by the engine)."""
    tags: dict[str, str] = {}
    for item in value or ():
        key, sep, tag_value = str(item).partition("=")
        if not sep or not key:
            raise click.BadParameter(
                f"expected KEY=VALUE such as tenant=t7, got {item!r}", ctx, param
            )
        if key in tags and tags[key] != tag_value:
            raise click.BadParameter(f"tag {key!r} given twice, differently", ctx, param)
        tags[key] = tag_value
    return tags


@cli.command()
@click.argument("task_ref", metavar="TASK[@VERSION]")
@click.option(
    "--input",
    "input_",
    callback=_json,
    required=True,
    metavar="JSON",
    help="The task's input as JSON (@file reads a file, - reads stdin).",
)
@click.option(
    "--registry",
    "registry_ref",
    envvar="UMT_REGISTRY",
    metavar="MODULE:REGISTRY",
    help="Where the task is defined (env UMT_REGISTRY). Required: the input is validated "
    "against the task's input type before anything is stored.",
)
@click.option("--idempotency-key", metavar="KEY", help="Enqueue once per key (same input).")
@click.option(
    "--priority",
    type=click.IntRange(-32768, 32767),
    default=0,
    show_default=True,
    help="Higher runs first.",
)
@click.option(
    "--delay",
    callback=_duration,
    metavar="DURATION",
    help="Do not start before this much time (e.g. 5m).",
)
@click.option(
    "--deadline",
    callback=_duration,
    metavar="DURATION",
    help="End the run failed (DeadlineExceededError) if it is not finished this long from "
    "now (e.g. 30m); the task's own timeout, if sooner, wins.",
)
@click.option(
    "--start-within",
    callback=_duration,
    metavar="DURATION",
    help="End the run failed without running it if no worker starts it this long after it "
    "becomes claimable (e.g. 5m).",
)
@click.option(
    "--tag",
    "tags",
    multiple=True,
    callback=_tags,
    metavar="KEY=VALUE",
    help="A tag to find the run by (umt runs list --tag); repeat for more.",
)
@click.option(
    "--singleton",
    metavar="KEY",
    help="At most one active run of the task per KEY: while one is active, print its id and "
    "store nothing (or replace it: --singleton-mode replace).",
)
@click.option(
    "--singleton-mode",
    type=click.Choice(["skip", "replace"]),
    help="With --singleton: skip (the default) or replace the active run.",
)
@click.option(
    "--debounce",
    metavar="KEY",
    help="Collapse a burst of triggers of KEY into one run with the last input (needs "
    "--debounce-period).",
)
@click.option(
    "--debounce-period",
    callback=_duration,
    metavar="DURATION",
    help="With --debounce: the quiet time after the last trigger before the run starts.",
)
@click.option(
    "--debounce-max-wait",
    callback=_duration,
    metavar="DURATION",
    help="With --debounce: the longest delay from the first trigger (>= the period).",
)
@click.option(
    "--sequence",
    metavar="KEY",
    help="Runs of the task with this KEY start one at a time, in enqueue order.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_config
def enqueue(
    cfg: CliConfig,
    task_ref: str,
    input_: Any,
    registry_ref: str | None,
    idempotency_key: str | None,
    priority: int,
    delay: timedelta | None,
    deadline: timedelta | None,
    start_within: timedelta | None,
    tags: dict[str, str],
    singleton: str | None,
    singleton_mode: str | None,
    debounce: str | None,
    debounce_period: timedelta | None,
    debounce_max_wait: timedelta | None,
    sequence: str | None,
    as_json: bool,
) -> None:
    """Start a run of TASK (its newest version, or TASK@VERSION) and print its id.

    The input is checked against the task's input type, so the task's Registry is needed:
    pass --registry app.tasks:registry or set UMT_REGISTRY. A field that does not fit is named
    in the error (exit 2) and nothing is stored.

    With --idempotency-key, enqueueing the same key and input again prints the existing run's
    id; the same key with a different input is refused (exit 1).

    Keys that shape the flow (one per enqueue): --singleton KEY (--singleton-mode skip or
    replace), --debounce KEY --debounce-period 5s [--debounce-max-wait 1m], --sequence KEY.
    A trigger that joined or was skipped prints the run it joined, and says so on stderr.
    """
    if not registry_ref:
        raise InputError(
            "enqueue validates --input against the task's input type, so it needs the task's "
            "registry: pass --registry app.tasks:registry or set UMT_REGISTRY"
        )
    registry = load_registry(registry_ref)
    with _translated():
        definition = registry.resolve(task_ref)
    try:  # before connecting: a bad field fails fast, with no database needed
        _serde.validate(input_, definition.input_type, what="input")
    except PayloadError as exc:
        detail = str(exc).removeprefix("invalid input: ")
        raise InputError(f"invalid --input for {definition.pair}: {detail}") from exc
    keys = flow_key_options(
        definition,
        singleton=singleton,
        singleton_mode=singleton_mode,
        debounce=debounce,
        debounce_period=debounce_period,
        debounce_max_wait=debounce_max_wait,
        sequence=sequence,
        idempotency_key=idempotency_key,
        delay=delay,
        start_within=start_within,
    )

    async def go() -> None:
        async with open_engine(cfg, registry) as engine:
            handle = await engine.enqueue(
                definition,
                input_,
                version=definition.version,
                idempotency_key=idempotency_key,
                priority=priority,
                delay=delay,
                deadline=deadline,
                start_within=start_within,
                tags=tags,
                **keys,
            )
        if as_json:
            click.echo(
                _dump(
                    {
                        "run_id": str(handle.run_id),
                        "task": handle.task_name,
                        "version": handle.task_version,
                        "created": handle.created,
                    }
                )
            )
            return
        click.echo(str(handle.run_id))
        if not handle.created:
            if singleton is not None:
                why = f"is the active run of singleton key {singleton!r}: nothing stored"
            elif debounce is not None:
                why = f"is the debounced run of key {debounce!r}: it takes this input"
            else:
                why = f"has idempotency key {idempotency_key!r} and this input"
            click.echo(
                f"(an existing run of {handle.task_name}@{handle.task_version} {why})", err=True
            )

    run(go(), cfg)


@cli.command("signal")
@click.argument("run_id", callback=_run_id, metavar="RUN")
@click.argument("name")
@click.option(
    "--payload",
    callback=_json,
    default="null",
    show_default=True,
    metavar="JSON",
    help="The fact's payload as JSON (@file reads a file, - reads stdin).",
)
@pass_config
def signal_(cfg: CliConfig, run_id: UUID, name: str, payload: Any) -> None:
    """Send the fact NAME to RUN (first write wins) and wake it if it waits for it."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            stored = await engine.signal(run_id, name, payload)
        if stored:
            click.echo(f"sent fact {name!r} to run {run_id}")
        else:
            click.echo(
                f"run {run_id} already had a fact {name!r}; the first payload stays "
                "(facts are written once)"
            )

    run(go(), cfg)


@cli.command()
@click.argument("run_id", callback=_run_id, metavar="RUN")
@click.option("--reason", default="", help="Recorded on the run and given to the handler.")
@pass_config
def cancel(cfg: CliConfig, run_id: UUID, reason: str) -> None:
    """Cancel RUN: pending and waiting runs end at once; a running one stops at its next step."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            outcome = await engine.cancel(run_id, reason=reason)
            if outcome == "canceled":
                click.echo(f"canceled run {run_id}")
            elif outcome == "requested":
                click.echo(
                    f"cancel requested: run {run_id} is running and ends canceled at its next "
                    "step boundary"
                )
            else:
                info = await engine.get(run_id)
                click.echo(f"run {run_id} had already finished ({info.status}); nothing to cancel")

    run(go(), cfg)


# -- umt runs -----------------------------------------------------------------------------------


@cli.group()
def runs() -> None:
    """Inspect runs: list, show one, watch them live, export their histories, prune old ones."""


def _task_filter(task: str | None) -> tuple[str | None, int | None]:
    if task is None or "@" not in task:
        return task, None
    try:
        pair = TaskPair.parse(task)
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    return pair.name, pair.version


task_option = click.option("--task", metavar="TASK[@VERSION]", help="Only runs of this task.")
status_option = click.option(
    "--status", type=click.Choice(_STATUSES), help="Only runs with this status."
)


def _limit_option(default: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--limit",
        type=click.IntRange(1, 10_000),
        default=default,
        show_default=True,
        help="At most this many runs, newest first.",
    )


def _moment(ctx: click.Context, param: click.Parameter, value: Any) -> datetime | None:
    """An ISO 8601 time (UTC unless it says otherwise), or a duration meaning that long ago
    (`2h`, `30d`)."""
    if value is None:
        return None
    with contextlib.suppress(ValueError):
        return datetime.now(UTC) - parse_duration(str(value))
    return _since(ctx, param, value)


def _time_option(name: str, help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        name,
        callback=_moment,
        metavar="TIME",
        help=f"{help} (ISO 8601, UTC unless it says otherwise; or 2h, 30d: that long ago).",
    )


@runs.command("list")
@task_option
@click.option(
    "--status",
    type=click.Choice([*_STATUSES, "needs_attention"]),
    help="Only runs with this status (needs_attention: waiting for an operator to settle a "
    "step, `umt runs settle`).",
)
@click.option(
    "--tag",
    "tags",
    multiple=True,
    callback=_tags,
    metavar="KEY=VALUE",
    help="Only runs with this tag; repeat for runs with all of them.",
)
@click.option(
    "--idempotency-key",
    metavar="KEY",
    help="Only the run enqueued under this idempotency key (with --task: keys are per task).",
)
@click.option("--parent", callback=_run_id, metavar="RUN", help="Only the children of RUN.")
@_time_option("--created-after", "Only runs created at or after TIME")
@_time_option("--created-before", "Only runs created before TIME")
@_time_option("--finished-after", "Only runs finished at or after TIME")
@_time_option("--finished-before", "Only runs finished before TIME")
@_limit_option(50)
@click.option(
    "--before", callback=_run_id, metavar="RUN", help="Runs older than this one (paging)."
)
@click.option(
    "--key",
    "concurrency_key",
    metavar="KEY",
    help="Only runs of this concurrency key (with --task: keys are per task).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one array).")
@click.pass_context
@pass_config
def runs_list(
    cfg: CliConfig,
    ctx: click.Context,
    task: str | None,
    status: Any,
    tags: dict[str, str],
    idempotency_key: str | None,
    parent: UUID | None,
    created_after: datetime | None,
    created_before: datetime | None,
    finished_after: datetime | None,
    finished_before: datetime | None,
    limit: int,
    before: UUID | None,
    concurrency_key: str | None,
    as_json: bool,
) -> None:
    """List runs, newest first, matching every filter given."""
    name, version = _task_filter(task)
    if idempotency_key is not None and name is None:
        raise InputError(
            "--idempotency-key needs --task: an idempotency key names one run of one task"
        )

    async def go() -> None:
        async with open_engine(cfg) as engine:
            page = await engine.list(
                task_name=name,
                version=version,
                status=None if status == "needs_attention" else status,
                needs_attention=status == "needs_attention",
                tags=tags,
                idempotency_key=idempotency_key,
                parent=parent,
                created_after=created_after,
                created_before=created_before,
                finished_after=finished_after,
                finished_before=finished_before,
                limit=limit,
                before=before,
                concurrency_key=concurrency_key,
            )
        if as_json:
            click.echo(_dump([_run_json(r, detail=False) for r in page.runs]))
            return
        if not page.runs:
            click.echo("no runs")
            return
        click.echo(_list_text(page.runs))
        if page.next_cursor is not None:
            click.echo(f"(more: {_next_page(ctx, limit, page.next_cursor)})", err=True)

    run(go(), cfg)


_LIST_FILTERS = {
    "task": "--task",
    "status": "--status",
    "concurrency_key": "--key",
    "idempotency_key": "--idempotency-key",
    "parent": "--parent",
    "created_after": "--created-after",
    "created_before": "--created-before",
    "finished_after": "--finished-after",
    "finished_before": "--finished-before",
}


def _next_page(ctx: click.Context, limit: int, cursor: UUID) -> str:
    """The command that lists the next page: every filter of this one repeated (times as the
    moments they stood for, so the next page is of the same window)."""
    words = ["runs", "list"]
    for param, flag in _LIST_FILTERS.items():
        value = ctx.params.get(param)
        if value is not None:
            text = value.isoformat() if isinstance(value, datetime) else str(value)
            words += [flag, text]
    for tag_key, tag_value in (ctx.params.get("tags") or {}).items():
        words += ["--tag", f"{tag_key}={tag_value}"]
    command, left_out = typed_command(ctx, *words, "--limit", str(limit), "--before", str(cursor))
    return f"{command}, with your --database-url" if left_out else command


@runs.command("prune")
@click.option(
    "--older-than",
    callback=_duration,
    required=True,
    metavar="DURATION",
    help="Delete runs that finished longer ago than this (e.g. 30d).",
)
@click.option(
    "--task",
    "tasks",
    multiple=True,
    metavar="TASK",
    help="Only runs of this task; repeat for more (default: every task).",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option(
    "--batch-size",
    type=click.IntRange(1, 10_000),
    default=500,
    show_default=True,
    help="Runs deleted per statement.",
)
@pass_config
def runs_prune(
    cfg: CliConfig,
    older_than: timedelta,
    tasks: tuple[str, ...],
    dry_run: bool,
    batch_size: int,
) -> None:
    """Delete finished runs older than --older-than, with their steps, facts and streams.

    Pending, running and waiting runs are never touched, nor are runs whose family has not
    finished. Each deleted run leaves a tombstone: its idempotency key stays taken, and
    `runs show` says it was pruned. Workers do the same on their own with
    connect(retention=...); see docs/retention.md.
    """
    for name in tasks:
        if "@" in name:
            raise InputError(
                f"--task takes a task name ({name.split('@')[0]!r}): retention deletes the runs "
                "of every version of a task"
            )

    async def go() -> None:
        async with open_engine(cfg) as engine:
            report = await engine.prune(
                older_than=older_than,
                task=list(tasks) or None,
                dry_run=dry_run,
                batch_size=batch_size,
            )
        which = f" of {', '.join(tasks)}" if tasks else ""
        age = _age(older_than)
        if report.dry_run:
            click.echo(f"would delete {report.pruned} runs{which} finished more than {age} ago")
            return
        click.echo(
            f"deleted {report.pruned} runs{which} finished more than {age} ago "
            f"({report.batches} batches)"
        )
        if report.busy:
            click.echo(
                "(a worker was deleting at the same time and goes on with the rest)", err=True
            )

    run(go(), cfg)


@runs.command("show")
@click.argument("run_id", callback=_run_id, metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, with tracebacks.")
@pass_config
def runs_show(cfg: CliConfig, run_id: UUID, as_json: bool) -> None:
    """Show a run: status, attempts, errors and its step timeline.

    Steps and attempts marked `!` were interrupted: the attempt lost its lease in the middle
    (a crash, a freeze) and a later one picked the run up.
    """

    async def go() -> None:
        async with open_engine(cfg) as engine:
            info = await engine.get(run_id)
            children, more = await _children(engine, run_id, depth=3)
            streams = (await _stream_heads(engine, [run_id])).get(run_id, {})
        if as_json:
            data = _run_json(info, detail=True)
            data["children"] = _tree_json(children)
            data["streams"] = _streams_json(streams)
            click.echo(_dump(data))
        else:
            click.echo(_show_text(info, children, more, streams))

    run(go(), cfg)


async def _stream_heads(
    engine: Engine, run_ids: list[UUID], name: str | None = None
) -> Mapping[UUID, Mapping[str, StreamItem]]:
    """The newest value of each stream of the runs; none on a backend that stores no streams."""
    if not isinstance(engine.backend, StreamStore):
        return {}
    return await engine.stream_heads(run_ids, name=name)


CHILDREN_SHOWN = 50
"""Children `runs show` draws per run (the rest are counted)."""


async def _children(engine: Engine, run_id: UUID, *, depth: int) -> tuple[list[ChildTree], int]:
    """The run's children, oldest first, each with its own down to `depth` levels, and how
    many were left out."""
    if depth == 0:
        return [], 0
    page = await engine.list(parent=run_id, limit=CHILDREN_SHOWN)
    trees = []
    for child in reversed(page.runs):
        grandchildren, more = await _children(engine, child.run_id, depth=depth - 1)
        trees.append(ChildTree(info=child, children=tuple(grandchildren), more=more))
    left = 0
    if page.next_cursor is not None:
        rest = await engine.list(parent=run_id, before=page.next_cursor, limit=10_000)
        left = len(rest.runs) + (1 if rest.next_cursor else 0)
    return trees, left


@runs.command("watch")
@click.argument("run_id", callback=_run_id, metavar="[RUN]", required=False)
@task_option
@status_option
@_limit_option(20)
@click.option(
    "--interval",
    callback=_duration,
    metavar="DURATION",
    default="1s",
    show_default=True,
    help="Time between refreshes.",
)
@click.option(
    "--iterations",
    type=click.IntRange(min=1),
    help="Stop after this many refreshes (default: until Ctrl-C).",
)
@pass_config
def runs_watch(
    cfg: CliConfig,
    run_id: UUID | None,
    task: str | None,
    status: Any,
    limit: int,
    interval: timedelta,
    iterations: int | None,
) -> None:
    """Refresh the list of runs (or one RUN's details) every second until Ctrl-C.

    On a terminal the screen is redrawn; otherwise (a pipe, a file) each refresh is printed
    after a `== time ==` line.
    """
    name, version = _task_filter(task)
    tty = sys.stdout.isatty()

    async def frame(engine: Engine) -> str:
        if run_id is not None:
            info = await engine.get(run_id)
            streams = (await _stream_heads(engine, [run_id])).get(run_id, {})
            return _show_text(info, streams=streams)
        page = await engine.list(task_name=name, version=version, status=status, limit=limit)
        if not page.runs:
            return "no runs"
        counts: dict[str, int] = {}
        for r in page.runs:
            counts[r.status] = counts.get(r.status, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        heads = await _stream_heads(engine, [r.run_id for r in page.runs], PROGRESS_STREAM)
        progress = {
            run: streams[PROGRESS_STREAM]
            for run, streams in heads.items()
            if PROGRESS_STREAM in streams
        }
        return f"{_list_text(page.runs, progress)}\n\n{len(page.runs)} shown: {summary}"

    async def go() -> None:
        # Ctrl-C ends the watch between two frames. It is not left to cancel the running task:
        # on Python 3.11 a cancellation that lands as an inner wait completes can be lost,
        # and the watch would go on. A second Ctrl-C interrupts at once.
        interrupted = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_sigint() -> None:
            interrupted.set()
            loop.remove_signal_handler(signal.SIGINT)

        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        async with open_engine(cfg) as engine:
            done = 0
            while not interrupted.is_set():
                text = await frame(engine)
                stamp = datetime.now().strftime("%H:%M:%S")
                if tty:
                    click.clear()
                    where = f" - {cfg.where()}" if cfg.where() else ""
                    click.echo(f"umt runs watch{where} - {stamp} (Ctrl-C stops)\n")
                    click.echo(text)
                else:
                    click.echo(f"== {stamp} ==")
                    click.echo(text)
                done += 1
                if iterations is not None and done >= iterations:
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval.total_seconds()):
                        await interrupted.wait()

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a watch ends
        run(go(), cfg)


# -- histories: umt runs export, umt replay ---------------------------------------------------


def _statuses(text: str | None) -> list[Any]:
    if text is None:
        return []
    items = [item.strip() for item in text.split(",") if item.strip()]
    wrong = [item for item in items if item not in _STATUSES]
    if not items or wrong:
        raise InputError(
            f"--status takes a comma-separated list of {', '.join(_STATUSES)}; got {text!r}"
        )
    return items


def _run_ids(ctx: click.Context, param: click.Parameter, value: Any) -> tuple[UUID, ...]:
    ids: list[UUID] = []
    for item in value:
        parsed = _run_id(ctx, param, item)
        if parsed is not None:
            ids.append(parsed)
    return tuple(ids)


def _since(ctx: click.Context, param: click.Parameter, value: Any) -> datetime | None:
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(str(value))
    except ValueError:
        raise click.BadParameter(
            f"expected an ISO 8601 time such as 2025-01-31T12:00:00+00:00, got {value!r}",
            ctx,
            param,
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


@runs.command("export")
@click.argument("run_ids", callback=_run_ids, metavar="[RUN]...", nargs=-1)
@task_option
@click.option(
    "--status",
    metavar="STATUS,...",
    help="Only runs with one of these statuses, e.g. running,waiting,pending.",
)
@click.option(
    "--since",
    callback=_since,
    metavar="TIME",
    help="Only runs created at or after this ISO 8601 time (UTC unless it says otherwise).",
)
@pass_config
def runs_export(
    cfg: CliConfig,
    run_ids: tuple[UUID, ...],
    task: str | None,
    status: str | None,
    since: datetime | None,
) -> None:
    """Print the recorded history of runs as JSON Lines: one `umt.history` object per run.

    Name the runs (RUN...), or select them with --task, --status and --since (every page,
    newest first). `umt replay --registry app.tasks:registry FILE` checks new code against
    the file before it ships; docs/testing.md documents the format field by field.
    """
    statuses = _statuses(status)
    if run_ids and (task or statuses or since):
        raise InputError("give run ids or --task/--status/--since, not both")
    if not run_ids and not (task or statuses or since):
        raise InputError(
            "name the runs to export (umt runs export RUN...) or select them with "
            "--task NAME[@VERSION], --status running,waiting or --since TIME"
        )
    name, version = _task_filter(task)

    async def selected(engine: Engine) -> list[UUID]:
        found: list[UUID] = []
        for one in statuses or [None]:
            cursor: UUID | None = None
            while True:
                page = await engine.list(
                    task_name=name, version=version, status=one, limit=500, before=cursor
                )
                runs_ = [r for r in page.runs if since is None or r.created_at >= since]
                found += [r.run_id for r in runs_]
                older = since is not None and len(runs_) < len(page.runs)
                if page.next_cursor is None or older:  # newest first: the rest are older
                    break
                cursor = page.next_cursor
        return sorted(set(found))

    async def go() -> None:
        async with open_engine(cfg) as engine:
            for run_id in run_ids or await selected(engine):
                history = await engine.export_history(run_id)
                click.echo(history.to_json())

    run(go(), cfg)


@cli.command("replay")
@click.argument("source", metavar="FILE", type=click.File("rb"))
@click.option(
    "--registry",
    "registry_ref",
    envvar="UMT_REGISTRY",
    required=True,
    metavar="MODULE:REGISTRY",
    help="Today's code: the Registry its histories are replayed against (env UMT_REGISTRY).",
)
def replay(source: Any, registry_ref: str) -> None:
    """Replay the histories in FILE (`-`: stdin), from `umt runs export`, against the tasks of
    MODULE:REGISTRY, with no database and no side effects: no step body runs.

    Prints one line per run: `ok ...`, or `FAILED ...` with the diff of the recorded steps and
    what the code asks for now. Exit 0 when every run replays, 1 when any does not (or its
    task and version is not registered), 2 when FILE is not a history file. Run it in a deploy
    pipeline on the runs in flight before shipping new code.
    """
    from umt_sdk.testing._replay import Replayer  # the test kits load only for this command

    registry = load_registry(registry_ref)
    name = "stdin" if source.name in ("<stdin>", "-") else str(source.name)
    try:
        histories = RunHistory.from_jsonl(source.read(), source=name)
    except PayloadError as exc:
        raise InputError(str(exc)) from exc
    if not histories:
        raise InputError(f"{name} holds no history: export some with `umt runs export`")
    results = run(Replayer(registry).replay_many(histories))
    for result in results:
        click.echo(result.summary())
    failed = sum(1 for r in results if not r.ok)
    if failed:
        raise CliError(f"{failed} of {len(results)} run(s) no longer replay")
    click.echo(f"all {len(results)} run(s) replay", err=True)
