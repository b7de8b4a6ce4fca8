-- Shorter slots for the ready queue, and the slot just written is emptied first.
--
-- Under a long transaction elsewhere, a claim walks the rows that earlier claims deleted from
-- every slot not yet truncated (dead to the claim, but not removable while the snapshot lives).
-- With slots of 2 s and only the oldest one truncated, that was the last 4-6 s of claims (about
-- 300 index entries a scan of the largest partition at 250 runs/s, docs/performance.md). Slots
-- are now 1 s, and a rotation first offers the slot written just before the current one, then
-- the oldest: a scan walks the current second's deletions and, until the previous slot is
-- truncated, the second before it.
--
-- Nothing moves: a row keeps the slot it was written to, whatever the slot length was then;
-- rotation only ever truncates a slot it holds locked, after moving that slot's claimable rows
-- to the current one, so a change of the slot length cannot lose a row.

CREATE OR REPLACE FUNCTION {schema}.ready_slot() RETURNS smallint
LANGUAGE sql STABLE AS $$
    SELECT (floor(extract(epoch FROM statement_timestamp()))::bigint % 3)::smallint
$$;

-- Truncate slot `target` if it can be had at once: its claimable rows (at most `max_moved`)
-- move to slot `into_slot` first, rows of runs no longer claimable are dropped. Returns what
-- happened: 'truncated', 'clean' (nothing to do), 'busy' (a claim, an insert or a reader holds
-- the slot), 'full' (more claimable rows than `max_moved`: a backlog, left to the claims).
CREATE FUNCTION {schema}.rotate_ready_slot(target smallint, into_slot smallint, max_moved integer)
RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    part constant text := format('{schema}.%I', 'ready_' || target);
    live integer;
BEGIN
    IF pg_relation_size(part::regclass) = 0 THEN
        RETURN 'clean';
    END IF;
    BEGIN
        EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE NOWAIT', part);
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
        SELECT q.run_id, q.task_name, q.task_version, q.priority, q.available_at, into_slot
        FROM {schema}.ready q
        JOIN {schema}.runs r ON r.id = q.run_id
        WHERE q.slot = target
          AND ((r.status = 'pending' AND r.queued) OR r.status = 'waiting');
    END IF;
    EXECUTE format('TRUNCATE %s', part);
    RETURN 'truncated';
END
$$;

-- Offer both slots that are not being written: the one written last (0-1 s ago), then the
-- oldest (in case an earlier offer found it busy). Returns 'full' if either was full, else
-- 'truncated' if either was truncated, else 'busy' if either was busy, else 'clean'.
CREATE OR REPLACE FUNCTION {schema}.rotate_ready(max_moved integer) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    now_slot constant bigint := floor(extract(epoch FROM clock_timestamp()))::bigint;
    into_slot constant smallint := (now_slot % 3)::smallint;
    outcomes text[] := ARRAY[]::text[];
BEGIN
    outcomes := outcomes || {schema}.rotate_ready_slot(((now_slot + 2) % 3)::smallint, into_slot,
                                                       max_moved);
    outcomes := outcomes || {schema}.rotate_ready_slot(((now_slot + 1) % 3)::smallint, into_slot,
                                                       max_moved);
    RETURN CASE WHEN 'full' = ANY (outcomes) THEN 'full'
                WHEN 'truncated' = ANY (outcomes) THEN 'truncated'
                WHEN 'busy' = ANY (outcomes) THEN 'busy'
                ELSE 'clean' END;
END
$$;
