"""The raw ceiling: a bare psycopg 3 loop doing exactly the writes of a 1-step run.

    python -m bench._raw_child setup     --dsn URL --n N   (tables, N pending runs)
    python -m bench._raw_child work      --dsn URL --wid I (claim, checkpoint, complete)
    python -m bench._raw_child lifecycle --dsn URL --wid I --n N (insert, claim, ...)

One connection per process, autocommit, prepared statements: one commit per write.
"""

from __future__ import annotations

import argparse
import time

import psycopg

from bench.peers._proto import Control, send

SETUP = """
CREATE TABLE raw_runs (
    id bigserial PRIMARY KEY,
    task_name text NOT NULL,
    task_version integer NOT NULL,
    status smallint NOT NULL DEFAULT 0,
    priority smallint NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL DEFAULT now(),
    lease_owner integer,
    lease_expires_at timestamptz,
    claims integer NOT NULL DEFAULT 0,
    input jsonb NOT NULL,
    output jsonb,
    finished_at timestamptz
) WITH (fillfactor = 70);
CREATE INDEX raw_runs_claim ON raw_runs (task_name, task_version, priority DESC, available_at)
    WHERE status = 0;
CREATE TABLE raw_steps (
    run_id bigint NOT NULL,
    name text NOT NULL,
    output jsonb,
    PRIMARY KEY (run_id, name)
);
"""
INSERT = "INSERT INTO raw_runs (task_name, task_version, input) VALUES ('noop', 1, '1')"
CLAIM = """
UPDATE raw_runs SET status = 1, lease_owner = %s, lease_expires_at = now() + interval '10 s',
       claims = claims + 1
WHERE id = (SELECT id FROM raw_runs
            WHERE task_name = 'noop' AND task_version = 1 AND status = 0
              AND available_at <= now()
            ORDER BY priority DESC, available_at LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, input
"""
STEP = "INSERT INTO raw_steps (run_id, name, output) VALUES (%s, 's0', '0')"
COMPLETE = """
UPDATE raw_runs SET status = 2, output = '1', lease_owner = NULL, lease_expires_at = NULL,
       finished_at = now()
WHERE id = %s AND lease_owner = %s
"""
DONE_SQL = "SELECT count(*) FROM raw_runs WHERE status = 2"


def setup(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SETUP)
        if n:
            conn.execute(
                "INSERT INTO raw_runs (task_name, task_version, input) "
                "SELECT 'noop', 1, '1' FROM generate_series(1, %s)",
                (n,),
            )
        conn.execute("VACUUM ANALYZE raw_runs")
    send("RESULT", {"rows": n})


def work(dsn: str, wid: int, lifecycle_n: int) -> None:
    control = Control()
    count = 0
    first = None
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.cursor()
        send("READY")
        control.go.wait()
        while True:
            if lifecycle_n:
                if count >= lifecycle_n:
                    break
                cur.execute(INSERT, prepare=True)
            row = cur.execute(CLAIM, (wid,), prepare=True).fetchone()
            if row is None:
                if lifecycle_n:
                    continue
                break
            if first is None:
                first = time.time()
            cur.execute(STEP, (row[0],), prepare=True)
            cur.execute(COMPLETE, (row[0], wid), prepare=True)
            count += 1
        control.stop.wait()
        cpu = control.cpu_since_go()
    send("RESULT", {"count": count, "first_start": first, "cpu_s": cpu})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["setup", "work", "lifecycle"])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--wid", type=int, default=1)
    parser.add_argument("--k", type=int, default=1)
    args = parser.parse_args()
    if args.mode == "setup":
        setup(args.dsn, args.n)
    else:
        work(args.dsn, args.wid, args.n if args.mode == "lifecycle" else 0)


if __name__ == "__main__":
    main()
