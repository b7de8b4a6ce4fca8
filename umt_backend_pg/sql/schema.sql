-- The whole current umt engine schema (equal to all migrations applied; a test checks it).

CREATE SEQUENCE {schema}.fencing_tokens AS bigint;

CREATE TABLE {schema}.runs (
    id                  uuid PRIMARY KEY,
    task_name           text NOT NULL,
    task_version        integer NOT NULL,
    status              text NOT NULL CHECK (
        status IN ('pending', 'running', 'waiting', 'completed', 'failed', 'canceled',
                   'compensated')
    ),
    priority            smallint NOT NULL DEFAULT 0,
    -- pending/waiting: claimable from then on (NULL: waits for a fact only);
    -- running: a lower bound of the lease expiry, refreshed by heartbeats.
    available_at        timestamptz,
    lease_owner         text,
    lease_expires_at    timestamptz,
    fencing_token       bigint NOT NULL DEFAULT 0,
    claims              integer NOT NULL DEFAULT 0,
    failures            integer NOT NULL DEFAULT 0,
    lease_expirations   integer NOT NULL DEFAULT 0,
    idempotency_key     text,
    input_hash          text NOT NULL,
    trace_context       jsonb NOT NULL DEFAULT '{{}}',
    input               jsonb NOT NULL,
    output              jsonb,
    error               jsonb,
    wait_for            text,
    cancel_requested_at timestamptz,
    cancel_reason       text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    finished_at         timestamptz,
    -- pending and in `ready` (claimable at once): left out of runs_claim_ready.
    queued              boolean NOT NULL DEFAULT false,
    -- A child run: its parent, the fact it stores for the parent when it finishes, and whether
    -- its cancel is requested when the parent finishes failed or canceled (migration 0006).
    parent_run_id       uuid,
    parent_fact         text,
    cancel_with_parent  boolean NOT NULL DEFAULT false,
    -- The run's concurrency key, and whether it keeps its slot while waiting (migration 0009).
    concurrency_key     text,
    count_waiting       boolean NOT NULL DEFAULT false,
    -- When the run must be finished by, and started by (migration 0010): the SDK ends it
    -- failed past either; `available_at` is never later than `deadline_at`.
    deadline_at         timestamptz,
    start_by            timestamptz,
    -- A run started again: the run it reruns, or forks and the step it forks from (0011).
    rerun_of            uuid,
    forked_from         uuid,
    forked_at_step      text,
    -- The labels given at enqueue; one row each in run_tags (migration 0012).
    tags                jsonb NOT NULL DEFAULT '{{}}',
    -- A member of a child group of its parent (map, gather), and its place in it (0013).
    child_group         text,
    group_index         integer,
    -- The rate limit a start takes a token of and its bucket, and the limit the run waits for
    -- a token of (parked by the claim, or by a step) (migration 0014).
    rate_limit          text,
    rate_limit_key      text,
    waits_for_limit     text,
    -- A debounced run's key and the latest it may start (migration 0019).
    debounce_key        text,
    debounce_until      timestamptz
) WITH (
    fillfactor = 70, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0, autovacuum_vacuum_cost_limit = 10000
);

-- The claim reads only its own (name, version) pairs: `ready` (below), pending runs not in it
-- (delayed runs, retries, releases) by priority, then FIFO ...
CREATE INDEX runs_claim_ready ON {schema}.runs (task_name, task_version, priority DESC, available_at)
    WHERE status = 'pending' AND NOT queued AND concurrency_key IS NULL;
-- Queued runs by age, for the sweeper: a queued run whose `ready` row is gone (a TRUNCATE or
-- DELETE by hand, a bug) goes back to runs_claim_ready (see sweep_ready in queries.sql).
CREATE INDEX runs_queued ON {schema}.runs (available_at, id) WHERE status = 'pending' AND queued;
-- ... and runs whose timer came: a sleep's end, a wait's timeout or wake-up, a lease expiry.
CREATE INDEX runs_claim_timers ON {schema}.runs (task_name, task_version, available_at)
    WHERE status IN ('waiting', 'running');
CREATE UNIQUE INDEX runs_idempotency ON {schema}.runs (task_name, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX runs_waiting_for ON {schema}.runs (wait_for)
    WHERE status = 'waiting' AND wait_for IS NOT NULL;
-- Runs in needs_attention, for their listing (migrations/0022_needs_attention.sql).
CREATE INDEX runs_needing_attention ON {schema}.runs (id)
    WHERE status = 'waiting' AND wait_for LIKE 'umt.attention:%';
-- The runs events started, by their key (migrations/0026_event_runs.sql).
CREATE INDEX runs_event_key ON {schema}.runs (idempotency_key)
    WHERE idempotency_key LIKE 'umt.event:%';
CREATE INDEX runs_by_task ON {schema}.runs (task_name, id);
CREATE INDEX runs_finished ON {schema}.runs (task_name, finished_at)
    WHERE status IN ('completed', 'failed', 'canceled', 'compensated');
CREATE INDEX runs_children ON {schema}.runs (parent_run_id, id) WHERE parent_run_id IS NOT NULL;
-- Runs that want a slot of their concurrency key, in the claim's order within the key (see
-- migrations/0009_concurrency_keys.sql) ...
CREATE INDEX runs_claim_keyed
    ON {schema}.runs (task_name, concurrency_key, priority DESC, available_at)
    WHERE concurrency_key IS NOT NULL
      AND (status = 'pending' OR (status = 'waiting' AND NOT count_waiting));
-- ... and every run of a key, for the strategies (cancel_in_progress, keep_newest).
CREATE INDEX runs_by_concurrency_key ON {schema}.runs (task_name, concurrency_key, id)
    WHERE concurrency_key IS NOT NULL;
-- ... and the runs of a key that are not terminal, for a singleton's enqueue (0019).
CREATE INDEX runs_active_keyed ON {schema}.runs (task_name, concurrency_key, id)
    WHERE concurrency_key IS NOT NULL AND status IN ('pending', 'running', 'waiting');
-- Debounced runs that have not started, per (task name, version, key) (0019).
CREATE INDEX runs_debounce ON {schema}.runs (task_name, task_version, debounce_key, id)
    WHERE debounce_key IS NOT NULL AND status = 'pending' AND claims = 0;

-- Per concurrency key: its limit and two exact counters, `running` (runs holding a slot) and
-- `queued` (runs wanting one), changed by every write that changes a keyed run's status.
CREATE TABLE {schema}.concurrency_keys (
    task_name       text NOT NULL,
    concurrency_key text NOT NULL,
    slot_limit      integer NOT NULL CHECK (slot_limit >= 1),
    running         integer NOT NULL DEFAULT 0 CHECK (running >= 0),
    queued          integer NOT NULL DEFAULT 0 CHECK (queued >= 0),
    claimed_at      timestamptz NOT NULL DEFAULT '-infinity',
    -- A fairness key's runs per turn (NULL: not a fairness key; 0025_fairness_keys.sql).
    weight          integer CHECK (weight >= 1),
    PRIMARY KEY (task_name, concurrency_key)
) WITH (
    fillfactor = 50, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 100,
    autovacuum_vacuum_cost_delay = 0
);
-- The keys a claim may take from (a free slot and a run wanting one), least recently served first.
CREATE INDEX concurrency_keys_open ON {schema}.concurrency_keys (task_name, claimed_at)
    WHERE queued > 0 AND running < slot_limit;

-- The ready queue: runs claimable now, emptied by truncation (see migrations/0003_ready_queue.sql).
CREATE TABLE {schema}.ready (
    run_id          uuid NOT NULL,
    task_name       text NOT NULL,
    task_version    integer NOT NULL,
    priority        smallint NOT NULL,
    available_at    timestamptz NOT NULL,
    slot            smallint NOT NULL
) PARTITION BY LIST (slot);
CREATE TABLE {schema}.ready_0 PARTITION OF {schema}.ready FOR VALUES IN (0)
    WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
          autovacuum_vacuum_cost_delay = 0);
CREATE TABLE {schema}.ready_1 PARTITION OF {schema}.ready FOR VALUES IN (1)
    WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
          autovacuum_vacuum_cost_delay = 0);
CREATE TABLE {schema}.ready_2 PARTITION OF {schema}.ready FOR VALUES IN (2)
    WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
          autovacuum_vacuum_cost_delay = 0);
CREATE INDEX ready_claim ON {schema}.ready (task_name, task_version, priority DESC, available_at);
CREATE INDEX ready_run ON {schema}.ready (run_id);

-- The slot a row inserted now goes to: one second each, three in turn (the statement's start,
-- not the transaction's; see migrations/0005_ready_slots.sql).
CREATE FUNCTION {schema}.ready_slot() RETURNS smallint
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
CREATE FUNCTION {schema}.rotate_ready(max_moved integer) RETURNS text
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

CREATE TABLE {schema}.steps (
    run_id          uuid NOT NULL REFERENCES {schema}.runs (id) ON DELETE CASCADE,
    name            text NOT NULL,
    attempt         integer NOT NULL,
    seq             bigint GENERATED ALWAYS AS IDENTITY,
    kind            text NOT NULL CHECK (kind IN ('step', 'sleep', 'fact')),
    status          text NOT NULL CHECK (status IN ('completed', 'failed', 'retrying', 'waiting')),
    fencing_token   bigint NOT NULL,
    output          jsonb,
    error           jsonb,
    started_at      timestamptz,
    finished_at     timestamptz,
    wake_at         timestamptz,
    PRIMARY KEY (run_id, name, attempt)
) WITH (fillfactor = 90);

CREATE TABLE {schema}.executions (
    run_id          uuid NOT NULL REFERENCES {schema}.runs (id) ON DELETE CASCADE,
    fencing_token   bigint NOT NULL,
    worker_id       text NOT NULL,
    claimed_at      timestamptz NOT NULL,
    ended_at        timestamptz,
    outcome         text NOT NULL,
    current_step    text,
    step_started_at timestamptz,
    PRIMARY KEY (run_id, fencing_token)
) WITH (
    fillfactor = 80, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0, autovacuum_vacuum_cost_limit = 10000
);

-- Facts: first write wins per (scope, name); scope is a run id, or '*' for broadcast facts.
CREATE TABLE {schema}.facts (
    scope       text NOT NULL,
    name        text NOT NULL,
    run_id      uuid REFERENCES {schema}.runs (id) ON DELETE CASCADE,
    payload     jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, name)
);

-- The operation ledger behind with_attempt_token.
CREATE TABLE {schema}.op_ledger (
    op_key          text PRIMARY KEY,
    run_id          uuid NOT NULL,
    fencing_token   bigint NOT NULL,
    result          jsonb,
    started_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);

-- Fencing tokens carry an epoch per server incarnation: see migrations/0002_token_epochs.sql.
CREATE TABLE {schema}.token_epochs (
    server_key  text PRIMARY KEY,
    epoch       bigint NOT NULL UNIQUE CHECK (epoch > 0),
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION {schema}.next_fencing_token() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    -- The start time as seconds since 1970 (numeric text): the same in every session, whatever
    -- its TimeZone or DateStyle (a timestamptz's text is not).
    incarnation constant text := extract(epoch FROM pg_postmaster_start_time())::text;
    block constant bigint := 4194304;  -- 2^22 tokens per epoch
    current_epoch bigint;
    token bigint;
BEGIN
    -- Look, and if this incarnation has no epoch (or it is used up) look again under the lock:
    -- another claim may have opened it meanwhile.
    FOR locked IN 0..1 LOOP
        IF locked = 1 THEN
            PERFORM pg_advisory_xact_lock(hashtextextended('{schema}.token_epochs', 0));
        END IF;
        SELECT e.epoch INTO current_epoch FROM {schema}.token_epochs e
        WHERE e.server_key = incarnation;
        IF current_epoch IS NOT NULL THEN
            token := nextval('{schema}.fencing_tokens');
            IF token >= current_epoch * block AND token < (current_epoch + 1) * block THEN
                RETURN token;
            END IF;
        END IF;
    END LOOP;
    -- The first token of this incarnation, or the epoch is used up: open a new epoch, once.
    SELECT greatest(
               floor(extract(epoch FROM clock_timestamp() - timestamptz '2020-01-01 00:00+00')
                     * 1000)::bigint,
               coalesce(max(e.epoch), 0) + 1)
    INTO current_epoch FROM {schema}.token_epochs e;
    INSERT INTO {schema}.token_epochs (server_key, epoch) VALUES (incarnation, current_epoch)
    ON CONFLICT (server_key) DO UPDATE SET epoch = EXCLUDED.epoch, created_at = now();
    PERFORM setval('{schema}.fencing_tokens', current_epoch * block, false);
    -- This claim's commit must be durable: it carries the new epoch.
    PERFORM set_config('synchronous_commit', 'on', true);
    RETURN nextval('{schema}.fencing_tokens');
END
$$;

-- Schedules: the SDK's state of each one and a version for compare-and-set (see
-- migrations/0007_schedules.sql).
CREATE TABLE {schema}.schedules (
    name            text PRIMARY KEY,
    task_name       text NOT NULL,
    cron            text NOT NULL,
    timezone        text NOT NULL,
    input           jsonb NOT NULL,
    overlap         text NOT NULL,
    catchup_window  interval NOT NULL,
    paused          boolean NOT NULL DEFAULT false,
    next_tick       timestamptz NOT NULL,
    last_tick       timestamptz,
    last_run_id     uuid,
    buffered_tick   timestamptz,
    version         bigint NOT NULL DEFAULT 1,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX schedules_by_task ON {schema}.schedules (task_name, next_tick);

-- Streams of runs: one row per (run, stream) with its newest seq, and the entries, unique by
-- the writer's key (see migrations/0008_streams.sql).
CREATE TABLE {schema}.streams (
    run_id      uuid NOT NULL REFERENCES {schema}.runs (id) ON DELETE CASCADE,
    name        text NOT NULL,
    last_seq    bigint NOT NULL,
    PRIMARY KEY (run_id, name)
);
CREATE TABLE {schema}.stream_entries (
    run_id      uuid NOT NULL,
    name        text NOT NULL,
    seq         bigint NOT NULL,
    key         text NOT NULL,
    value       jsonb NOT NULL,
    written_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, name, seq),
    UNIQUE (run_id, name, key),
    FOREIGN KEY (run_id, name) REFERENCES {schema}.streams (run_id, name) ON DELETE CASCADE
);

-- Paused tasks: the claim takes no run of a pair named here, by its version or by the task
-- alone (task_version 0: every version); see migrations/0011_pause_rerun_fork.sql.
CREATE TABLE {schema}.paused_tasks (
    task_name       text NOT NULL,
    task_version    integer NOT NULL CHECK (task_version >= 0),
    paused_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_name, task_version)
);
-- Tags one a row, for listing by a tag in run-id order (see migrations/0012_retention_and_tags.sql).
CREATE TABLE {schema}.run_tags (
    run_id  uuid NOT NULL REFERENCES {schema}.runs (id) ON DELETE CASCADE,
    key     text NOT NULL,
    value   text NOT NULL,
    PRIMARY KEY (run_id, key)
);
CREATE INDEX run_tags_lookup ON {schema}.run_tags (key, value, run_id);

-- The tombstones of runs deleted by retention: their idempotency keys stay taken.
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
-- A deleted run's facts, found by the ON DELETE CASCADE (0012).
CREATE INDEX facts_by_run ON {schema}.facts (run_id) WHERE run_id IS NOT NULL;

-- Fan-out: groups of a parent's children awaited together (see
-- migrations/0013_child_groups.sql).
CREATE TABLE {schema}.child_groups (
    parent_run_id   uuid NOT NULL,
    name            text NOT NULL,
    total           integer NOT NULL,
    remaining       integer NOT NULL,
    max_concurrency integer,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- Releases due and not made while a held member remains (0015_group_releases.sql).
    owed            integer NOT NULL DEFAULT 0,
    PRIMARY KEY (parent_run_id, name)
);

-- The groups that owe releases: what a worker's pay_group_releases reads (empty nearly always).
CREATE INDEX child_groups_owing ON {schema}.child_groups (parent_run_id, name) WHERE owed > 0;

-- The held members of a group, in input order: the next one to let run is the first entry.
CREATE INDEX runs_group_held ON {schema}.runs (parent_run_id, child_group, group_index)
    WHERE status = 'waiting' AND wait_for = 'umt turn' AND available_at IS NULL;

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
CREATE FUNCTION {schema}.child_group_ended(parent uuid, grp text, released boolean, channel text)
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

-- Rate limits (migration 0014): named token buckets (see umt_sdk._rate_limits.take_tokens),
-- taken in the claim (runs) and by steps, each take under its bucket's row lock.
CREATE INDEX runs_waits_for_limit ON {schema}.runs (waits_for_limit)
    WHERE waits_for_limit IS NOT NULL;

CREATE TABLE {schema}.rate_limits (
    name            text PRIMARY KEY,
    token_limit     integer NOT NULL CHECK (token_limit >= 1),
    per_us          bigint NOT NULL CHECK (per_us >= 1),
    paused          boolean NOT NULL DEFAULT false,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {schema}.rate_buckets (
    limit_name      text NOT NULL,
    bucket_key      text NOT NULL,
    tat             timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (limit_name, bucket_key),
    -- The last wait slot handed out to a run or step with no token (umt_sdk._rate_limits.
    -- park_slot): the next one waits an interval later, so parked runs keep their order
    -- (migration 0017).
    parked_until    timestamptz NOT NULL DEFAULT '-infinity'
) WITH (
    fillfactor = 50, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 100,
    autovacuum_vacuum_cost_delay = 0
);

CREATE TABLE {schema}.rate_grants (
    run_id          uuid NOT NULL REFERENCES {schema}.runs (id) ON DELETE CASCADE,
    step_name       text NOT NULL,
    attempt         integer NOT NULL,
    limit_name      text NOT NULL,
    bucket_key      text NOT NULL,
    granted_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, step_name, attempt)
);

-- Take up to p_wanted tokens of the bucket (p_limit, p_key) now, under its row lock (with
-- p_skip_locked, a bucket another transaction holds is left alone: state 'busy', nothing
-- taken). Each statement reads the newest committed rows (a volatile function in READ
-- COMMITTED), and the limit is read after the bucket is locked, so a change or a resume that
-- locked the limit's buckets first is seen. States: 'taken' (taken > 0), 'wait' (no free
-- token), 'paused', 'unknown' (no such limit: nothing to keep, every token asked for is
-- given), 'busy'. When fewer than p_wanted are taken, next_at is the wait slot of the first
-- left without one (the i-th waits i intervals later; the bucket keeps the last as
-- parked_until); else when the next token is due.
CREATE FUNCTION {schema}.take_rate_tokens(
    p_limit text, p_key text, p_wanted integer, p_skip_locked boolean,
    OUT taken integer, OUT next_at timestamptz, OUT interval_us bigint, OUT state text
) LANGUAGE plpgsql AS $$
DECLARE
    lim record;
    b_tat timestamptz;
    b_parked timestamptz;
    base timestamptz;
    owed bigint;
    free bigint;
BEGIN
    IF p_skip_locked THEN
        SELECT b.tat, b.parked_until INTO b_tat, b_parked FROM {schema}.rate_buckets b
        WHERE b.limit_name = p_limit AND b.bucket_key = p_key
        FOR NO KEY UPDATE SKIP LOCKED;
    ELSE
        SELECT b.tat, b.parked_until INTO b_tat, b_parked FROM {schema}.rate_buckets b
        WHERE b.limit_name = p_limit AND b.bucket_key = p_key
        FOR NO KEY UPDATE;
    END IF;
    IF NOT FOUND THEN
        INSERT INTO {schema}.rate_buckets (limit_name, bucket_key) VALUES (p_limit, p_key)
        ON CONFLICT DO NOTHING
        RETURNING tat, parked_until INTO b_tat, b_parked;
        IF NOT FOUND THEN  -- it exists: another transaction holds it (or just made it)
            IF p_skip_locked THEN
                taken := 0; state := 'busy';
                RETURN;
            END IF;
            SELECT b.tat, b.parked_until INTO b_tat, b_parked FROM {schema}.rate_buckets b
            WHERE b.limit_name = p_limit AND b.bucket_key = p_key
            FOR NO KEY UPDATE;
        END IF;
    END IF;
    SELECT l.token_limit, l.per_us, l.paused INTO lim
    FROM {schema}.rate_limits l WHERE l.name = p_limit;
    IF NOT FOUND THEN
        taken := p_wanted; next_at := now(); state := 'unknown';
        RETURN;
    END IF;
    IF lim.paused THEN
        taken := 0; state := 'paused';
        RETURN;
    END IF;
    interval_us := (lim.per_us + lim.token_limit - 1) / lim.token_limit;
    base := greatest(b_tat, now());
    owed := (extract(epoch FROM base - now()) * 1000000)::bigint;
    free := lim.token_limit - (owed + interval_us - 1) / interval_us;
    taken := greatest(0, least(p_wanted, free));
    base := base + (taken * interval_us) * interval '1 microsecond';
    next_at := base - ((lim.token_limit - 1) * interval_us) * interval '1 microsecond';
    IF taken < p_wanted THEN
        next_at := greatest(next_at, b_parked + interval_us * interval '1 microsecond');
        UPDATE {schema}.rate_buckets SET
            tat = base,
            parked_until = next_at
                + ((p_wanted - taken - 1) * interval_us) * interval '1 microsecond'
        WHERE limit_name = p_limit AND bucket_key = p_key;
    ELSIF taken > 0 THEN
        UPDATE {schema}.rate_buckets SET tat = base
        WHERE limit_name = p_limit AND bucket_key = p_key;
    END IF;
    state := CASE WHEN taken > 0 THEN 'taken' ELSE 'wait' END;
END
$$;

-- Each worker's newest report of itself, for operators (see migrations/0016_workers.sql).
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

-- Published events and the subscribers that refused them (see migrations/0023_events.sql).
CREATE TABLE {schema}.events (
    id              uuid PRIMARY KEY,
    name            text NOT NULL,
    key             text NOT NULL,
    payload         jsonb NOT NULL,
    payload_hash    text NOT NULL,
    trace_context   jsonb NOT NULL DEFAULT '{{}}',
    published_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (name, key)
);
-- The events of a name in the window, oldest first: what a subscriber's pass reads.
CREATE INDEX events_by_name ON {schema}.events (name, published_at, id);
-- The events past the window: what expiry deletes.
CREATE INDEX events_published ON {schema}.events (published_at);

CREATE TABLE {schema}.event_refusals (
    event_id        uuid NOT NULL REFERENCES {schema}.events (id) ON DELETE CASCADE,
    task_name       text NOT NULL,
    task_version    integer NOT NULL,
    reason          text NOT NULL,
    refused_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, task_name)
);
CREATE INDEX event_refusals_newest ON {schema}.event_refusals (refused_at);
