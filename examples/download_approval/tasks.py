"""The application's tasks, in two releases.

Release 1 registers `download_plan@1`; release 2 adds `download_plan@2` (a new `verify` step
before the asset is recorded: an incompatible change, so a new version) and keeps @1
registered until its runs drain. `describe_asset@1` is the "agent" group's task, started by
the `asset.recorded` outbox event that `record-asset` writes in its commit.

Release 2 also adds `nightly_downloads@1` and its schedule (02:00, Paris time): it takes the
plans deferred to the night and fans out one `download_plan@2` child per plan with
`ctx.step.map` (at most `max_concurrency` downloads at once), woken once when all are done.
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import fake_client
import psycopg
from psycopg import sql

from umt_backend_pg import insert_outbox_event
from umt_sdk import (
    AttemptInfo,
    ChildCanceledError,
    ChildFailedError,
    Registry,
    RetryPolicy,
    Schedule,
    TaskContext,
    TaskDefinition,
    task,
    with_attempt_token,
)

CHUNK = 256 * 1024
_SETTINGS: dict[str, Any] = {}


def configure(url: str, schema: str, data: Path) -> None:
    """Where the business tables and files are (set by the worker process)."""
    _SETTINGS.update(url=url, schema=schema, data=data)


def _q(text: str) -> sql.Composed:
    return sql.SQL(text).format(s=sql.Identifier(_SETTINGS["schema"]))


async def _fetchone(query: str, *params: Any) -> tuple[Any, ...] | None:
    async with await psycopg.AsyncConnection.connect(_SETTINGS["url"], autocommit=True) as conn:
        cur = await conn.execute(_q(query), params)
        return await cur.fetchone()


@attrs.frozen
class PlanInput:
    plan_id: str


@attrs.frozen
class Plan:
    plan_id: str
    url: str
    size: int


@attrs.frozen
class AssetInput:
    asset_id: str


@attrs.frozen
class NightInput:
    max_concurrency: int = 2
    """How many of the night's downloads run at once (the client's bandwidth)."""


# -- steps -------------------------------------------------------------------------------------


async def load_plan(plan_id: str, run_id: str) -> Plan:
    """Read the plan and note which run carries it (for the operator's signal).

    The status only moves forward: a worker cut off from Postgres may have sent this write
    before its lease lapsed, and it can land after another worker took the run over and went
    on (to `done`, even). Unfenced writes must be idempotent *and* never move state back."""
    row = await _fetchone(
        "UPDATE {s}.plans SET run_id = %s, status = CASE WHEN status IN ('planned', 'scheduled')"
        " THEN 'awaiting approval' ELSE status END WHERE id = %s RETURNING url, size",
        run_id,
        plan_id,
    )
    if row is None:
        raise LookupError(f"no plan {plan_id}")
    return Plan(plan_id=plan_id, url=row[0], size=row[1])


async def submit(plan: Plan) -> int:
    """Hand the download to the client, exactly once (fenced, reconciled on resume)."""
    op_key = f"submit:{plan.plan_id}"

    async def call_client(info: AttemptInfo) -> int:
        if info.resumed:  # an earlier attempt began: did the client get it?
            existing = await fake_client.find(_SETTINGS["url"], _SETTINGS["schema"], tag=op_key)
            if existing is not None:
                return existing
        return await fake_client.add(
            _SETTINGS["url"],
            _SETTINGS["schema"],
            source=plan.url,
            size=plan.size,
            tag=op_key,
            token=info.attempt_token,
        )

    async def record(tx: Any, job_id: int) -> None:
        await tx.execute(
            _q("INSERT INTO {s}.downloads (plan_id, job_id) VALUES (%s, %s)"),
            (plan.plan_id, job_id),
        )
        await tx.execute(
            _q("UPDATE {s}.plans SET status = 'downloading' WHERE id = %s"), (plan.plan_id,)
        )

    async with await psycopg.AsyncConnection.connect(_SETTINGS["url"], autocommit=True) as conn:
        return await with_attempt_token(conn, op_key, call_client, commit=record)


async def copy(ctx: TaskContext[PlanInput], source: str, target: str) -> int:
    """Copy the downloaded file into the library, chunk by chunk, honouring cancel."""
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    copied = 0
    with open(source, "rb") as src, open(target, "wb") as dst:  # noqa: ASYNC230 - small chunks
        while chunk := src.read(CHUNK):
            ctx.throw_if_canceled()
            dst.write(chunk)
            copied += len(chunk)
            await asyncio.sleep(0)  # a real copy would yield to the loop between chunks
    return copied


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


async def record_asset(plan_id: str, path: str, size: int, digest: str | None, version: int) -> str:
    """The asset row, the plan's status and the `asset.recorded` event: one transaction."""
    op_key = f"asset:{plan_id}"

    def name(info: AttemptInfo) -> str:
        return f"asset-{plan_id}"

    async def record(tx: Any, asset_id: str) -> None:
        await tx.execute(
            _q(
                "INSERT INTO {s}.assets (id, plan_id, path, size, sha256, version)"
                " VALUES (%s, %s, %s, %s, %s, %s)"
            ),
            (asset_id, plan_id, path, size, digest, version),
        )
        await tx.execute(_q("UPDATE {s}.plans SET status = 'done' WHERE id = %s"), (plan_id,))
        await insert_outbox_event(
            tx, "asset.recorded", {"asset_id": asset_id}, schema=_SETTINGS["schema"]
        )

    async with await psycopg.AsyncConnection.connect(_SETTINGS["url"], autocommit=True) as conn:
        return await with_attempt_token(conn, op_key, name, commit=record)


# -- the task, in two versions ----------------------------------------------------------------


async def _flow(ctx: TaskContext[PlanInput], *, verify: bool) -> str:
    plan_id = ctx.input.plan_id
    plan = await ctx.step.run("load-plan", load_plan, plan_id, str(ctx.run_id))

    async def approved() -> dict[str, str] | None:
        row = await _fetchone("SELECT approved_by FROM {s}.plans WHERE id = %s", plan_id)
        return {"by": row[0]} if row and row[0] else None

    approval: dict[str, str] = await ctx.step.wait_for_fact(
        "approved", check=approved, timeout=timedelta(days=2), poll_interval=timedelta(seconds=5)
    )
    ctx.logger.info("plan %s approved by %s", plan_id, approval["by"])
    await ctx.step.run("submit", submit, plan)

    async def downloaded() -> dict[str, str] | None:
        row = await _fetchone(
            "SELECT path FROM {s}.downloads WHERE plan_id = %s AND status = 'done'", plan_id
        )
        return {"path": row[0]} if row else None

    done: dict[str, str] = await ctx.step.wait_for_fact(
        "downloaded",
        check=downloaded,
        timeout=timedelta(days=1),
        poll_interval=timedelta(seconds=1),
    )
    target = str(_SETTINGS["data"] / "library" / f"{plan_id}.bin")
    size = await ctx.step.run("copy", copy, ctx, done["path"], target)
    digest = await ctx.step.run("verify", sha256, target) if verify else None
    return await ctx.step.run(
        "record-asset", record_asset, plan_id, target, size, digest, ctx.task_version
    )


@task("download_plan", version=1, retry=RetryPolicy.network())
async def download_plan_v1(ctx: TaskContext[PlanInput]) -> str:
    return await _flow(ctx, verify=False)


@task("download_plan", version=2, retry=RetryPolicy.network())
async def download_plan_v2(ctx: TaskContext[PlanInput]) -> str:
    return await _flow(ctx, verify=True)


@task("describe_asset", version=1, retry=RetryPolicy.network())
async def describe_asset(ctx: TaskContext[AssetInput]) -> str:
    async def describe() -> str:
        row = await _fetchone(
            "UPDATE {s}.assets SET description = size || ' bytes, ' || CASE WHEN sha256 IS NULL"
            " THEN 'not verified' ELSE 'sha256 ' || left(sha256, 12) END"
            " WHERE id = %s RETURNING description",
            ctx.input.asset_id,
        )
        if row is None:
            raise LookupError(f"no asset {ctx.input.asset_id}")
        return str(row[0])

    return await ctx.step.run("describe", describe)


# -- the nightly fan-out (release 2) ----------------------------------------------------------


async def take_deferred_plans(night_run: str) -> list[str]:
    """The plans deferred to the night, taken by this night's run: marked with its id, so the
    step that runs again after a crash takes the same ones, and a second night none of them."""
    async with await psycopg.AsyncConnection.connect(_SETTINGS["url"], autocommit=True) as conn:
        cur = await conn.execute(
            _q(
                "UPDATE {s}.plans SET status = 'scheduled', night_run = %s"
                " WHERE status = 'deferred' OR (status = 'scheduled' AND night_run = %s)"
                " RETURNING id"
            ),
            (night_run, night_run),
        )
        return sorted(row[0] for row in await cur.fetchall())


@task("nightly_downloads", version=1, retry=RetryPolicy.network())
async def nightly_downloads(ctx: TaskContext[NightInput]) -> dict[str, str]:
    """One `download_plan@2` child per deferred plan; what each one ended with, by plan."""
    plan_ids = await ctx.step.run("take-deferred-plans", take_deferred_plans, str(ctx.run_id))
    outcomes = await ctx.step.map(
        "download",
        download_plan_v2,
        [PlanInput(plan_id=plan_id) for plan_id in plan_ids],
        max_concurrency=ctx.input.max_concurrency,
        return_exceptions=True,
    )
    said: dict[str, str] = {}
    for plan_id, outcome in zip(plan_ids, outcomes, strict=True):
        if isinstance(outcome, ChildFailedError):
            said[plan_id] = f"failed: {outcome.error_message}"
        elif isinstance(outcome, ChildCanceledError):
            said[plan_id] = f"canceled: {outcome.reason}"
        else:
            said[plan_id] = outcome
    return said


NIGHTLY = Schedule(
    name="nightly_downloads",
    task=nightly_downloads,
    cron="0 2 * * *",
    input=NightInput(),
    timezone="Europe/Paris",
)


# -- releases --------------------------------------------------------------------------------


def newest(release: int) -> TaskDefinition[PlanInput, str]:
    return download_plan_v1 if release == 1 else download_plan_v2


def registry(release: int) -> Registry:
    if release == 1:
        return Registry([download_plan_v1, describe_asset])
    return Registry(
        [download_plan_v1, download_plan_v2, describe_asset, nightly_downloads],
        schedules=[NIGHTLY],
    )


def groups(release: int) -> dict[str, list[str]]:
    """Workers are split by `versions`: file and network work in `io`, the agent apart."""
    io = (
        ["download_plan@1"]
        if release == 1
        else ["download_plan@1", "download_plan@2", "nightly_downloads@1"]
    )
    return {"io": io, "agent": ["describe_asset@1"]}


def routes(release: int) -> dict[str, Any]:
    """Outbox event type -> task (or task and mapper)."""
    return {
        "plan.created": (newest(release), lambda p: PlanInput(plan_id=p["plan_id"])),
        "asset.recorded": describe_asset,
    }
