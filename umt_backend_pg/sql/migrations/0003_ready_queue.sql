-- The ready queue: a narrow table of runs claimable now, emptied by truncation, not vacuum.
--
-- Every claim of a run claimable at once used to leave dead index entries behind in
-- `runs_claim_ready` (its pending version) that vacuum removes only once no snapshot can see
-- them: one open transaction elsewhere in the database (a report, a forgotten BEGIN) and every
-- claim walks every run claimed since it began. Now a run that is claimable at once (enqueued
-- without a delay, or woken by a fact) also gets a row in `ready`, its claim deletes that row in
-- the same statement, and `runs_claim_ready` keeps only the pending runs that are not `queued`
-- (delayed runs, retries, releases). `ready` is LIST-partitioned by a 2-second insertion slot
-- (three partitions, in turn); `rotate_ready()` truncates the slot that is about to be written
-- again, once it holds no claimable row, under a lock that no claim or insert holds. TRUNCATE
-- does not wait for old snapshots, so the claim's scan reads at most a few seconds of deleted
-- rows however long a transaction stays open.
--
-- A `ready` row is only a candidate: the claim locks the `runs` row, rechecks its status and
-- takes the fencing token from it, as before.

ALTER TABLE {schema}.runs ADD COLUMN queued boolean NOT NULL DEFAULT false;

DROP INDEX {schema}.runs_claim_ready;
CREATE INDEX runs_claim_ready ON {schema}.runs (task_name, task_version, priority DESC, available_at)
    WHERE status = 'pending' AND NOT queued;

-- Queued runs by age, for the sweeper: a queued run whose `ready` row is gone (a TRUNCATE or
-- DELETE by hand, a bug) goes back to runs_claim_ready (see sweep_ready in queries.sql).
CREATE INDEX runs_queued ON {schema}.runs (available_at, id) WHERE status = 'pending' AND queued;

CREATE TABLE {schema}.ready (
    run_id          uuid NOT NULL,
    task_name       text NOT NULL,
    task_version    integer NOT NULL,
    priority        smallint NOT NULL,
    available_at    timestamptz NOT NULL,
    slot            smallint NOT NULL
) PARTITION BY LIST (slot);
CREATE TABLE {schema}.ready_0 PARTITION OF {schema}.ready FOR VALUES IN (0);
CREATE TABLE {schema}.ready_1 PARTITION OF {schema}.ready FOR VALUES IN (1);
CREATE TABLE {schema}.ready_2 PARTITION OF {schema}.ready FOR VALUES IN (2);
CREATE INDEX ready_claim ON {schema}.ready (task_name, task_version, priority DESC, available_at);
CREATE INDEX ready_run ON {schema}.ready (run_id);

-- The slot a row inserted now goes to (the statement's start, not the transaction's).
CREATE FUNCTION {schema}.ready_slot() RETURNS smallint
LANGUAGE sql STABLE AS $$
    SELECT (floor(extract(epoch FROM statement_timestamp()) / 2)::bigint % 3)::smallint
$$;

-- Truncate the slot after the current one (written last 2-4 s ago, written next in 0-2 s) if it
-- can be had at once: its claimable rows (at most `max_moved`) move to the current slot first,
-- rows of runs no longer claimable are dropped. Returns what happened: 'truncated', 'clean'
-- (nothing to do), 'busy' (a claim, an insert or a reader holds the slot), 'full' (more
-- claimable rows than `max_moved`: a backlog, left to the claims).
CREATE FUNCTION {schema}.rotate_ready(max_moved integer) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    now_slot constant bigint := floor(extract(epoch FROM clock_timestamp()) / 2)::bigint;
    target constant smallint := ((now_slot + 1) % 3)::smallint;
    live integer;
BEGIN
    IF pg_relation_size(format('{schema}.ready_%s', target)::regclass) = 0 THEN
        RETURN 'clean';
    END IF;
    BEGIN
        IF target = 0 THEN
            LOCK TABLE {schema}.ready_0 IN ACCESS EXCLUSIVE MODE NOWAIT;
        ELSIF target = 1 THEN
            LOCK TABLE {schema}.ready_1 IN ACCESS EXCLUSIVE MODE NOWAIT;
        ELSE
            LOCK TABLE {schema}.ready_2 IN ACCESS EXCLUSIVE MODE NOWAIT;
        END IF;
    EXCEPTION WHEN lock_not_available THEN
        RETURN 'busy';
    END;
    -- Under the lock no transaction that wrote the slot is still open: this sees all its rows.
    SELECT count(*) INTO live FROM (
        SELECT 1 FROM {schema}.ready q
        JOIN {schema}.runs r ON r.id = q.run_id
        WHERE q.slot = target
          AND ((r.status = 'pending' AND r.queued) OR r.status = 'waiting')
        LIMIT max_moved + 1
    ) AS l;
    IF live > max_moved THEN
        RETURN 'full';
    END IF;
    IF live > 0 THEN
        INSERT INTO {schema}.ready (run_id, task_name, task_version, priority, available_at, slot)
        SELECT q.run_id, q.task_name, q.task_version, q.priority, q.available_at,
               (now_slot % 3)::smallint
        FROM {schema}.ready q
        JOIN {schema}.runs r ON r.id = q.run_id
        WHERE q.slot = target
          AND ((r.status = 'pending' AND r.queued) OR r.status = 'waiting');
    END IF;
    IF target = 0 THEN
        TRUNCATE {schema}.ready_0;
    ELSIF target = 1 THEN
        TRUNCATE {schema}.ready_1;
    ELSE
        TRUNCATE {schema}.ready_2;
    END IF;
    RETURN 'truncated';
END
$$;

-- Runs queued before this migration stay where they are: pending, not queued, claimed through
-- runs_claim_ready as before.
