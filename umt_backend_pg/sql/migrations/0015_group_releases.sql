-- Releases owed by a map with a max_concurrency (`ctx.step.map`): a write that ends a member
-- lets the next held member run in its transaction, skipping held members another write has
-- locked (it must not wait for them: see the lock order in end_execution). When every held
-- member was locked, that release was lost before this migration if the other write did not
-- end the member it held (a cancel rolled back, its connection died, any other write): no
-- member ran again and the parent waited forever. Now the group row keeps what it owes
-- (`owed`: releases due and not made while a held member remains), in the same transaction
-- that found every held member locked; the next write that ends a member pays it first, and
-- each worker pays what is owed about once a second (pay_group_releases, through the partial
-- index `child_groups_owing`, empty unless a release is owed).

ALTER TABLE {schema}.child_groups ADD COLUMN owed integer NOT NULL DEFAULT 0;

-- The groups that owe releases: what a worker's pay_group_releases reads (empty nearly always).
CREATE INDEX child_groups_owing ON {schema}.child_groups (parent_run_id, name) WHERE owed > 0;

-- Lets up to `due` held members of group `grp` of run `parent` run (claimable now, queued in
-- `ready`), in input order, skipping those another write holds (never waiting for them: that
-- write may hold the group next, see the lock order in end_execution). Returns what is still
-- owed: the releases it could not make while a held member remains (locked by that write),
-- else 0 (no member is held any more: nothing can be owed). Its statements each read a fresh
-- snapshot: a member let run by a write that committed meanwhile is not taken again.
CREATE FUNCTION {schema}.release_held(parent uuid, grp text, due integer, channel text)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    next_id uuid;
    pair text;
    paid integer := 0;
BEGIN
    WHILE paid < due LOOP
        next_id := NULL;
        SELECT r.id INTO next_id FROM {schema}.runs r
        WHERE r.parent_run_id = parent AND r.child_group = grp
          AND r.status = 'waiting' AND r.wait_for = 'umt turn' AND r.available_at IS NULL
        ORDER BY r.group_index
        LIMIT 1
        FOR NO KEY UPDATE SKIP LOCKED;
        EXIT WHEN next_id IS NULL;
        UPDATE {schema}.runs SET available_at = now(), wait_for = NULL, updated_at = now()
        WHERE id = next_id;
        pair := NULL;
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
        paid := paid + 1;
    END LOOP;
    IF paid < due AND EXISTS (
        SELECT 1 FROM {schema}.runs r
        WHERE r.parent_run_id = parent AND r.child_group = grp
          AND r.status = 'waiting' AND r.wait_for = 'umt turn' AND r.available_at IS NULL
    ) THEN
        RETURN due - paid;
    END IF;
    RETURN 0;
END
$$;

-- A member of group `grp` of run `parent` finished: one fewer remaining; at zero the group's
-- fact for the parent, waking it if it waits for it. In a map with a max_concurrency, the
-- releases due: one when the member had been let run (`released`: its slot is free), plus
-- those the group owes (`owed`, see release_held); what cannot be paid now stays owed, paid
-- by the next write that ends a member or by a worker's pay_group_releases. Its own
-- statements each read a fresh snapshot, so it counts on the group row as it is after the
-- lock. The parent is read by id alone and tested afterwards (see the note atop queries.sql).
-- Returns the members remaining (NULL: no such group).
CREATE OR REPLACE FUNCTION {schema}.child_group_ended(parent uuid, grp text, released boolean, channel text)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    left_over integer;
    limited integer;
    owing integer;
    still_owed integer;
    waiter record;
BEGIN
    UPDATE {schema}.child_groups SET remaining = remaining - 1
    WHERE parent_run_id = parent AND name = grp
    RETURNING remaining, max_concurrency, owed INTO left_over, limited, owing;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Only a map with a max_concurrency holds members back: no other group looks for one.
    IF limited IS NOT NULL AND (released OR owing > 0) THEN
        still_owed := {schema}.release_held(parent, grp,
                                            owing + CASE WHEN released THEN 1 ELSE 0 END,
                                            channel);
        IF still_owed <> owing THEN
            UPDATE {schema}.child_groups SET owed = still_owed
            WHERE parent_run_id = parent AND name = grp;
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
