"""`umt dashboard`: serve the web dashboard (umt_sdk.dashboard) against the configured database.

It binds 127.0.0.1 unless told otherwise. On any other address it refuses to start without an
access token (`UMT_DASHBOARD_TOKEN`), or without `--read-only` and an explicit `--no-auth`: a
dashboard on the network that anyone can act through is never a default.
"""

from __future__ import annotations

import os

import click

from umt_sdk.cli._app import (
    CliConfig,
    CliError,
    InputError,
    cli,
    load_registry,
    open_engine,
    pass_config,
    run,
)

__all__ = ["CALLBACK_SECRET_VARIABLE", "TOKEN_VARIABLE", "callback_secrets", "check_exposure"]

TOKEN_VARIABLE = "UMT_DASHBOARD_TOKEN"
CALLBACK_SECRET_VARIABLE = "UMT_CALLBACK_SECRET"


def _is_loopback(host: str) -> bool:
    return host in {"127.0.0.1", "::1", "localhost"} or host.startswith("127.")


def check_exposure(*, host: str, token: str | None, read_only: bool, no_auth: bool) -> None:
    """Refuse (`InputError`) to serve on a non-loopback `host` without a token, unless the
    dashboard is read-only and `--no-auth` says so on purpose."""
    if no_auth and token:
        raise InputError(
            f"--no-auth and {TOKEN_VARIABLE} contradict each other: unset the variable, or "
            "drop --no-auth"
        )
    if _is_loopback(host) or token:
        return
    if no_auth and read_only:
        return
    if no_auth:
        raise InputError(
            f"--no-auth on {host} needs --read-only: anyone who reaches it could cancel runs "
            f"and enqueue new ones. Set {TOKEN_VARIABLE} instead to keep the actions"
        )
    raise InputError(
        f"refusing to serve the dashboard on {host} without an access token: set "
        f"{TOKEN_VARIABLE} (at least 8 characters; every visitor must type it), or pass "
        "--read-only --no-auth to show it to anyone who can reach the port, or bind 127.0.0.1"
    )


def callback_secrets(value: str | None, *, read_only: bool) -> list[str] | None:
    """The callback endpoint's secrets from `UMT_CALLBACK_SECRET` (comma-separated during a
    rotation), or None: no endpoint. `InputError` for a short secret or with --read-only."""
    if not value:
        return None
    secrets = [part.strip() for part in value.split(",")]
    if any(len(part) < 32 for part in secrets):
        raise InputError(
            f"{CALLBACK_SECRET_VARIABLE} needs secrets of at least 32 characters each "
            "(comma-separated during a rotation), such as the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    if read_only:
        raise InputError(
            f"--read-only and {CALLBACK_SECRET_VARIABLE} contradict each other: a read-only "
            "dashboard changes nothing, and the callback endpoint completes callbacks"
        )
    return secrets


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--read-only", is_flag=True, help="Show only: no cancel, fact, rerun, enqueue or pause."
)
@click.option(
    "--no-auth",
    is_flag=True,
    help="With --read-only, serve a non-loopback --host without an access token, on purpose.",
)
@click.option(
    "--registry",
    "registry_ref",
    metavar="MODULE:REGISTRY",
    help="Your tasks' Registry (app.tasks:registry): the enqueue forms and the tasks page "
    "read the input types from it.",
)
@click.option(
    "--trace-url",
    metavar="TEMPLATE",
    envvar="UMT_DASHBOARD_TRACE_URL",
    help="Your tracing UI's URL with {trace_id} in it (env UMT_DASHBOARD_TRACE_URL), such as "
    "http://localhost:16686/trace/{trace_id}: trace ids become links.",
)
@pass_config
def dashboard(
    cfg: CliConfig,
    host: str,
    port: int,
    read_only: bool,
    no_auth: bool,
    registry_ref: str | None,
    trace_url: str | None,
) -> None:
    """Serve the web dashboard (runs, timelines, tasks, workers; cancel, facts, enqueue).

    Binds 127.0.0.1:8765 by default. On another --host it needs UMT_DASHBOARD_TOKEN (typed
    once on its login page), or --read-only --no-auth. With UMT_CALLBACK_SECRET set it also
    serves POST /callbacks/complete, which completes callback tokens for requests signed with
    that secret. Needs the dashboard extra: pip install 'umt-tasks[dashboard]'.
    """
    token = os.environ.get(TOKEN_VARIABLE) or None
    check_exposure(host=host, token=token, read_only=read_only, no_auth=no_auth)
    if token is not None and len(token) < 8:
        raise InputError(f"{TOKEN_VARIABLE} needs at least 8 characters")
    secrets = callback_secrets(os.environ.get(CALLBACK_SECRET_VARIABLE), read_only=read_only)
    try:
        import uvicorn
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider

        from umt_sdk.dashboard import create_app
    except ImportError as exc:
        raise CliError(
            f"the dashboard needs its extra ({exc.name} is missing): "
            "pip install 'umt-tasks[dashboard]'"
        ) from None
    registry = load_registry(registry_ref) if registry_ref else None

    # The engine's own OpenTelemetry metrics (enqueues, cancels from this dashboard) go to the
    # process's Prometheus registry, which /metrics serves after the store's gauges.
    meters = MeterProvider(metric_readers=[PrometheusMetricReader()])

    async def serve() -> None:
        async with open_engine(cfg, registry, meter_provider=meters) as engine:
            app = create_app(
                engine,
                read_only=read_only,
                token=token,
                trace_url_template=trace_url,
                callback_secret=secrets,
            )
            config = uvicorn.Config(
                app, host=host, port=port, log_level="warning", lifespan="off", access_log=False
            )
            server = uvicorn.Server(config)
            shown = f"[{host}]" if ":" in host else host
            mode = " (read-only)" if read_only else ""
            mode += " (callbacks: POST /callbacks/complete)" if secrets else ""
            where = f" ({cfg.where()})" if cfg.where() else ""
            click.echo(f"umt dashboard on http://{shown}:{port}/{mode}{where}", nl=True)
            await server.serve()

    try:
        run(serve(), cfg)
    except KeyboardInterrupt:  # uvicorn stops on Ctrl-C, then raises the signal again
        click.echo("umt dashboard stopped")
    finally:
        meters.shutdown()
