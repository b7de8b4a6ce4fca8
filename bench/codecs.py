"""What a payload codec costs per run: client CPU, bytes stored, WAL written.

Every stored payload passes through the codec (`connect(..., codec=...)`), so its cost is
client CPU per payload (seal on write, open on read) and, the other way, fewer bytes in the
database when it compresses. This drains the same runs (N runs of S steps, each payload a
realistic JSON document of about B bytes) with no codec, zlib, AES-GCM and zlib then AES-GCM,
on a fresh schema each, and reports per run: client CPU (process time of enqueue and drain),
bytes the payloads occupy in Postgres (`pg_column_size` of inputs, outputs and step outputs),
WAL bytes, and runs/s (reported, never judged). Then, without a database, the cost of one seal
and one open by payload size.

    python -m bench.codecs [--database-url URL] [--runs 500] [--steps 3] [--payload-bytes 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import timeit
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql

from bench._infra import Server, with_dbname
from umt_backend_pg import migrate
from umt_sdk import (
    AesGcmCodec,
    CodecChain,
    PayloadCodec,
    Registry,
    TaskContext,
    ZlibCodec,
    connect,
    task,
)
from umt_sdk.backend import open_json, seal_json

DB = "bench_codecs"
KEY = bytes(range(32))
WORDS = (
    "patient visit clinic nurse doctor allergy penicillin fever cough rest follow-up invoice",
    "order customer address street city postcode amount currency status shipped",
)
_VOCABULARY = " ".join(WORDS).split(" ")


def codecs() -> dict[str, PayloadCodec | None]:
    return {
        "none": None,
        "zlib": ZlibCodec(),
        "aes-gcm": AesGcmCodec(keys={"k1": KEY}, current="k1"),
        "zlib+aes-gcm": CodecChain(ZlibCodec(), AesGcmCodec(keys={"k1": KEY}, current="k1")),
    }


def document(size: int, seed: int) -> dict[str, Any]:
    """A JSON document of about `size` bytes, shaped like business data."""
    rng = random.Random(seed)
    doc: dict[str, Any] = {"id": seed, "items": []}
    while len(json.dumps(doc)) < size:
        doc["items"].append(
            {
                "name": " ".join(rng.choices(_VOCABULARY, k=3)),
                "qty": rng.randint(1, 9),
                "price": round(rng.uniform(1, 500), 2),
            }
        )
    return doc


_SIZE: dict[str, int] = {}


@task("bench.codec", version=1)
async def codec_run(ctx: TaskContext[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in range(_SIZE["steps"]):
        out = await ctx.step.run(f"s{n}", document, _SIZE["bytes"], n)
    return out


async def _one_pass(url: str, name: str, codec: PayloadCodec | None, args: Any) -> dict[str, Any]:
    schema = f"codec_{name.replace('+', '_').replace('-', '_')}"
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
        )
    await migrate(url, schema=schema)
    engine = await connect(
        url, registry=Registry([codec_run]), schema=schema, run_migrations=False, codec=codec
    )
    inputs = [document(args.payload_bytes, 1000 + i) for i in range(args.runs)]
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        wal0 = (await (await conn.execute("SELECT pg_current_wal_lsn()")).fetchone() or [""])[0]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        handles = [await engine.enqueue(codec_run, doc) for doc in inputs]
        async with engine.worker(concurrency=16, lease=timedelta(seconds=30), schedules=False):
            await engine.wait_idle([h.run_id for h in handles], timeout=600)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        wal = (
            await (
                await conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (wal0,))
            ).fetchone()
            or [0]
        )[0]
        stored = (
            await (
                await conn.execute(
                    sql.SQL(
                        "SELECT (SELECT sum(pg_column_size(input)"
                        " + coalesce(pg_column_size(output), 0)) FROM {s}.runs)"
                        " + (SELECT coalesce(sum(pg_column_size(output)), 0)"
                        " FROM {s}.steps)"
                    ).format(s=sql.Identifier(schema))
                )
            ).fetchone()
            or [0]
        )[0]
        await engine.close()
        await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    return {
        "client_cpu_ms_per_run": cpu * 1000 / args.runs,
        "payload_bytes_per_run": int(stored) / args.runs,
        "wal_bytes_per_run": float(wal) / args.runs,
        "runs_per_s": args.runs / wall,
    }


def _micro() -> dict[str, dict[str, float]]:
    """Microseconds per seal + open of one payload, by codec and size."""
    out: dict[str, dict[str, float]] = {}
    for name, codec in codecs().items():
        if codec is None:
            continue
        row = {}
        for size in (100, 1024, 16 * 1024):
            text = json.dumps(document(size, size))
            number = 2000 if size < 16 * 1024 else 300
            seconds = timeit.timeit(
                lambda c=codec, t=text: open_json(c, seal_json(c, t)), number=number
            )
            row[f"{size}B"] = seconds / number * 1e6
        out[name] = row
    return out


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    _SIZE.update(steps=args.steps, bytes=args.payload_bytes)
    server = Server.start(args.database_url)
    with server.connect() as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB}")
        admin.execute(f"CREATE DATABASE {DB}")
    url = with_dbname(server.admin_url, DB)
    out: dict[str, Any] = {
        "runs": args.runs,
        "steps": args.steps,
        "payload_bytes": args.payload_bytes,
    }
    try:
        passes: dict[str, list[dict[str, Any]]] = {name: [] for name in codecs()}
        for _ in range(args.reps):
            for name, codec in codecs().items():  # interleaved: drift hits every codec alike
                passes[name].append(await _one_pass(url, name, codec, args))
        per_run: dict[str, dict[str, float]] = {}
        for name, runs in passes.items():
            per_run[name] = {key: statistics.median(p[key] for p in runs) for key in runs[0]}
        base = per_run["none"]
        for name, row in per_run.items():
            row["extra_cpu_ms_per_run"] = (
                row["client_cpu_ms_per_run"] - base["client_cpu_ms_per_run"]
            )
            row["bytes_vs_none"] = row["payload_bytes_per_run"] / base["payload_bytes_per_run"]
            print(
                f"{name:>13}: client CPU {row['client_cpu_ms_per_run']:6.2f} ms/run "
                f"({row['extra_cpu_ms_per_run']:+.2f}), "
                f"payloads {row['payload_bytes_per_run']:8.0f} B/run "
                f"(x{row['bytes_vs_none']:.2f}), WAL {row['wal_bytes_per_run']:8.0f} B/run, "
                f"{row['runs_per_s']:6.0f} runs/s",
                flush=True,
            )
        out["per_run"] = per_run
        out["passes"] = passes
    finally:
        server.drop_db(DB)
    out["seal_open_us"] = _micro()
    for name, row in out["seal_open_us"].items():
        print(f"{name:>13}: seal+open " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", help="use this server (default: embedded, temp dir)")
    p.add_argument("--runs", type=int, default=500, help="runs per pass")
    p.add_argument("--steps", type=int, default=3, help="steps per run")
    p.add_argument("--payload-bytes", type=int, default=1024, help="size of each payload")
    p.add_argument("--reps", type=int, default=3, help="passes per codec (medians reported)")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    result = asyncio.run(_run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
