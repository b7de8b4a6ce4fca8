"""The `umt` command line's frame: the root group, its configuration, errors and redaction.

Every command that needs a database takes it from `--database-url` / `UMT_DATABASE_URL`; with
neither, a backend plugin may offer a default (the Postgres backend: its embedded server in
`.umt/pg`). Backends add their own commands and global options (`umt_cli_add_commands`) and
say how to reach and check their storage (`umt_cli_backend`); this package never imports one.

Exit codes: 0 done; 1 the operation failed (database unreachable, schema missing, no such run
or task, ...); 2 the command line is wrong (a bad option, invalid JSON, an input field that does
not fit the task's input type). Errors are one line on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import re
import shlex
import sys
import traceback
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, get_args
from urllib.parse import unquote, urlsplit, urlunsplit
from uuid import UUID

import click

from umt_sdk import _serde
from umt_sdk._codec import PayloadCodec, check_codec
from umt_sdk._codec_backend import MaskingBackend, mask_backend
from umt_sdk._engine import Engine, connect
from umt_sdk._hookspecs import CliBackend
from umt_sdk._plugins import PluginHost
from umt_sdk._spi import RunStatus
from umt_sdk._task import Registry
from umt_sdk.cli._render import _shorten
from umt_sdk.exceptions import (
    IdempotencyConflictError,
    PayloadError,
    RunNotFoundError,
    UmtError,
    UnknownTaskError,
    UsageError,
)

__all__ = [
    "CliConfig",
    "CliError",
    "InputError",
    "cli",
    "load_codec",
    "open_engine",
    "parse_duration",
    "pass_config",
    "redact_url",
    "run",
    "typed_command",
]

T = TypeVar("T")

_STATUSES = get_args(RunStatus)
_HOW_TO_GET_A_DATABASE = (
    "Set UMT_DATABASE_URL (or --database-url) to the engine's database, e.g. "
    "postgresql://user:password@host:5432/db"
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
    """`500ms`, `10s`, `2m`, `1h`, `1d`; a bare number is seconds (else `UsageError`)."""
    match = _DURATION.match(text)
    if match is None:
        raise UsageError(
            f"expected a duration such as 500ms, 10s, 2m or 1h, got {text!r}", argument="text"
        )
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


class _Plain:
    """The CLI view of a backend whose plugin says nothing: no checks, no options."""

    def where(self) -> str:
        return ""

    def connect_options(self, *, worker: bool, concurrency: int) -> dict[str, Any]:
        return {}

    async def preflight(self, *, need_schema: bool) -> None:
        return None


class CliConfig:
    """What the root group was given: the database URL and the backends' global options."""

    def __init__(
        self,
        database_url: str | None,
        options: dict[str, Any],
        plugins: PluginHost,
        *,
        codec: str | None = None,
    ) -> None:
        self._url = database_url
        self._codec_ref = codec
        self._codec: PayloadCodec | None = None
        self.options = options
        """The values of the global options backends added (`--schema`, ...), by name."""
        self._plugins = plugins
        self._backend: CliBackend | None = None
        self.secrets = _secrets(database_url)
        """The passwords in the given URL: scrubbed from anything the command prints."""

    def for_url(self, url: str) -> CliConfig:
        """The same options (global `--schema`, `--codec`, ...) for another database."""
        return CliConfig(url, self.options, self._plugins, codec=self._codec_ref)

    def url(self) -> str:
        """The database URL: the option or env, else a backend's default (or a clear error)."""
        if self._url:
            return self._url
        url = self._plugins.cli_default_url(self.options)
        if url is None:
            raise CliError(f"no database given. {_HOW_TO_GET_A_DATABASE}")
        self._url = url
        return url

    def backend(self) -> CliBackend:
        """The CLI view of the backend serving `url()`."""
        if self._backend is None:
            found = self._plugins.cli_backend(self.url(), self.options)
            self._backend = found if found is not None else _Plain()
        return self._backend

    def where(self) -> str:
        return self.backend().where()

    def codec(self) -> PayloadCodec | None:
        """The payload codec `--codec` / `UMT_CODEC` names (made once), or None."""
        if self._codec is None and self._codec_ref:
            self._codec = load_codec(self._codec_ref)
        return self._codec


_PASSWORD_PARAM = re.compile(
    r"(?P<key>password\s*=\s*)(?P<value>'(?:[^'\\]|\\.)*'|[^\s&;]*)", re.IGNORECASE
)
"""`password=...` in a query string (`?password=x&...`) or a keyword DSN (`password='x y'`)."""


def redact_url(url: str) -> str:
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


def typed_command(ctx: click.Context, *words: str) -> tuple[str, bool]:
    """`umt WORDS` as a command to type again (a hint): with the global options this command
    was given on its command line (`--schema`, ...), shell-quoted. A `--database-url` holding a
    password is left out (never printed): the second value says so, and the hint must say
    that it needs it."""
    root = ctx.find_root()
    parts = ["umt"]
    left_out = False
    for param in root.command.params:
        name = param.name
        if not isinstance(param, click.Option) or name is None:
            continue
        if root.get_parameter_source(name) is not click.core.ParameterSource.COMMANDLINE:
            continue  # a default, or the environment, which the typed command also gets
        value = root.params.get(name)
        if param.is_flag:
            parts += [param.opts[0]] if value else []
        elif value is not None:
            if name == "database_url" and _secrets(str(value)):
                left_out = True
                continue
            parts += [param.opts[0], str(value)]
    return shlex.join([*parts, *words]), left_out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.asynccontextmanager
async def open_engine(
    cfg: CliConfig,
    registry: Registry | None = None,
    *,
    worker: bool = False,
    concurrency: int = 1,
    meter_provider: Any = None,
) -> AsyncIterator[Engine]:
    """The engine of `cfg`, checked first by its backend (one clear line if it cannot be
    reached or has no tables), closed on exit. `meter_provider`: where its OpenTelemetry
    metrics go (the global provider by default)."""
    backend = cfg.backend()
    codec = cfg.codec()
    await backend.preflight(need_schema=True)
    options = backend.connect_options(worker=worker, concurrency=concurrency)
    engine = await connect(
        cfg.url(), registry=registry, codec=codec, meter_provider=meter_provider, **options
    )
    masked: MaskingBackend | None = None
    if codec is None and not worker:
        # Without the codec a reader shows "<encrypted: NAME>" where a payload is sealed,
        # never the ciphertext; a worker gets no such stand-ins (it hands such runs back).
        masked = mask_backend(engine.backend)
        engine = Engine(masked, engine.registry, telemetry=engine.telemetry)
    try:
        yield engine
    finally:
        await engine.close()
        if masked is not None and masked.masked:
            names = ", ".join(sorted(masked.masked))
            click.echo(
                f"note: some payloads are encrypted (codec {names}); pass --codec "
                "MODULE:FACTORY or set UMT_CODEC to read them",
                err=True,
            )


@contextlib.contextmanager
def _translated(where: str = "") -> Iterator[None]:
    """Turn umt's errors into one line and the right exit code."""
    try:
        yield
    except click.ClickException:
        raise
    except PayloadError as exc:
        raise InputError(str(exc)) from exc
    except RunNotFoundError as exc:
        raise CliError(f"{exc} in {where}" if where else str(exc)) from exc
    except (UnknownTaskError, IdempotencyConflictError) as exc:
        raise CliError(str(exc)) from exc
    except UsageError as exc:  # TaskDefinitionError and NotInTaskError included: fix the call
        raise InputError(str(exc)) from exc
    except UmtError as exc:  # BackendError, FencingError and the rest: the operation failed
        raise CliError(_first_line(exc)) from exc


def run(coro: Coroutine[Any, Any, T], cfg: CliConfig | None = None) -> T:
    """Run a command's coroutine; umt's errors become one line and the right exit code."""
    try:
        with _translated(cfg.where() if cfg is not None else ""):
            return asyncio.run(coro)
    finally:
        coro.close()  # not started when an error came first: never left "never awaited"


def load_codec(ref: str) -> PayloadCodec:
    """The payload codec at `module:attribute`: a codec, or a factory called with no
    arguments that returns one (it reads its keys from where your services do)."""
    obj = _import_attribute(ref, "codec", "app.codecs:make_codec")
    if not isinstance(obj, PayloadCodec) and callable(obj):
        try:
            obj = obj()
        except Exception as exc:
            raise CliError(
                f"--codec {ref}: the factory failed: {type(exc).__name__}: {exc}"
            ) from exc
    try:
        check_codec(obj, "--codec", where=f"--codec {ref}")
    except UsageError as exc:
        raise InputError(str(exc)) from None
    codec: PayloadCodec = obj
    return codec


def _import_attribute(ref: str, what: str, example: str) -> Any:
    """The object at `module:attribute`, importing from the current directory too."""
    module_name, sep, attribute = ref.partition(":")
    if not sep or not module_name or not attribute:
        raise InputError(f"expected the {what} as module:attribute such as {example}, got {ref!r}")
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
    return obj


def load_registry(ref: str) -> Registry:
    """The `Registry` at `module:attribute`, importing from the current directory too."""
    obj = _import_attribute(ref, "registry", "app.tasks:registry")
    if not isinstance(obj, Registry):
        raise CliError(
            f"{ref} is a {type(obj).__name__}, not a umt Registry; point at an object made with "
            "Registry([task_a, task_b])"
        )
    return obj


# -- the root group -------------------------------------------------------------------------------


class _Cli(click.Group):
    """The `umt` group: whatever a command raises ends as one line on stderr, never a
    traceback (`UMT_DEBUG=1` adds the traceback for an unexpected error), and no password of
    the database URL ever reaches the terminal, whichever message carries it. Backend plugins
    add their commands and options the first time the group is used."""

    plugins: PluginHost | None = None

    def host(self) -> PluginHost:
        if self.plugins is None:
            self.plugins = PluginHost()
            self.plugins.cli_add_commands(self)
        return self.plugins

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        self.host()
        return super().make_context(info_name, args, parent, **extra)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self.host()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self.host()
        return super().get_command(ctx, cmd_name)

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
    cfg = ctx.find_object(CliConfig)
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
    help="The engine's database (env UMT_DATABASE_URL). Without it: the default a backend "
    "offers (the Postgres backend's embedded server in .umt/pg; `umt db start` keeps one running).",
)
@click.option(
    "--codec",
    envvar="UMT_CODEC",
    metavar="MODULE:FACTORY",
    help="The payload codec your engine connects with (env UMT_CODEC): a PayloadCodec, or a "
    "function returning one, such as app.codecs:make_codec. Without it, encrypted payloads "
    "show as <encrypted: NAME>.",
)
@click.version_option(package_name="umt-tasks", prog_name="umt")
@click.pass_context
def cli(
    ctx: click.Context, /, database_url: str | None, codec: str | None, **backend_options: Any
) -> None:
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
    assert isinstance(ctx.command, _Cli)
    ctx.obj = CliConfig(database_url, backend_options, ctx.command.host(), codec=codec)


pass_config = click.make_pass_decorator(CliConfig)
"""Hands a command the `CliConfig` of the root group (as its first argument)."""
