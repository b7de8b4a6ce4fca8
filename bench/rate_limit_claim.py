"""What rate limits cost the claim: shared buffers per claim, with and without limited runs.

Each scenario fills a fresh schema, then repeats: the worker's claim (`claim_runs`, 16 runs,
no timers read) under EXPLAIN (ANALYZE, BUFFERS), committed, and the ending of every run it
claimed (as the worker's would). It reports the median of the claims' shared buffers (hit +
read, the statement's top plan node: the token takes in `take_rate_tokens` included) and the
runs each claim took.

    python -m bench.rate_limit_claim [--database-url URL] [--claims 40] [--json FILE]
        [--queries FILE] [--scenarios unlimited,limited,limited_50_keys,parked_backlog]

- `unlimited`: 2,000 runs without a limit (`--queries` an older queries.sql, such as
  `git show <commit>:umt_backend_pg/sql/queries.sql`, measures the claim before rate limits on
  the same data);
- `limited`: 2,000 runs of one bucket with tokens to spare: every claim takes 16 tokens;
- `limited_50_keys`: 2,000 runs over 50 buckets of one limit, tokens to spare;
- `parking`: 1,000 due runs of a bucket whose tokens the fill took: each claim parks the 16 it
  locks (what a bucket's backlog costs until it is parked, once per token interval);
- `parked_backlog`: 1,000 runs of a bucket with no token left, parked (the claims of the fill
  parked them), and 2,000 runs without a limit of another task the worker also serves: what an
  empty bucket's backlog costs everybody else's claims.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench._claim_cost import LEASE, measure_claims, print_claim_figures, scratch_backend
from bench._infra import Server
from umt_backend_pg import PostgresBackend
from umt_sdk.backend import NewRun, TaskPair

DB = "bench_rate_limit_claim"
TASK = "bench_limited"
OTHER = "bench_unlimited"
LIMIT = 16
WORKER = "bench-limits"


def _new_run(task: str, limit: str | None, key: str = "") -> NewRun:
    fields: dict[str, Any] = {}
    if limit is not None:  # only with limits: an older tree has no such fields
        fields = {"rate_limit": limit, "rate_limit_key": key}
    return NewRun(
        run_id=uuid.uuid4(),
        task_name=task,
        task_version=1,
        input_json="null",
        input_hash="h",
        **fields,
    )


def _pairs() -> list[TaskPair]:
    return [TaskPair(name=TASK, version=1), TaskPair(name=OTHER, version=1)]


async def _fill(backend: PostgresBackend, scenario: str) -> None:
    runs: list[NewRun] = []
    if scenario == "unlimited":
        runs = [_new_run(TASK, None) for _ in range(2000)]
    elif scenario == "limited":
        await backend.define_rate_limit("plenty", limit=1_000_000, per=timedelta(hours=1))
        runs = [_new_run(TASK, "plenty") for _ in range(2000)]
    elif scenario == "limited_50_keys":
        await backend.define_rate_limit("plenty", limit=1_000_000, per=timedelta(hours=1))
        runs = [_new_run(TASK, "plenty", f"k{i % 50}") for i in range(2000)]
    elif scenario == "parking":
        await backend.define_rate_limit("scarce", limit=LIMIT, per=timedelta(hours=1))
        for new in [_new_run(TASK, "scarce") for _ in range(1000)]:
            await backend.enqueue(new)
        await backend.claim(worker_id="filler", pairs=_pairs()[:1], limit=LIMIT, lease=LEASE)
    elif scenario == "parked_backlog":
        await backend.define_rate_limit("scarce", limit=LIMIT, per=timedelta(hours=1))
        for new in [_new_run(TASK, "scarce") for _ in range(1000)]:
            await backend.enqueue(new)
        for _ in range(1000 // LIMIT + 2):  # the first claim takes the 16 tokens, the next
            await backend.claim(  # ones park the backlog, 16 at a time
                worker_id="filler", pairs=_pairs()[:1], limit=LIMIT, lease=LEASE
            )
        runs = [_new_run(OTHER, None) for _ in range(2000)]
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    for new in runs:
        await backend.enqueue(new)


async def _scenario(url: str, scenario: str, claims: int, claim_sql: str | None) -> dict[str, Any]:
    async with scratch_backend(url, f"limits_{scenario}") as backend:
        await _fill(backend, scenario)
        return await measure_claims(
            backend,
            url,
            pairs=_pairs(),
            claims=claims,
            limit=LIMIT,
            worker_id=WORKER,
            claim_sql=claim_sql,
        )


def _claim_sql(path: str | None) -> str | None:
    """`claim_runs` of another queries.sql (the named blocks as `_sql` parses them)."""
    if path is None:
        return None
    text = Path(path).read_text()
    start = text.index("-- name: claim_runs")
    end = text.find("\n-- name:", start + 1)
    block = text[start : end if end >= 0 else len(text)]
    return block.split("\n", 1)[1]


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    server = Server.start(args.database_url)
    url = server.fresh_db(DB)
    out: dict[str, Any] = {}
    claim_sql = _claim_sql(args.queries)
    try:
        for scenario in args.scenarios.split(","):
            out[scenario] = await _scenario(url, scenario, args.claims, claim_sql)
            print_claim_figures(scenario, out[scenario], width=18)
    finally:
        server.drop_db(DB)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", help="use this server (default: embedded, temp dir)")
    p.add_argument("--claims", type=int, default=40, help="claims measured per scenario")
    p.add_argument("--scenarios", default="unlimited,limited,limited_50_keys,parked_backlog")
    p.add_argument("--queries", help="measure the claim_runs of this queries.sql instead")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    result = asyncio.run(_run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
