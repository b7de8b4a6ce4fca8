-- What operators look at (issue 17): each worker's newest report of itself (the dashboard's
-- workers page, `engine.workers()`). A worker upserts its row every few seconds, apart from
-- the claim and the heartbeat: no claim, lease or ending reads it.
CREATE TABLE {schema}.workers (
    worker_id       text PRIMARY KEY,
    host            text NOT NULL,
    pid             integer NOT NULL,
    pairs           jsonb NOT NULL,
    concurrency     integer NOT NULL,
    runs_held       integer NOT NULL,
    started_at      timestamptz NOT NULL,
    last_seen_at    timestamptz NOT NULL,
    stopped_at      timestamptz
);
CREATE INDEX workers_seen ON {schema}.workers (last_seen_at);
