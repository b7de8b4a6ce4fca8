"""`umt check`: the deploy check, the recorded histories of live runs replayed against the code
about to ship (`umt_sdk.testing._deploy_check`; docs/versioning.md)."""

from __future__ import annotations

from pathlib import Path

import click

from umt_sdk._export import RunHistory
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

__all__: list[str] = []


def _task_filter(task: str | None) -> tuple[str | None, int | None]:
    if task is None or "@" not in task:
        return task, None
    name, _, version = task.partition("@")
    if not name or not version.isdigit() or int(version) < 1:
        raise InputError(f"--task takes NAME or NAME@VERSION (VERSION >= 1), got {task!r}")
    return name, int(version)


@cli.command("check")
@click.option(
    "--registry",
    "registry_ref",
    envvar="UMT_REGISTRY",
    required=True,
    metavar="MODULE:REGISTRY",
    help="The code about to ship: the Registry the live runs are replayed against "
    "(env UMT_REGISTRY).",
)
@click.option(
    "--against",
    metavar="URL|PATH",
    help="A database URL (its live runs are read), or a history file or a directory of "
    "*.jsonl files from `umt runs export`. Default: the database of --database-url / "
    "UMT_DATABASE_URL.",
)
@click.option("--task", metavar="TASK[@VERSION]", help="Only the runs of this task.")
@click.option(
    "--unpatched",
    "patch_id",
    metavar="PATCH",
    help="List the runs that still take the old branch of ctx.patched(PATCH), and exit 1 "
    "while there are any (0: the patch can become deprecate_patch).",
)
@pass_config
def check(
    cfg: CliConfig,
    registry_ref: str,
    against: str | None,
    task: str | None,
    patch_id: str | None,
) -> None:
    """Check a release against the live runs before deploying it: replay the recorded history
    of every pending, running and waiting run against MODULE:REGISTRY, with no side effects.

    Prints each run that would break: non-determinism (the diff of its recorded steps and
    what the code asks for now), a recorded step output that no longer decodes into the
    step's return type or decodes into another value (type drift), a task and version no
    longer registered. Exit 0 when every run replays, 1 when any would break, 2 when the
    command line or a history file is wrong. Usable in CI.
    """
    from umt_sdk.testing._deploy_check import (  # the test kits load only for this command
        check_deploy,
        live_histories,
        read_histories,
    )

    registry = load_registry(registry_ref)
    name, version = _task_filter(task)

    async def from_database(source: CliConfig) -> list[RunHistory]:
        async with open_engine(source) as engine:
            return await live_histories(engine, task_name=name, version=version)

    async def from_files(path: str) -> list[RunHistory]:
        return read_histories(path)  # under `run`: a bad file is one line, exit 2

    histories: list[RunHistory]
    if against is not None and Path(against).exists():
        histories = [
            h
            for h in run(from_files(against))
            if (name is None or h.task == name) and (version is None or h.version == version)
        ]
        where = against
    else:
        if against is not None and "://" not in against and "=" not in against:
            raise InputError(
                f"--against {against!r} is neither an existing history file or directory nor "
                "a database URL (such as postgresql://host/db)"
            )
        source = cfg if against is None else cfg.for_url(against)
        histories = run(from_database(source), source)
        where = source.where() or "the database"
    report = run(check_deploy(registry, histories))
    if patch_id is not None:
        still = report.unpatched(patch_id)
        for result in still:
            click.echo(f"unpatched run {result.run_id} ({result.task}@{result.version})")
        if still:
            raise CliError(
                f"{len(still)} of {len(report.results)} live run(s) in {where} still take the "
                f"old branch of patch {patch_id!r}: keep it"
            )
        click.echo(
            f"no live run of the {len(report.results)} in {where} takes the old branch of "
            f"patch {patch_id!r}: it can become ctx.deprecate_patch({patch_id!r})"
        )
        return
    for result in report.failures:
        click.echo(result.summary())
    if not report.ok:
        raise CliError(report.summary())
    click.echo(report.summary())
