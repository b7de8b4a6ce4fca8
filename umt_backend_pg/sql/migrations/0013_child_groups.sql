-- Fan-out (`ctx.step.map`, `ctx.step.gather`): a parent's children awaited as one group.
--
-- A group row counts its members not finished (`remaining`); each member's finishing write
-- counts itself out (child_group_ended), in its transaction: at zero the group's fact is stored
-- for the parent and the parent woken, once for the whole group. A map's members beyond its
-- `max_concurrency` are *held*: `waiting`, no `available_at`, `wait_for` 'umt turn' (no fact
-- can have that name), outside every claim index; a member that ran lets the first held one,
-- in input order, run when it finishes.

ALTER TABLE {schema}.runs
    ADD COLUMN child_group text,
    ADD COLUMN group_index integer;

CREATE TABLE {schema}.child_groups (
    parent_run_id   uuid NOT NULL,
    name            text NOT NULL,
    total           integer NOT NULL,
    remaining       integer NOT NULL,
    max_concurrency integer,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (parent_run_id, name)
);

-- The held members of a group, in input order: the next one to let run is the first entry.
CREATE INDEX runs_group_held ON {schema}.runs (parent_run_id, child_group, group_index)
    WHERE status = 'waiting' AND wait_for = 'umt turn' AND available_at IS NULL;

-- A member of group `grp` of run `parent` finished: one fewer remaining; at zero the group's
-- fact for the parent, waking it if it waits for it; and, when the member had been let run
-- (`released`), the first held member lets run (claimable now, queued in `ready`). Its own
-- statements each read a fresh snapshot, so it counts on the group row as it is after the
-- lock, and a held member let run by a concurrent ending (committed meanwhile) is not taken
-- again; held members locked by another write (a cancel) are skipped, not waited for. The
-- parent is read by id alone and tested afterwards (see the note atop queries.sql). Returns
-- the members remaining (NULL: no such group).
CREATE FUNCTION {schema}.child_group_ended(parent uuid, grp text, released boolean, channel text)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    left_over integer;
    limited integer;
    next_id uuid;
    pair text;
    waiter record;
BEGIN
    UPDATE {schema}.child_groups SET remaining = remaining - 1
    WHERE parent_run_id = parent AND name = grp
    RETURNING remaining, max_concurrency INTO left_over, limited;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Only a map with a max_concurrency holds members back: no other group looks for one.
    IF released AND limited IS NOT NULL THEN
        SELECT r.id INTO next_id FROM {schema}.runs r
        WHERE r.parent_run_id = parent AND r.child_group = grp
          AND r.status = 'waiting' AND r.wait_for = 'umt turn' AND r.available_at IS NULL
        ORDER BY r.group_index
        LIMIT 1
        FOR NO KEY UPDATE SKIP LOCKED;
        IF next_id IS NOT NULL THEN
            UPDATE {schema}.runs SET available_at = now(), wait_for = NULL, updated_at = now()
            WHERE id = next_id;
            INSERT INTO {schema}.ready (run_id, task_name, task_version, priority, available_at,
                                        slot)
            SELECT r.id, r.task_name, r.task_version, r.priority, r.available_at,
                   {schema}.ready_slot()
            FROM {schema}.runs r WHERE r.id = next_id AND r.concurrency_key IS NULL
              AND NOT EXISTS (  -- a paused task's runs hold no `ready` rows (the claim's
                  SELECT 1 FROM {schema}.paused_tasks p  -- timers find it when resumed)
                  WHERE p.task_name = r.task_name AND p.task_version IN (0, r.task_version))
            RETURNING task_name || '@' || task_version INTO pair;
            PERFORM pg_notify(channel, COALESCE(pair, ''));
        END IF;
    END IF;
    IF left_over = 0 THEN
        INSERT INTO {schema}.facts (scope, name, run_id, payload)
        VALUES (parent::text, grp, parent, 'null'::jsonb)
        ON CONFLICT (scope, name) DO NOTHING;
        IF FOUND THEN
            SELECT r.id, r.status, r.wait_for, r.task_name, r.task_version, r.priority,
                   r.concurrency_key IS NULL OR r.count_waiting AS holds
            INTO waiter FROM {schema}.runs r WHERE r.id = parent
            FOR NO KEY UPDATE;
            IF FOUND AND waiter.status = 'waiting' AND waiter.wait_for = grp THEN
                UPDATE {schema}.runs SET available_at = now(), updated_at = now()
                WHERE id = parent;
                -- A keyed parent that gave its slot back is claimed through its key instead.
                IF waiter.holds THEN
                    INSERT INTO {schema}.ready (run_id, task_name, task_version, priority,
                                                available_at, slot)
                    VALUES (parent, waiter.task_name, waiter.task_version, waiter.priority,
                            now(), {schema}.ready_slot());
                END IF;
                PERFORM pg_notify(channel, waiter.task_name || '@' || waiter.task_version);
            END IF;
        END IF;
    END IF;
    RETURN left_over;
END
$$;
