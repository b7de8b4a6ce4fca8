"""The `umt` command line, and what a backend plugin uses to add its own commands to it.

A backend implements `umt_cli_add_commands` (its commands and global options),
`umt_cli_backend` (a `CliBackend`: how to check and connect to a URL it serves) and, if it has
one, `umt_cli_default_url`. Its commands take the root group's `CliConfig` with `pass_config`
and run their coroutines with `run` (umt's errors become one line and the right exit code);
`CliError` and `InputError` end a command with one line and exit 1 or 2.
"""

from umt_sdk._hookspecs import CliBackend
from umt_sdk.cli import (
    _attention,  # noqa: F401  (registers `umt runs settle`)
    _check,  # noqa: F401  (registers `umt check`)
    _commands,  # noqa: F401  (registers the commands on `cli`)
    _dashboard,  # noqa: F401  (registers `umt dashboard`; its extra is imported when it runs)
    _events,  # noqa: F401  (registers `umt events publish|list`)
    _lifecycle,  # noqa: F401  (registers `umt tasks ...`, `umt runs rerun|fork`)
    _limits,  # noqa: F401  (registers `umt limits ...`)
    _schedules,  # noqa: F401  (registers `umt schedules ...`)
)
from umt_sdk.cli._app import (
    CliConfig,
    CliError,
    InputError,
    cli,
    open_engine,
    parse_duration,
    pass_config,
    redact_url,
    run,
)

__all__ = [
    "CliBackend",
    "CliConfig",
    "CliError",
    "InputError",
    "cli",
    "main",
    "open_engine",
    "parse_duration",
    "pass_config",
    "redact_url",
    "run",
]


def main(argv: list[str] | None = None) -> None:
    """The `umt` console script."""
    cli.main(args=argv, prog_name="umt")
