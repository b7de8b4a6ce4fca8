-- Keys that shape the flow (issue 28, part 2): singletons and debounce at enqueue.
--
-- A singleton (`enqueue(singleton=Singleton(key, mode))`) and a sequence (`sequence=key`) are
-- concurrency keys of limit 1 (migration 0009): nothing new in the claim. A singleton's enqueue
-- takes a transaction advisory lock of its (task name, key), reads the key's runs that are not
-- terminal through `runs_active_keyed`, and then stores its run or not ("skip"), in the same
-- transaction: concurrent enqueues of a key are serialized, and each sees what the one before
-- it stored. "replace" stores its run and returns the runs it found; the SDK cancels them.
--
-- A debounced run (`enqueue(debounce=Debounce(key, period, max_wait))`) keeps its key and the
-- latest it may start (`debounce_until`, the first trigger plus max_wait; NULL: no bound).
-- Under the advisory lock of (task name, key), a trigger gives the key's run that has not
-- started (pending, never claimed: `runs_debounce`) its input and a new `available_at`; a run
-- the claim took meanwhile has left that state (the update re-checks it under the row lock),
-- and the trigger stores a new run instead.

ALTER TABLE {schema}.runs ADD COLUMN debounce_key text;
ALTER TABLE {schema}.runs ADD COLUMN debounce_until timestamptz;

-- The runs of a key that are not terminal, newest last: what a singleton's enqueue reads.
CREATE INDEX runs_active_keyed ON {schema}.runs (task_name, concurrency_key, id)
    WHERE concurrency_key IS NOT NULL AND status IN ('pending', 'running', 'waiting');
-- Debounced runs that have not started, per (task name, version, key).
CREATE INDEX runs_debounce ON {schema}.runs (task_name, task_version, debounce_key, id)
    WHERE debounce_key IS NOT NULL AND status = 'pending' AND claims = 0;
