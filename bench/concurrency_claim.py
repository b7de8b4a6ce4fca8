"""What concurrency keys cost the claim: shared buffers per claim, unkeyed and keyed.

Each scenario fills a fresh schema, then repeats: the worker's claim (`claim_runs`, 16 runs,
no timers read) under EXPLAIN (ANALYZE, BUFFERS), committed, and the ending of every run it
claimed (as the worker's would). It reports the median of the claims' shared buffers (hit +
read, the statement's top plan node) and the runs each claim took.

    python -m bench.concurrency_claim [--database-url URL] [--claims 40] [--json FILE]
        [--scenarios unkeyed,keyed_50,full_key_backlog,one_key_backlog]

- `unkeyed`: 2,000 runs without a key (what every claim cost before keys: run this script on
  a tree without them for the "before" figure; the scenarios with keys need them);
- `keyed_50`: 2,000 runs over 50 keys of limit 2;
- `full_key_backlog`: one key of limit 2 holding both slots with 1,000 runs queued behind it,
  and 2,000 runs without a key: what a full key's backlog costs everybody else's claims;
- `one_key_backlog`: one key of limit 16 with 2,000 runs: the claim takes its free slots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from typing import Any

from bench._claim_cost import LEASE, measure_claims, print_claim_figures, scratch_backend
from bench._infra import Server
from umt_backend_pg import PostgresBackend
from umt_sdk.backend import NewRun, TaskPair

DB = "bench_concurrency_claim"
TASK = "bench_keys"
LIMIT = 16
WORKER = "bench-keys"


def _new_run(key: str | None, limit: int) -> NewRun:
    fields: dict[str, Any] = {}
    if key is not None:  # only with keys: the tree measured "before" has no such fields
        fields = {"concurrency_key": key, "concurrency_limit": limit}
    return NewRun(
        run_id=uuid.uuid4(),
        task_name=TASK,
        task_version=1,
        input_json="null",
        input_hash="h",
        **fields,
    )


async def _fill(backend: PostgresBackend, scenario: str) -> None:
    runs: list[NewRun] = []
    if scenario == "unkeyed":
        runs = [_new_run(None, 0) for _ in range(2000)]
    elif scenario == "keyed_50":
        runs = [_new_run(f"k{i % 50}", 2) for i in range(2000)]
    elif scenario == "full_key_backlog":
        full = [_new_run("full", 2) for _ in range(1002)]
        for new in full:
            await backend.enqueue(new)
        held = await backend.claim(worker_id="holder", pairs=_pairs(), limit=2, lease=LEASE)
        assert len(held) == 2
        runs = [_new_run(None, 0) for _ in range(2000)]
    elif scenario == "one_key_backlog":
        runs = [_new_run("big", LIMIT) for _ in range(2000)]
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    for new in runs:
        await backend.enqueue(new)


def _pairs() -> list[TaskPair]:
    return [TaskPair(name=TASK, version=1)]


async def _scenario(url: str, scenario: str, claims: int) -> dict[str, Any]:
    async with scratch_backend(url, f"keys_{scenario}") as backend:
        await _fill(backend, scenario)
        return await measure_claims(
            backend, url, pairs=_pairs(), claims=claims, limit=LIMIT, worker_id=WORKER
        )


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    server = Server.start(args.database_url)
    url = server.fresh_db(DB)
    out: dict[str, Any] = {}
    try:
        for scenario in args.scenarios.split(","):
            out[scenario] = await _scenario(url, scenario, args.claims)
            print_claim_figures(scenario, out[scenario], width=18)
    finally:
        server.drop_db(DB)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", help="use this server (default: embedded, temp dir)")
    p.add_argument("--claims", type=int, default=40, help="claims measured per scenario")
    p.add_argument("--scenarios", default="unkeyed,keyed_50,full_key_backlog,one_key_backlog")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    result = asyncio.run(_run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
