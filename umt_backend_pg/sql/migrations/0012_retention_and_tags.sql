-- Retention and tags (issue 16, parts 5 and 8).
--
-- `runs.tags`: the labels a run was enqueued with, as given (read back by get and list).
-- `run_tags` holds the same pairs one a row, written by the enqueue's statement only when there
-- are tags: listing by a tag reads `run_tags_lookup` backwards from the cursor, in run-id order,
-- and stops after a page, however many runs the tag has. Deleting a run deletes its rows.
--
-- `pruned_runs`: the tombstone a run leaves when retention deletes it (with its steps,
-- executions, facts and tags, which cascade): its idempotency key stays taken (the enqueue's
-- statement looks here before it inserts a keyed run) and `get` can say the run was pruned,
-- until `forget_pruned` drops the tombstone (`connect(idempotency_retention=...)`).
--
-- `runs_finished` is now by task, then finishing time: a prune batch reads each task's oldest
-- finished runs from its own range of the index, so runs kept longer (a task's own, longer
-- retention) or not yet old enough are never read again and again by the batches of others.
--
-- `facts_by_run`: deleting a run makes Postgres delete its facts (ON DELETE CASCADE) by a
-- query on `facts.run_id`, once per deleted run; without an index each one would read the
-- whole facts table.

ALTER TABLE {schema}.runs ADD COLUMN tags jsonb NOT NULL DEFAULT '{{}}';

CREATE TABLE {schema}.run_tags (
    run_id  uuid NOT NULL REFERENCES {schema}.runs (id) ON DELETE CASCADE,
    key     text NOT NULL,
    value   text NOT NULL,
    PRIMARY KEY (run_id, key)
);
CREATE INDEX run_tags_lookup ON {schema}.run_tags (key, value, run_id);

CREATE TABLE {schema}.pruned_runs (
    run_id          uuid PRIMARY KEY,
    task_name       text NOT NULL,
    task_version    integer NOT NULL,
    status          text NOT NULL,
    idempotency_key text,
    input_hash      text NOT NULL,
    created_at      timestamptz NOT NULL,
    finished_at     timestamptz NOT NULL,
    pruned_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX pruned_runs_idempotency ON {schema}.pruned_runs (task_name, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX pruned_runs_age ON {schema}.pruned_runs (pruned_at);

CREATE INDEX facts_by_run ON {schema}.facts (run_id) WHERE run_id IS NOT NULL;

DROP INDEX {schema}.runs_finished;
CREATE INDEX runs_finished ON {schema}.runs (task_name, finished_at)
    WHERE status IN ('completed', 'failed', 'canceled');
