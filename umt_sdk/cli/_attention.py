"""`umt runs settle`: say what happened to a step whose outcome was unknown, for a run in
`needs_attention` (docs/writing-tasks.md#outcomes-an-operator-settles)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any
from uuid import UUID

import click

from umt_sdk.cli._app import CliConfig, InputError, _run_id, open_engine, pass_config, run
from umt_sdk.cli._commands import runs

__all__: list[str] = []


def _output(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(
            f"expected JSON (the step's output), got {value!r}: {exc}"
        ) from None


@runs.command("settle")
@click.argument("run_id", callback=_run_id, metavar="RUN")
@click.option("--step", "step_name", required=True, metavar="STEP", help="The step to settle.")
@click.option(
    "--as",
    "outcome",
    required=True,
    type=click.Choice(["done", "not-done"]),
    help="done: the step's work happened (give --output); not-done: it did not (it runs again).",
)
@click.option(
    "--output",
    callback=_output,
    metavar="JSON",
    help="With --as done: the step's output, as JSON of its output type.",
)
@click.option(
    "--by",
    metavar="NAME",
    help="Who settles it, kept in the run's history (default: your OS user name).",
)
@pass_config
def runs_settle(
    cfg: CliConfig, run_id: UUID, step_name: str, outcome: str, output: Any, by: str | None
) -> None:
    """Settle STEP of RUN, a run in needs_attention: its outcome was unknown (it failed as its
    uncertain_on declares). The run goes on at once; it is settled once.

    The output is checked against the step's output type, imported from the current directory
    as the worker does: run this where your task modules import.
    """
    done = outcome == "done"
    if done and output is None:
        raise InputError("--as done needs --output JSON: the step's output (null for None)")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)

    async def go() -> None:
        async with open_engine(cfg) as engine:
            settlement = await engine.settle(
                run_id, step=step_name, done=done, output=output, by=by
            )
        what = "done" if settlement.done else "not done (it runs again)"
        click.echo(
            f"settled step {settlement.step_name!r} of run {run_id} as {what}, by {settlement.by}"
        )

    run(go(), cfg)
