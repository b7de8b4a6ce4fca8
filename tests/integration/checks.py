"""What the integration tests check after their worker processes (`tests/integration/tasks.py`)
were killed, frozen and restarted: every run exactly once, by the database and the files."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from tests._procs.support import fetch, q
from tests.integration.tasks import EXT_TABLE, PURE_STEPS

T_IO_STEPS = ("s1", "s2", "side", "s3")


async def ext_rows(url: str, schema: str) -> list[dict[str, Any]]:
    return await fetch(url, q("SELECT * FROM {schema}.{ext} ORDER BY seq", schema, ext=EXT_TABLE))


@attrs.frozen
class ExactlyOnceReport:
    runs: int
    body_executions: int
    interrupted_bodies: int
    """Step bodies that started under an attempt that never recorded them (killed mid-step)."""
    interrupted_executions: int
    resumed_side_effects: int
    """Side effects begun again by a later attempt after an earlier one started them."""


async def check_t_io_exactly_once(
    url: str,
    schema: str,
    business: str,
    keys: Sequence[str],
    workdir: Path,
    *,
    allow_step_retries: bool = False,
) -> ExactlyOnceReport:
    """Every `t_io` run of `keys` completed; no completed step body re-ran; the interrupted ones
    re-ran under a later attempt; the fenced side effect committed exactly once.

    With `allow_step_retries`, a step body may also have failed (a database outage inside the
    body) and been retried under the step's retry policy, as its `retrying` records show."""
    runs = await fetch(
        url,
        q(
            "SELECT id, status, output, input->>'key' AS key FROM {schema}.runs"
            " WHERE task_name = 't_io' AND task_version = 1",
            schema,
        ),
    )
    by_key = {r["key"]: r for r in runs}
    assert sorted(by_key) == sorted(keys), f"runs {len(by_key)} != keys {len(keys)}"
    statuses = Counter(r["status"] for r in runs)
    assert statuses == {"completed": len(keys)}, f"run statuses: {dict(statuses)}"

    steps = await fetch(
        url, q("SELECT run_id, name, status, fencing_token, output FROM {schema}.steps", schema)
    )
    step_records: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for s in steps:
        step_records[s["run_id"]].append(s)
    executions = await fetch(
        url, q("SELECT run_id, fencing_token, outcome FROM {schema}.executions", schema)
    )
    outcome = {(e["run_id"], e["fencing_token"]): e["outcome"] for e in executions}
    ext = await ext_rows(url, schema)
    bodies: dict[tuple[str, str], list[int]] = defaultdict(list)
    acts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in ext:
        if row["event"] == "body":
            bodies[(row["run_key"], row["step"])].append(row["token"])
        elif row["event"] == "act":
            acts[row["run_key"]].append(row)
    business_rows = await fetch(
        url, q("SELECT op_key, receipt, token FROM {schema}.{b}", schema, b=business)
    )
    per_op = Counter(r["op_key"] for r in business_rows)
    ledger = {
        r["op_key"]: r
        for r in await fetch(
            url,
            q("SELECT op_key, run_id, fencing_token, result FROM {schema}.op_ledger", schema),
        )
    }
    files = receipt_files(workdir)

    assert len(business_rows) == len(keys), (
        f"{len(business_rows)} business rows for {len(keys)} runs; per op key: {dict(per_op)}"
    )
    interrupted_bodies = 0
    resumed = 0
    for key in keys:
        run = by_key[key]
        run_id = run["id"]
        op_key = f"pay-{key}"
        records = step_records[run_id]
        completed = [s for s in records if s["status"] == "completed"]
        names = Counter(s["name"] for s in completed)
        assert names == Counter(T_IO_STEPS), f"run {key}: completed step records {dict(names)}"
        allowed = {"completed", "retrying"} if allow_step_retries else {"completed"}
        assert all(s["status"] in allowed for s in records), (
            f"run {key}: step statuses {[(s['name'], s['status']) for s in records]}"
        )
        retried = {(s["name"], s["fencing_token"]) for s in records if s["status"] == "retrying"}
        token_of = {s["name"]: s["fencing_token"] for s in completed}
        for name in T_IO_STEPS:
            tokens = bodies[(key, name)]
            recorded = token_of[name]
            per_token = Counter(tokens)
            assert max(per_token.values()) == 1, (
                f"run {key} step {name}: a body ran twice under one attempt: {dict(per_token)}"
            )
            assert per_token[recorded] == 1, (
                f"run {key} step {name}: {per_token[recorded]} body executions under the "
                f"recording attempt {recorded} (all: {tokens})"
            )
            later = [t for t in tokens if t > recorded]
            assert not later, (
                f"run {key} step {name}: completed under token {recorded} but its body ran "
                f"again under {later}"
            )
            for t in tokens:
                if t < recorded and (name, t) not in retried:
                    interrupted_bodies += 1
                    assert outcome.get((run_id, t)) == "interrupted", (
                        f"run {key} step {name}: body under token {t} left no record, yet "
                        f"that execution ended {outcome.get((run_id, t))!r}"
                    )
        # The fenced side effect: one business row, one ledger result, one file, all equal.
        assert per_op[op_key] == 1, f"run {key}: {per_op[op_key]} business rows for {op_key}"
        (row,) = [r for r in business_rows if r["op_key"] == op_key]
        entry = ledger.get(op_key)
        assert entry is not None, f"run {key}: no ledger entry for {op_key}"
        assert entry["result"] == row["receipt"], (
            f"run {key}: ledger result {entry['result']!r} != business receipt {row['receipt']!r}"
        )
        assert entry["fencing_token"] == row["token"], (
            f"run {key}: ledger token {entry['fencing_token']} != committing token {row['token']}"
        )
        assert row["token"] <= token_of["side"], (
            f"run {key}: committed under {row['token']} after the step was recorded under "
            f"{token_of['side']}"
        )
        assert run["output"]["receipt"] == row["receipt"], (
            f"run {key}: output receipt {run['output']['receipt']!r} != {row['receipt']!r}"
        )
        side = next(s for s in completed if s["name"] == "side")
        assert side["output"] == row["receipt"], f"run {key}: side step output {side['output']}"
        assert files.get(op_key) == row["receipt"], (
            f"run {key}: receipt file {files.get(op_key)!r} != {row['receipt']!r}"
        )
        act_rows = sorted(acts[key], key=lambda r: r["token"])
        act_tokens = [r["token"] for r in act_rows]
        assert len(set(act_tokens)) == len(act_tokens), f"run {key}: act tokens {act_tokens}"
        assert act_tokens, f"run {key}: the side effect never ran"
        assert act_tokens[-1] == row["token"], (
            f"run {key}: side effect bodies ran under {act_tokens}, committed under {row['token']}"
        )
        flags = [r["resumed"] for r in act_rows]
        assert all(flags[1:]), (
            f"run {key}: a later attempt did not see the earlier start of the side effect: "
            f"{list(zip(act_tokens, flags, strict=True))}"
        )
        if flags[0]:  # resumed: an earlier attempt began it (and was killed before acting)
            earlier = [t for t in bodies[(key, "side")] if t < act_tokens[0]]
            assert earlier, (
                f"run {key}: the first side effect attempt {act_tokens[0]} says resumed, but "
                f"no earlier attempt entered the step ({bodies[(key, 'side')]})"
            )
        resumed += sum(1 for f in flags if f)
        assert run["output"]["parts"] == [f"s1:{key}", f"s2:{key}", f"s3:{key}"], run["output"]
    return ExactlyOnceReport(
        runs=len(keys),
        body_executions=sum(len(v) for v in bodies.values()),
        interrupted_bodies=interrupted_bodies,
        interrupted_executions=sum(1 for v in outcome.values() if v == "interrupted"),
        resumed_side_effects=resumed,
    )


async def check_t_pure(url: str, schema: str, keys: Sequence[str], workdir: Path) -> int:
    """Every `t_pure` run of `keys` completed with no failure charged, and no completed step
    body re-ran; returns how many bodies were interrupted (and re-ran)."""
    runs = await fetch(
        url,
        q(
            "SELECT id, status, failures, error, output, input->>'key' AS key FROM {schema}.runs"
            " WHERE task_name = 't_pure'",
            schema,
        ),
    )
    by_key = {r["key"]: r for r in runs}
    assert sorted(by_key) == sorted(keys), f"runs {len(by_key)} != keys {len(keys)}"
    bad = {
        k: (r["status"], r["failures"], r["error"])
        for k, r in by_key.items()
        if r["status"] != "completed" or r["failures"]
    }
    assert not bad, f"{len(bad)} of {len(keys)} runs failed or were charged a failure: {bad}"
    steps = await fetch(
        url,
        q("SELECT run_id, name, status, fencing_token FROM {schema}.steps ORDER BY seq", schema),
    )
    executions = await fetch(
        url, q("SELECT run_id, fencing_token, outcome FROM {schema}.executions", schema)
    )
    outcome = {(e["run_id"], e["fencing_token"]): e["outcome"] for e in executions}
    interrupted = 0
    for key in keys:
        run = by_key[key]
        records = [s for s in steps if s["run_id"] == run["id"]]
        assert [(s["name"], s["status"]) for s in records] == [
            (name, "completed") for name in PURE_STEPS
        ], f"run {key}: {records}"
        assert run["output"] == [f"{name}:{key}" for name in PURE_STEPS], run["output"]
        bodies = pure_bodies(workdir, key)
        for record in records:
            tokens = [t for name, t in bodies if name == record["name"]]
            recorded = record["fencing_token"]
            assert Counter(tokens)[recorded] == 1, (
                f"run {key} step {record['name']}: recorded under {recorded}, bodies {tokens}"
            )
            assert len(set(tokens)) == len(tokens), (
                f"run {key} step {record['name']}: a body ran twice under one attempt: {tokens}"
            )
            assert max(tokens) == recorded, (
                f"run {key} step {record['name']}: completed under {recorded}, re-ran under "
                f"{[t for t in tokens if t > recorded]}"
            )
            for t in tokens:
                if t < recorded:
                    interrupted += 1
                    assert outcome.get((run["id"], t)) == "interrupted", (
                        f"run {key} step {record['name']}: body under {t} left no record; "
                        f"that execution ended {outcome.get((run['id'], t))!r}"
                    )
    return interrupted


def receipt_files(workdir: Path) -> dict[str, str]:
    """The receipt file of each op key: what the side effect left outside the database."""
    return {p.name.removesuffix(".receipt"): p.read_text() for p in workdir.glob("*.receipt")}


def pure_bodies(workdir: Path, key: str) -> list[tuple[str, int]]:
    """(step, attempt token) of every body execution of the `t_pure` run `key`."""
    lines = (workdir / f"{key}.bodies").read_text().split()
    return list(zip(lines[::2], map(int, lines[1::2]), strict=True))
