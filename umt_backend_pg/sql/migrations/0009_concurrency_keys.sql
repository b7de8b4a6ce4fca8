-- Concurrency keys (issue 16, part 2): at most `limit` runs of a (task name, key) hold a slot
-- at once, enforced in the claim.
--
-- A run with a key (`concurrency_key`, computed by the SDK at enqueue) *holds a slot* while it
-- is running, and while it is waiting if it was enqueued with `count_waiting`; it *wants* one
-- while it is pending, or waiting without `count_waiting`. `concurrency_keys` keeps, per key,
-- the limit (the newest enqueue's) and two counters kept exact by every write that changes a
-- keyed run's status, in that write: `running` (runs holding a slot) and `queued` (runs
-- wanting one). Every such write changes them by the difference between the run's state
-- before and after (enqueue: queued + 1; claim: running + n, queued - n; an ending or a
-- cancel: what the run gave back and what it wants again).
--
-- Runs that want a slot are never in `ready` and not in `runs_claim_ready` (its predicate
-- leaves keyed runs out), so runs without a key are claimed as before, through the same
-- indexes: their claim reads only `concurrency_keys_open` too, an index of the keys with a
-- free slot and a queued run (empty when nobody uses keys). The claim locks the key rows it
-- takes from (FOR NO KEY UPDATE SKIP LOCKED: the newest counters, whoever committed since its
-- snapshot), takes at most `slot_limit - running` of each key's runs through
-- `runs_claim_keyed` (priority, then FIFO, within the key), and raises `running` in the same
-- statement. Keys take turns by the time they last had a run claimed (`claimed_at`), so a busy
-- key cannot starve another. A key that is full is skipped without reading its backlog.

ALTER TABLE {schema}.runs ADD COLUMN concurrency_key text;
ALTER TABLE {schema}.runs ADD COLUMN count_waiting boolean NOT NULL DEFAULT false;

DROP INDEX {schema}.runs_claim_ready;
CREATE INDEX runs_claim_ready ON {schema}.runs (task_name, task_version, priority DESC, available_at)
    WHERE status = 'pending' AND NOT queued AND concurrency_key IS NULL;

-- Runs that want a slot of their key, in the claim's order within the key.
CREATE INDEX runs_claim_keyed
    ON {schema}.runs (task_name, concurrency_key, priority DESC, available_at)
    WHERE concurrency_key IS NOT NULL
      AND (status = 'pending' OR (status = 'waiting' AND NOT count_waiting));
-- Every run of a key, newest last: what the strategies (cancel_in_progress, keep_newest) read.
CREATE INDEX runs_by_concurrency_key ON {schema}.runs (task_name, concurrency_key, id)
    WHERE concurrency_key IS NOT NULL;

CREATE TABLE {schema}.concurrency_keys (
    task_name       text NOT NULL,
    concurrency_key text NOT NULL,
    slot_limit      integer NOT NULL CHECK (slot_limit >= 1),
    running         integer NOT NULL DEFAULT 0 CHECK (running >= 0),
    queued          integer NOT NULL DEFAULT 0 CHECK (queued >= 0),
    claimed_at      timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (task_name, concurrency_key)
) WITH (
    fillfactor = 50, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 100,
    autovacuum_vacuum_cost_delay = 0
);
-- The keys a claim may take from: a free slot and a run wanting one. Least recently served
-- first.
CREATE INDEX concurrency_keys_open ON {schema}.concurrency_keys (task_name, claimed_at)
    WHERE queued > 0 AND running < slot_limit;
