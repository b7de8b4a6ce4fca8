"""`umt limits list|show|set|pause|resume`: the stored rate limits (docs/flow-control.md)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import click

from umt_sdk._spi import RateLimitInfo
from umt_sdk.cli._app import CliConfig, InputError, _duration, cli, open_engine, pass_config, run
from umt_sdk.cli._render import _dump, _table, _when

__all__: list[str] = []


@cli.group()
def limits() -> None:
    """Rate limits: named token buckets shared by every worker (`RateLimit`)."""


def _span(span: timedelta) -> str:
    seconds = span.total_seconds()
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds * 1000:g}ms"


def _limit_json(info: RateLimitInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "limit": info.limit,
        "per_seconds": info.per.total_seconds(),
        "interval_seconds": info.interval.total_seconds(),
        "paused": info.paused,
        "created_at": info.created_at.isoformat(),
        "updated_at": info.updated_at.isoformat(),
    }


def _row(info: RateLimitInfo) -> list[str]:
    return [
        info.name,
        f"{info.limit} per {_span(info.per)}",
        _span(info.interval),
        "paused" if info.paused else "-",
        _when(info.updated_at),
    ]


_HEADERS = ["NAME", "LIMIT", "ONE TOKEN EVERY", "PAUSED", "UPDATED"]


@limits.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one array).")
@pass_config
def limits_list(cfg: CliConfig, as_json: bool) -> None:
    """List the stored rate limits, by name."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            stored = await engine.rate_limits.list()
        if as_json:
            click.echo(_dump([_limit_json(i) for i in stored]))
        elif not stored:
            click.echo("no rate limits stored")
        else:
            click.echo(_table(_HEADERS, [_row(i) for i in stored]))

    run(go(), cfg)


@limits.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_config
def limits_show(cfg: CliConfig, name: str, as_json: bool) -> None:
    """Show the rate limit NAME."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            info = await engine.rate_limits.get(name)
        if info is None:
            raise InputError(f"no rate limit {name!r} is stored; `umt limits list` shows them")
        click.echo(_dump(_limit_json(info)) if as_json else _table(_HEADERS, [_row(info)]))

    run(go(), cfg)


@limits.command("set")
@click.argument("name")
@click.option("--limit", type=int, required=True, help="Tokens per window (>= 1).")
@click.option(
    "--per", callback=_duration, required=True, metavar="DURATION", help="The window: 1s, 1m, 1h."
)
@pass_config
def limits_set(cfg: CliConfig, name: str, limit: int, per: timedelta) -> None:
    """Store the rate limit NAME, or change it: it holds at once on every worker (runs and
    steps waiting for a token ask again by the new rule; tokens taken stay taken)."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            info = await engine.rate_limits.set(name, limit=limit, per=per)
        click.echo(
            f"{info.name}: {info.limit} per {_span(info.per)} "
            f"(one token every {_span(info.interval)})" + (", paused" if info.paused else "")
        )

    run(go(), cfg)


@limits.command("pause")
@click.argument("name")
@pass_config
def limits_pause(cfg: CliConfig, name: str) -> None:
    """Pause the rate limit NAME: it gives no token until `umt limits resume`; runs and steps
    that need one wait, unharmed."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            changed = await engine.rate_limits.pause(name)
        click.echo(f"paused {name}" if changed else f"{name} was paused already")

    run(go(), cfg)


@limits.command("resume")
@click.argument("name")
@pass_config
def limits_resume(cfg: CliConfig, name: str) -> None:
    """Resume the rate limit NAME: the runs and steps it held take their tokens again."""

    async def go() -> None:
        async with open_engine(cfg) as engine:
            changed = await engine.rate_limits.resume(name)
        click.echo(f"resumed {name}" if changed else f"{name} was not paused; nothing to resume")

    run(go(), cfg)
