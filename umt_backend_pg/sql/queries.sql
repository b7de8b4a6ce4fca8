-- Named queries of the Postgres backend. Each block starts with `-- name: <query name>`.
-- `{schema}` is replaced by the quoted engine schema; parameters are psycopg placeholders.
--
-- Lookups of one run by id read `runs` by id (and token) alone, in a MATERIALIZED CTE, and test
-- the status afterwards: a `status = ...` next to `id = ...` lets the planner's generic plan
-- pick a partial index whose predicate that status implies (runs_claim_timers for 'running'),
-- and under a held snapshot that index holds every dead running version since it began, so
-- one ending read tens of thousands of entries (tests/integration/test_query_plans.py).

-- name: insert_run
-- One statement: the run, and (only if it was inserted, and when %(notify)s) the NOTIFY that
-- wakes idle workers, delivered at commit. Only an enqueue in the caller's transaction notifies
-- here; the others are notified after their commit, coalesced (see _notifier.py).
-- A run claimable at once (no delay) is also queued in `ready`, in the same statement, unless
-- its pair is paused (it waits in runs_claim_ready: paused runs never hold `ready` rows, which
-- would keep its slots from being truncated); a run with a concurrency key never is (it waits
-- for a slot: runs_claim_keyed), and its key's row counts it (`queued`) and takes the limit it
-- was enqueued with. A run with a rate limit is not queued either: the claim takes its token
-- (claim_runs), finding it in runs_claim_ready as a delayed run.
-- A keyed run is not inserted when the key's run was pruned (its tombstone in `pruned_runs`,
-- one index probe, only for keyed runs); its tags (if any) go to `run_tags`.
-- Its deadline is the earlier of %(deadline_at)s and now() + %(timeout)s (NULL: none given),
-- and it is claimable from its deadline if that comes before its delay ends (the SDK ends it
-- then); its start deadline is when it becomes claimable plus %(start_within)s.
WITH inserted AS (
    INSERT INTO {schema}.runs (
        id, task_name, task_version, status, priority, available_at, idempotency_key,
        input_hash, trace_context, input, queued, parent_run_id, parent_fact,
        cancel_with_parent, rerun_of, forked_from, forked_at_step, concurrency_key,
        count_waiting, tags, deadline_at, start_by, rate_limit, rate_limit_key, debounce_key,
        debounce_until
    )
    SELECT
        %(id)s, %(task_name)s, %(task_version)s, 'pending', %(priority)s,
        least(now() + %(delay)s::interval, d.deadline_at), %(idempotency_key)s::text,
        %(input_hash)s, %(trace_context)s, %(input)s::jsonb,
        %(delay)s::interval <= interval '0' AND %(concurrency_key)s::text IS NULL
        AND %(rate_limit)s::text IS NULL
        AND NOT EXISTS (
            SELECT 1 FROM {schema}.paused_tasks z
            WHERE z.task_name = %(task_name)s AND z.task_version IN (0, %(task_version)s)),
        %(parent_run_id)s::uuid, %(parent_fact)s::text, %(cancel_with_parent)s,
        %(rerun_of)s::uuid, %(forked_from)s::uuid, %(forked_at_step)s::text,
        %(concurrency_key)s::text, %(count_waiting)s, %(tags)s::jsonb, d.deadline_at,
        now() + %(delay)s::interval + %(start_within)s::interval, %(rate_limit)s::text,
        CASE WHEN %(rate_limit)s::text IS NOT NULL THEN %(rate_limit_key)s::text END,
        %(debounce_key)s::text, now() + %(debounce_max_wait)s::interval
    FROM (SELECT least(%(deadline_at)s::timestamptz, now() + %(timeout)s::interval)
              AS deadline_at) AS d
    WHERE %(idempotency_key)s::text IS NULL OR NOT EXISTS (
        SELECT 1 FROM {schema}.pruned_runs t
        WHERE t.task_name = %(task_name)s AND t.idempotency_key = %(idempotency_key)s::text
    )
    ON CONFLICT (task_name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, task_name, task_version, priority, available_at, queued, concurrency_key
), tagged AS (
    INSERT INTO {schema}.run_tags (run_id, key, value)
    SELECT i.id, t.key, t.value FROM inserted i CROSS JOIN jsonb_each_text(%(tags)s::jsonb) AS t
), queued AS (
    INSERT INTO {schema}.ready (run_id, task_name, task_version, priority, available_at, slot)
    SELECT i.id, i.task_name, i.task_version, i.priority, i.available_at, {schema}.ready_slot()
    FROM inserted i WHERE i.queued
), keyed AS (
    INSERT INTO {schema}.concurrency_keys (task_name, concurrency_key, slot_limit, queued, weight)
    SELECT i.task_name, i.concurrency_key, %(concurrency_limit)s, 1, %(fairness_weight)s::integer
    FROM inserted i WHERE i.concurrency_key IS NOT NULL
    ON CONFLICT (task_name, concurrency_key) DO UPDATE SET
        slot_limit = EXCLUDED.slot_limit,
        queued = {schema}.concurrency_keys.queued + 1,
        weight = EXCLUDED.weight
)
SELECT i.id, CASE WHEN %(notify)s::boolean THEN pg_notify(%(channel)s, %(pair)s) END
FROM inserted i;

-- name: lock_flow_key
-- A singleton's or a debounced enqueue: the lock of its (task name, key), held until its
-- transaction ends (migration 0019). Two keys whose hashes collide only wait for each other.
SELECT pg_advisory_xact_lock(hashtextextended(%(lock_name)s, 0));

-- name: active_key_runs
-- The runs of a singleton's key that are not terminal, oldest first (under lock_flow_key).
SELECT id, task_version FROM {schema}.runs
WHERE task_name = %(task_name)s AND concurrency_key = %(concurrency_key)s
  AND status IN ('pending', 'running', 'waiting')
ORDER BY id;

-- name: debounce_run
-- A debounced trigger (under lock_flow_key): the key's run that has not started takes the
-- input and is claimable after the period again, never past its debounce deadline or its
-- deadline. The claim locks the run it takes: the update waits for it, re-checks the run on
-- its newest version, and finds nothing when it was claimed (a new run is stored then).
UPDATE {schema}.runs r SET
    input = %(input)s::jsonb, input_hash = %(input_hash)s,
    available_at = least(now() + %(delay)s::interval, r.debounce_until, r.deadline_at),
    updated_at = now()
WHERE r.id = (
    SELECT d.id FROM {schema}.runs d
    WHERE d.task_name = %(task_name)s AND d.task_version = %(task_version)s
      AND d.debounce_key = %(debounce_key)s AND d.status = 'pending' AND d.claims = 0
    ORDER BY d.id DESC LIMIT 1
) AND r.status = 'pending' AND r.claims = 0 AND NOT r.queued
RETURNING r.id;

-- name: copy_fork
-- A fork's history, in the transaction that inserted it: the step records of the old run it
-- keeps (in the order given, so they read back in that order) and the old run's own facts, as
-- stored (their payloads never leave the database).
WITH kept AS (
    SELECT k.name, k.attempt, k.position
    FROM unnest(%(names)s::text[], %(attempts)s::integer[]) WITH ORDINALITY
        AS k (name, attempt, position)
), steps AS (
    INSERT INTO {schema}.steps (
        run_id, name, attempt, kind, status, fencing_token, output, error, started_at,
        finished_at, wake_at
    )
    SELECT %(id)s, s.name, s.attempt, s.kind, s.status, s.fencing_token, s.output, s.error,
           s.started_at, s.finished_at, s.wake_at
    FROM kept k
    JOIN {schema}.steps s
      ON s.run_id = %(source)s AND s.name = k.name AND s.attempt = k.attempt
    ORDER BY k.position
    RETURNING 1
), facts AS (
    INSERT INTO {schema}.facts (scope, name, run_id, payload, created_at)
    SELECT %(id)s::text, f.name, %(id)s, f.payload, f.created_at
    FROM {schema}.facts f WHERE f.scope = %(source)s::text
    RETURNING 1
)
SELECT (SELECT count(*) FROM steps) AS steps, (SELECT count(*) FROM facts) AS facts,
       EXISTS (SELECT 1 FROM {schema}.runs r WHERE r.id = %(source)s) AS source_found;

-- name: find_idempotent_run
-- The run the key names: the stored one, else the tombstone of the pruned one.
SELECT id, input_hash, task_version, false AS pruned FROM {schema}.runs
WHERE task_name = %(task_name)s AND idempotency_key = %(idempotency_key)s
UNION ALL
(SELECT run_id, input_hash, task_version, true FROM {schema}.pruned_runs
 WHERE task_name = %(task_name)s AND idempotency_key = %(idempotency_key)s
 ORDER BY pruned_at DESC LIMIT 1)
ORDER BY pruned LIMIT 1;

-- name: insert_runs
-- Many runs in one statement (`enqueue_many`), each as insert_run stores one: one row per
-- element of the arrays, in their order (FIFO among equals), skipped when its idempotency key
-- is taken (ON CONFLICT waits for a racing insert of the key to end; the caller then reads
-- the run with find_idempotent_runs) or names a pruned run. Its `ready`, `run_tags` and
-- `concurrency_keys` rows are written by the same statement; a key's row counts all the runs
-- of the batch that hold it, and takes the limit of the last of them.
WITH given AS (
    SELECT g.*, d.deadline_at
    FROM unnest(
        %(ids)b::uuid[], %(task_names)b::text[], %(task_versions)b::integer[],
        %(priorities)b::integer[], %(delays)b::interval[], %(idempotency_keys)b::text[],
        %(input_hashes)b::text[], %(trace_contexts)b::text[], %(inputs)b::text[],
        %(tags)b::text[], %(concurrency_keys)b::text[], %(concurrency_limits)b::integer[],
        %(count_waiting)b::boolean[], %(deadlines)b::timestamptz[], %(timeouts)b::interval[],
        %(start_within)b::interval[], %(rate_limits)b::text[], %(rate_limit_keys)b::text[],
        %(fairness_weights)b::integer[]
    ) WITH ORDINALITY AS g (
        id, task_name, task_version, priority, delay, idempotency_key, input_hash,
        trace_context, input, tags, concurrency_key, concurrency_limit, count_waiting,
        deadline, timeout, start_within, rate_limit, rate_limit_key, fairness_weight, position
    )
    CROSS JOIN LATERAL (SELECT least(g.deadline, now() + g.timeout) AS deadline_at) AS d
), inserted AS (
    INSERT INTO {schema}.runs (
        id, task_name, task_version, status, priority, available_at, idempotency_key,
        input_hash, trace_context, input, queued, concurrency_key, count_waiting, tags,
        deadline_at, start_by, rate_limit, rate_limit_key
    )
    SELECT
        g.id, g.task_name, g.task_version, 'pending', g.priority,
        least(now() + g.delay, g.deadline_at), g.idempotency_key, g.input_hash,
        g.trace_context::jsonb, g.input::jsonb,
        g.delay <= interval '0' AND g.concurrency_key IS NULL AND g.rate_limit IS NULL
        AND NOT EXISTS (
            SELECT 1 FROM {schema}.paused_tasks z
            WHERE z.task_name = g.task_name AND z.task_version IN (0, g.task_version)),
        g.concurrency_key, g.count_waiting, g.tags::jsonb, g.deadline_at,
        now() + g.delay + g.start_within, g.rate_limit,
        CASE WHEN g.rate_limit IS NOT NULL THEN g.rate_limit_key END
    FROM given g
    WHERE g.idempotency_key IS NULL OR NOT EXISTS (
        SELECT 1 FROM {schema}.pruned_runs t
        WHERE t.task_name = g.task_name AND t.idempotency_key = g.idempotency_key
    )
    -- By key, then position: racing batches take their keys' index entries in one order (by
    -- position, two batches of the same keys in other orders deadlocked); a key given twice
    -- is still stored by its first input. The claim's order does not come from this one.
    ORDER BY g.task_name, g.idempotency_key, g.position
    ON CONFLICT (task_name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, task_name, task_version, priority, available_at, queued, concurrency_key,
        tags
), tagged AS (
    INSERT INTO {schema}.run_tags (run_id, key, value)
    SELECT i.id, t.key, t.value FROM inserted i CROSS JOIN jsonb_each_text(i.tags) AS t
), queued AS (
    INSERT INTO {schema}.ready (run_id, task_name, task_version, priority, available_at, slot)
    SELECT i.id, i.task_name, i.task_version, i.priority, i.available_at, {schema}.ready_slot()
    FROM inserted i WHERE i.queued
), keyed AS (
    INSERT INTO {schema}.concurrency_keys (task_name, concurrency_key, slot_limit, queued, weight)
    SELECT i.task_name, i.concurrency_key,
           (array_agg(g.concurrency_limit ORDER BY g.position DESC))[1], count(*),
           (array_agg(g.fairness_weight ORDER BY g.position DESC))[1]
    FROM inserted i JOIN given g ON g.id = i.id
    WHERE i.concurrency_key IS NOT NULL
    GROUP BY i.task_name, i.concurrency_key
    ON CONFLICT (task_name, concurrency_key) DO UPDATE SET
        slot_limit = EXCLUDED.slot_limit,
        queued = {schema}.concurrency_keys.queued + EXCLUDED.queued,
        weight = EXCLUDED.weight
)
SELECT i.id, i.task_name, i.task_version,
       CASE WHEN %(notify)s::boolean
            THEN pg_notify(%(channel)s, i.task_name || '@' || i.task_version) END
FROM inserted i;

-- name: find_idempotent_runs
-- The runs the keys name (find_idempotent_run for many keys of one call): for each
-- (task name, key), the stored run, else the tombstone of the pruned one.
SELECT DISTINCT ON (k.task_name, k.idempotency_key)
       k.task_name, k.idempotency_key, f.id, f.input_hash, f.task_version, f.pruned
FROM unnest(%(task_names)s::text[], %(idempotency_keys)s::text[])
    AS k (task_name, idempotency_key)
CROSS JOIN LATERAL (
    SELECT id, input_hash, task_version, false AS pruned, NULL::timestamptz AS pruned_at
    FROM {schema}.runs r
    WHERE r.task_name = k.task_name AND r.idempotency_key = k.idempotency_key
    UNION ALL
    SELECT run_id, input_hash, task_version, true, pruned_at FROM {schema}.pruned_runs t
    WHERE t.task_name = k.task_name AND t.idempotency_key = k.idempotency_key
) AS f
ORDER BY k.task_name, k.idempotency_key, f.pruned, f.pruned_at DESC;

-- name: notify
SELECT pg_notify(%(channel)s, %(payload)s);

-- name: notify_coalesced
-- The coalesced notifications of enqueues and endings (see _notifier.py): one statement, its
-- own transaction, committed without waiting for the WAL flush, so the server-wide NOTIFY lock
-- that every notifying commit takes is held only for a moment.
SELECT set_config('synchronous_commit', 'off', true), pg_notify(%(channel)s, p.payload)
FROM unnest(%(payloads)s::text[]) AS p (payload);

-- name: ping
-- Is the connection still there (the LISTEN connection, after a quiet while)?
SELECT 1;

-- name: session_settings
-- Run once on each new connection of the engine's pool (PostgresBackend.open): a client that
-- stops between the statements of a transaction has it rolled back, its locks released.
SELECT set_config('idle_in_transaction_session_timeout', %(idle_ms)s, false);

-- name: async_commit
-- This transaction's commit need not wait for its WAL to reach disk (see _all_async_commit).
SET LOCAL synchronous_commit TO off;

-- name: claim_runs
-- Up to %(limit)s runs of the worker's pairs: per pair, runs in `ready` and pending runs not in
-- it (delayed runs, retries, releases) by priority then FIFO, plus, when %(timers)s, runs whose
-- timer came (a sleep's end, a wait's timeout, an expired lease) at or after %(timers_after)s
-- (NULL: ever); pairs take turns (fair slots); each claimed run gets a new token and leaves
-- `ready`.
-- A run whose cancel was requested is handed out like any other, with its reason: the worker
-- ends it canceled without running the handler (the SDK decides what a cancel means).
-- A takeover of an expired lease reports the run's lost leases (the worker applies the limit).
-- Each source offers up to %(scan)s (> %(limit)s) candidates, so rows that a concurrent claim
-- locked or took meanwhile (skipped below) do not leave the batch short. A `ready` row is only a
-- candidate: the run row is locked and its status rechecked.
-- When the timers were read, one row comes back even if nothing was claimed (its id NULL), with
-- `timers_from`: where the next read must start so that no due timer is passed over (the
-- earliest timer offered and not claimed, locked by another claim or beyond %(limit)s; the last
-- one offered of a pair whose timers filled %(scan)s; at most %(timers_margin)s before now, for
-- a writer that commits late), and `timers_left`: some are due still (read again at once).
-- Runs with a concurrency key that want a slot come only from `keyed_runs`: the keys of the
-- pairs' tasks with a free slot and a due run, least recently served first, locked (their
-- newest counters), and at most each key's free slots of its runs; `key_slots` raises the
-- counters of the keys claimed from (see migrations/0009_concurrency_keys.sql). A fairness key
-- (a `weight`) offers its runs in rounds of `weight`, each placed as if ready at the key's
-- `claimed_at` (migrations/0025_fairness_keys.sql).
-- Pairs that a stored pause names (paused_tasks, by version or the whole task) are left out
-- before anything is read: their runs wait as they are. When the timers were read, the row also
-- names them (`paused`): a pair resumed later has timers this read passed over, so the backend
-- reads all timers again once it sees one resumed.
WITH served AS (
    SELECT p.name, p.version,
           EXISTS (SELECT 1 FROM {schema}.paused_tasks z
                   WHERE z.task_name = p.name AND z.task_version IN (0, p.version)) AS paused
    FROM unnest(%(names)s::text[], %(versions)s::integer[]) AS p (name, version)
), pairs AS (
    SELECT s.name, s.version FROM served s WHERE NOT s.paused
), open_keys AS (
    -- Per task, its open keys in turn (concurrency_keys_open gives them in that order), each
    -- tested for a due run as it comes, until %(limit)s keys are locked (each offers a due run:
    -- enough to fill the batch). The test is a scalar subquery in the claim's order, not an
    -- EXISTS: the planner cannot turn it into a join, so it probes runs_claim_keyed (the key's
    -- runs wanting a slot) for the keys it reaches only, never the key's finished runs.
    SELECT o.task_name, o.concurrency_key, o.free, o.claimed_at, o.weight
    FROM (SELECT DISTINCT p.name FROM pairs p) AS n
    CROSS JOIN LATERAL (
        SELECT k.task_name, k.concurrency_key, k.slot_limit - k.running AS free, k.claimed_at,
               k.weight
        FROM {schema}.concurrency_keys k
        WHERE k.task_name = n.name AND k.queued > 0 AND k.running < k.slot_limit
          AND (
              SELECT r.id FROM {schema}.runs r
              WHERE r.task_name = k.task_name AND r.concurrency_key = k.concurrency_key
                AND r.concurrency_key IS NOT NULL
                AND (r.status = 'pending' OR (r.status = 'waiting' AND NOT r.count_waiting))
                AND r.available_at <= now()
                AND r.task_version IN (SELECT p.version FROM pairs p WHERE p.name = k.task_name)
              ORDER BY r.priority DESC, r.available_at
              LIMIT 1) IS NOT NULL
        ORDER BY k.claimed_at
        LIMIT %(limit)s
        FOR NO KEY UPDATE OF k SKIP LOCKED
    ) AS o
), keyed_runs AS (
    -- A fairness key's runs go in rounds of its weight (the i-th in round (i - 1) / weight),
    -- each at its key's turn (claimed_at), ties FIFO (`since`, then the time-ordered id); it
    -- offers as many as it would take if every open key filled its share of %(limit)s (no
    -- other claim takes runs of a key this one locked: %(limit)s, not %(scan)s).
    SELECT w.id, w.task_name, w.task_version, w.priority,
           CASE WHEN k.weight IS NULL THEN 0
                ELSE (row_number() OVER (
                          PARTITION BY k.task_name, k.concurrency_key
                          ORDER BY w.priority DESC, w.available_at, w.id) - 1) / k.weight
           END AS round,
           CASE WHEN k.weight IS NULL THEN w.available_at ELSE k.claimed_at END AS available_at,
           w.available_at AS since
    FROM (SELECT o.*, count(*) OVER () AS keys FROM open_keys o) AS k
    CROSS JOIN LATERAL (
        SELECT r.id, r.task_name, r.task_version, r.priority, r.available_at
        FROM {schema}.runs r
        WHERE r.task_name = k.task_name AND r.concurrency_key = k.concurrency_key
          AND r.concurrency_key IS NOT NULL
          AND (r.status = 'pending' OR (r.status = 'waiting' AND NOT r.count_waiting))
          AND r.available_at <= now()
          AND r.task_version IN (SELECT p.version FROM pairs p WHERE p.name = k.task_name)
        ORDER BY r.priority DESC, r.available_at
        LIMIT least(k.free, %(limit)s, k.weight * ((%(limit)s + k.keys - 1) / k.keys))
    ) AS w
), candidates AS (
    SELECT c.id, c.priority, c.available_at, c.timer, c.keyed, p.name AS pair_name,
           p.version AS pair_version,
           row_number() OVER (
               PARTITION BY p.name, p.version
               ORDER BY c.priority DESC, c.round, c.available_at, c.since, c.id
           ) AS turn
    FROM pairs p
    CROSS JOIN LATERAL (
        (SELECT q.run_id AS id, q.priority, q.available_at, false AS timer, false AS keyed,
                q.available_at AS since, 0 AS round
         FROM {schema}.ready q
         WHERE q.task_name = p.name AND q.task_version = p.version
         ORDER BY q.priority DESC, q.available_at
         LIMIT %(scan)s)
        UNION ALL
        (SELECT r.id, r.priority, r.available_at, false AS timer, false AS keyed,
                r.available_at AS since, 0 AS round
         FROM {schema}.runs r
         WHERE r.task_name = p.name AND r.task_version = p.version
           AND r.status = 'pending' AND NOT r.queued AND r.concurrency_key IS NULL
           AND r.available_at <= now()
         ORDER BY r.priority DESC, r.available_at
         LIMIT %(scan)s)
        UNION ALL
        (SELECT r.id, r.priority, r.available_at, true AS timer, false AS keyed,
                r.available_at AS since, 0 AS round
         FROM {schema}.runs r
         WHERE %(timers)s::boolean
           AND r.task_name = p.name AND r.task_version = p.version
           AND r.status IN ('waiting', 'running')
           AND r.available_at >= COALESCE(%(timers_after)s::timestamptz, '-infinity')
           AND r.available_at <= now()
           AND (r.status = 'waiting' OR r.lease_expires_at <= now())
           -- a waiting run that gave its slot back needs one again: keyed_runs
           AND NOT (r.status = 'waiting' AND r.concurrency_key IS NOT NULL
                    AND NOT r.count_waiting)
         ORDER BY r.available_at
         LIMIT %(scan)s)
        UNION ALL
        (SELECT k.id, k.priority, k.available_at, false AS timer, true AS keyed, k.since,
                k.round
         FROM keyed_runs k
         WHERE k.task_name = p.name AND k.task_version = p.version
         ORDER BY k.priority DESC, k.round, k.available_at, k.since
         LIMIT %(scan)s)
    ) AS c
), distinct_candidates AS (
    -- A woken waiting run is in `ready` and among the timers: offer it once.
    SELECT DISTINCT ON (c.id) c.id, c.priority, c.available_at, c.turn, c.keyed
    FROM candidates c
    ORDER BY c.id, c.turn
), locked AS (
    SELECT r.id, r.status AS previous_status, r.fencing_token AS previous_token,
           CASE WHEN r.status = 'running' THEN r.lease_expires_at ELSE r.available_at END
               AS ready_at,
           c.keyed, c.turn, c.priority,
           -- A start of a run with a rate limit takes a token (see tokens), unless the worker
           -- will end the run without running it (its cancel, its deadline, its start deadline).
           r.rate_limit IS NOT NULL
               AND (r.status = 'pending' OR (r.status = 'waiting' AND r.claims = 0))
               AND r.cancel_requested_at IS NULL
               AND (r.deadline_at IS NULL OR r.deadline_at > now())
               AND (r.claims > 0 OR r.start_by IS NULL OR r.start_by > now()) AS limited,
           r.rate_limit, r.rate_limit_key
    FROM distinct_candidates c
    JOIN {schema}.runs r ON r.id = c.id
    WHERE r.status IN ('pending', 'waiting', 'running') AND r.available_at <= now()
      AND (r.status <> 'running' OR r.lease_expires_at <= now())
      -- A run that wants a slot is claimed only from its key's free slots (keyed_runs), and a
      -- run from there only while it still wants one.
      AND c.keyed = (r.concurrency_key IS NOT NULL
                     AND (r.status = 'pending' OR (r.status = 'waiting' AND NOT r.count_waiting)))
    ORDER BY c.turn, c.priority DESC, c.available_at
    LIMIT %(limit)s
    FOR UPDATE OF r SKIP LOCKED
), token_wants AS (
    SELECT l.rate_limit, l.rate_limit_key, count(*)::integer AS wanted
    FROM locked l WHERE l.limited
    GROUP BY l.rate_limit, l.rate_limit_key
), tokens AS (
    -- One take per bucket the batch starts runs of, under the bucket's row lock (a bucket
    -- another claim holds is skipped: its runs stay as they are). Never called for runs
    -- without a rate limit.
    SELECT w.rate_limit, w.rate_limit_key, t.taken, t.next_at, t.interval_us, t.state
    FROM token_wants w
    CROSS JOIN LATERAL {schema}.take_rate_tokens(
        w.rate_limit, w.rate_limit_key, w.wanted, true) AS t
), token_turns AS (
    -- The runs of each bucket in the claim's order: the first `taken` start, the others park.
    SELECT l.id, t.taken, t.next_at, t.interval_us, t.state,
           row_number() OVER (
               PARTITION BY l.rate_limit, l.rate_limit_key
               ORDER BY l.turn, l.priority DESC, l.ready_at
           ) AS place
    FROM locked l
    JOIN tokens t ON t.rate_limit = l.rate_limit AND t.rate_limit_key = l.rate_limit_key
    WHERE l.limited
), parked AS (
    -- No token: back until its wait slot (the bucket's next token, or an interval after the
    -- last run it parked: the i-th of the batch i intervals after the first), never past the
    -- run's deadline; under a paused limit until a resume (or the deadline).
    UPDATE {schema}.runs r SET
        waits_for_limit = r.rate_limit,
        queued = false,
        available_at = least(
            CASE WHEN t.state <> 'paused'
                 THEN t.next_at + ((t.place - t.taken - 1) * t.interval_us)
                                  * interval '1 microsecond' END,
            r.deadline_at,
            CASE WHEN r.claims = 0 THEN r.start_by END),
        updated_at = now()
    FROM token_turns t
    WHERE r.id = t.id AND t.place > t.taken AND t.state IN ('taken', 'wait', 'paused')
    RETURNING r.id
), unqueued AS (
    DELETE FROM {schema}.ready q USING parked p WHERE q.run_id = p.id
), claimed AS (
    UPDATE {schema}.runs r SET
        status = 'running',
        queued = false,
        claims = r.claims + 1,
        fencing_token = {schema}.next_fencing_token(),
        lease_expirations = r.lease_expirations
            + CASE WHEN l.previous_status = 'running' THEN 1 ELSE 0 END,
        lease_owner = %(worker_id)s,
        available_at = now() + %(lease)s::interval,
        lease_expires_at = now() + %(lease)s::interval,
        wait_for = NULL,
        waits_for_limit = NULL,
        updated_at = now()
    FROM locked l
    WHERE r.id = l.id
      AND (NOT l.limited OR l.id IN (SELECT t.id FROM token_turns t WHERE t.place <= t.taken))
    RETURNING r.id, r.task_name, r.task_version, r.input, r.priority, r.fencing_token,
              r.claims, r.failures, r.trace_context, r.idempotency_key, l.previous_status,
              l.previous_token, l.ready_at, r.forked_from IS NOT NULL AS forked, l.keyed,
              r.concurrency_key,
              CASE WHEN r.cancel_requested_at IS NOT NULL
                   THEN COALESCE(r.cancel_reason, '') END AS cancel_reason,
              r.deadline_at, r.start_by
), dequeued AS (
    DELETE FROM {schema}.ready q USING claimed c WHERE q.run_id = c.id
), key_slots AS (
    -- The keys' rows are locked (open_keys): the runs taken now hold a slot, want none.
    UPDATE {schema}.concurrency_keys k SET
        running = k.running + t.taken, queued = k.queued - t.taken, claimed_at = now()
    FROM (SELECT c.task_name, c.concurrency_key, count(*) AS taken FROM claimed c
          WHERE c.keyed GROUP BY c.task_name, c.concurrency_key) AS t
    WHERE k.task_name = t.task_name AND k.concurrency_key = t.concurrency_key
), interrupted AS (
    UPDATE {schema}.executions e SET outcome = 'interrupted', ended_at = now()
    FROM claimed c
    WHERE c.previous_status = 'running' AND e.run_id = c.id
      AND e.fencing_token = c.previous_token AND e.outcome = 'running'
), started AS (
    INSERT INTO {schema}.executions (run_id, fencing_token, worker_id, claimed_at, outcome)
    SELECT c.id, c.fencing_token, %(worker_id)s, now(), 'running'
    FROM claimed c
), timers_due AS (
    SELECT least(
        (SELECT min(c.available_at) FROM candidates c
         WHERE c.timer AND c.id NOT IN (SELECT l.id FROM locked l)),
        (SELECT min(t.last_offered) FROM (
             SELECT max(c.available_at) AS last_offered FROM candidates c WHERE c.timer
             GROUP BY c.pair_name, c.pair_version HAVING count(*) >= %(scan)s) AS t)
    ) AS due_from
), timers_read AS (
    SELECT least(d.due_from, now() - %(timers_margin)s::interval) AS timers_from,
           d.due_from IS NOT NULL AS timers_left,
           ARRAY(SELECT s.name || '@' || s.version FROM served s WHERE s.paused) AS paused
    FROM timers_due d WHERE %(timers)s::boolean
)
SELECT c.id, c.task_name, c.task_version, c.input::text AS input, c.priority,
       c.fencing_token, now() AS claimed_at, c.claims, c.failures, c.trace_context, c.ready_at,
       c.cancel_reason, c.idempotency_key, c.deadline_at, c.start_by, t.timers_from,
       t.timers_left, t.paused,
       -- A fork's first claim replays the step records it kept.
       CASE WHEN c.claims > 1 OR c.forked THEN (
           SELECT json_agg(json_build_object(
               'name', s.name, 'kind', s.kind, 'status', s.status, 'attempt', s.attempt,
               'fencing_token', s.fencing_token, 'output', s.output::text, 'error', s.error,
               'started_at', s.started_at, 'finished_at', s.finished_at,
               'wake_at', s.wake_at) ORDER BY s.seq)
           FROM {schema}.steps s WHERE s.run_id = c.id
       ) END AS steps,
       -- A takeover: the leases lost since the newest step record, this one included (the
       -- old execution is marked interrupted above, which this snapshot does not see yet).
       CASE WHEN c.previous_status = 'running' THEN 1 + (
           SELECT count(*) FROM {schema}.executions e
           WHERE e.run_id = c.id AND e.outcome = 'interrupted'
             AND e.fencing_token >= COALESCE(
                 (SELECT max(s.fencing_token) FROM {schema}.steps s WHERE s.run_id = c.id), 0)
       ) ELSE 0 END AS lost_leases
FROM claimed c
FULL JOIN timers_read t ON true;

-- name: rotate_ready
-- Every half second a worker's backend offers to truncate the next `ready` slot.
SELECT {schema}.rotate_ready(%(max_moved)s) AS outcome;

-- name: sweep_ready
-- A queued run (pending, `queued`) whose `ready` row is gone would never be claimed: every 30 s
-- a worker pages through the queued runs older than %(grace)s, %(page)s at a time from where it
-- stopped (%(after_at)s, %(after_id)s; NULL: the oldest), and hands each one with no `ready`
-- row back to runs_claim_ready (queued = false), where the claim finds it in its order. Every
-- write that queues, claims, moves or drops a `ready` row does so in the statement that changes
-- the run, and a statement reads `ready` only after its lock: nothing in flight looks lost.
WITH page AS MATERIALIZED (
    SELECT r.id, r.available_at FROM {schema}.runs r
    WHERE r.status = 'pending' AND r.queued
      AND r.available_at <= now() - %(grace)s::interval
      AND (r.available_at, r.id) > (COALESCE(%(after_at)s::timestamptz, '-infinity'),
                                    COALESCE(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'))
    ORDER BY r.available_at, r.id
    LIMIT %(page)s
), lost AS (
    SELECT r.id FROM page p
    JOIN {schema}.runs r ON r.id = p.id
    WHERE r.status = 'pending' AND r.queued
      AND NOT EXISTS (SELECT 1 FROM {schema}.ready q WHERE q.run_id = p.id)
    FOR NO KEY UPDATE OF r SKIP LOCKED
), requeued AS (
    UPDATE {schema}.runs r SET queued = false FROM lost l WHERE r.id = l.id RETURNING r.id
), last AS (
    SELECT p.available_at, p.id FROM page p ORDER BY p.available_at DESC, p.id DESC LIMIT 1
)
SELECT (SELECT count(*) FROM page) AS scanned, (SELECT count(*) FROM requeued) AS requeued,
       (SELECT available_at FROM last) AS last_at, (SELECT id FROM last) AS last_id;

-- name: pay_group_releases
-- Releases that maps owe (see migrations/0015_group_releases.sql): about once a second a
-- worker takes up to %(limit)s groups that owe (the partial index child_groups_owing: an empty
-- index nearly always), each locked unless another write holds it (that write pays first),
-- and lets their held members run as far as they are free (release_held); what is still owed
-- stays for the next pass.
WITH owing AS (
    SELECT g.parent_run_id, g.name, g.owed FROM {schema}.child_groups g
    WHERE g.owed > 0
    LIMIT %(limit)s
    FOR NO KEY UPDATE SKIP LOCKED
), paid AS (
    UPDATE {schema}.child_groups g
    SET owed = {schema}.release_held(o.parent_run_id, o.name, o.owed, %(channel)s)
    FROM owing o
    WHERE g.parent_run_id = o.parent_run_id AND g.name = o.name
    RETURNING o.owed - g.owed AS released
)
SELECT count(*) AS groups, COALESCE(sum(released), 0) AS released FROM paid;

-- name: heartbeat
-- A run row another transaction holds locked is not waited for (SKIP LOCKED): above all the
-- worker's own transactional step committing (its record statement locks the row and moves
-- the lease on; a commit slower than the lease, waiting for deferred triggers or a standby,
-- made this statement wait, the worker's heartbeat time out and every run of the worker lose
-- its lease). Such a row is reported held if it is still running under the token as last
-- committed (`busy`), its lease left as it is and said so (`unrenewed`: the worker does not
-- count on a renewal it did not get); a claim or a cancel in flight is seen at the next beat,
-- and every write of the execution is fenced meanwhile.
WITH beats AS (
    SELECT b.id, b.token, b.step, b.step_started_at
    FROM unnest(%(ids)s::uuid[], %(tokens)s::bigint[], %(steps)s::text[],
                %(step_started)s::timestamptz[]) AS b (id, token, step, step_started_at)
), locked AS (
    SELECT r.id, r.status FROM {schema}.runs r
    JOIN beats b ON r.id = b.id AND r.fencing_token = b.token
    ORDER BY r.id
    FOR NO KEY UPDATE OF r SKIP LOCKED
), busy AS (
    -- Each beat's run read by its id alone (OFFSET 0 keeps the lookup a probe of the primary
    -- key: joined, the planner may read the running runs through runs_claim_timers instead).
    SELECT r.id, r.cancel_requested_at, r.cancel_reason
    FROM beats b
    CROSS JOIN LATERAL (
        SELECT r.id, r.status, r.fencing_token, r.cancel_requested_at, r.cancel_reason
        FROM {schema}.runs r WHERE r.id = b.id
        OFFSET 0
    ) AS r
    WHERE r.fencing_token = b.token AND r.status = 'running'
      AND NOT EXISTS (SELECT FROM locked l WHERE l.id = b.id)
), extended AS (
    UPDATE {schema}.runs r SET
        lease_expires_at = now() + %(lease)s::interval,
        available_at = now() + %(lease)s::interval
    FROM locked l
    WHERE r.id = l.id AND l.status = 'running'
    RETURNING r.id, r.cancel_requested_at, r.cancel_reason
), noted AS (
    UPDATE {schema}.executions e SET current_step = b.step, step_started_at = b.step_started_at
    FROM beats b
    JOIN extended x ON x.id = b.id
    WHERE e.run_id = b.id AND e.fencing_token = b.token
      AND e.current_step IS DISTINCT FROM b.step
)
SELECT b.id, x.id IS NOT NULL OR u.id IS NOT NULL AS held,
       x.id IS NULL AND u.id IS NOT NULL AS unrenewed,
       coalesce(x.cancel_requested_at, u.cancel_requested_at) IS NOT NULL AS cancel_requested,
       coalesce(x.cancel_reason, u.cancel_reason) AS cancel_reason
FROM beats b
LEFT JOIN extended x ON x.id = b.id
LEFT JOIN busy u ON u.id = b.id;

-- name: record_steps
-- One round trip, one commit for a batch of checkpoints (group commit): each step record lands
-- only if its run's token still holds; the lease is extended only once half of it is gone
-- (heartbeats keep it fresh). Run rows are share-locked, not rewritten: a takeover waits.
WITH items AS (
    SELECT *
    FROM unnest(
        %(run_ids)s::uuid[], %(tokens)s::bigint[], %(leases)s::interval[], %(names)s::text[],
        %(attempts)s::integer[], %(kinds)s::text[], %(statuses)s::text[], %(outputs)s::text[],
        %(errors)s::text[], %(started)s::timestamptz[], %(finished)s::timestamptz[],
        %(wakes)s::timestamptz[]
    ) AS i (run_id, token, lease, name, attempt, kind, status, output, error, started_at,
            finished_at, wake_at)
), locked AS (
    SELECT r.id, r.fencing_token, r.lease_expires_at, r.status
    FROM {schema}.runs r
    WHERE r.id IN (SELECT run_id FROM items)
    FOR KEY SHARE
), owned AS (
    SELECT l.id, l.fencing_token, l.lease_expires_at FROM locked l WHERE l.status = 'running'
), extended AS (
    UPDATE {schema}.runs r SET lease_expires_at = now() + i.lease
    FROM owned o
    JOIN items i ON i.run_id = o.id AND i.token = o.fencing_token
    WHERE r.id = o.id AND o.lease_expires_at < now() + i.lease / 2
), cleared AS (
    UPDATE {schema}.executions e SET current_step = NULL, step_started_at = NULL
    FROM items i
    JOIN owned o ON o.id = i.run_id AND o.fencing_token = i.token
    WHERE e.run_id = i.run_id AND e.fencing_token = i.token AND e.current_step = i.name
)
INSERT INTO {schema}.steps (
    run_id, name, attempt, kind, status, fencing_token, output, error,
    started_at, finished_at, wake_at
)
SELECT i.run_id, i.name, i.attempt, i.kind, i.status, i.token, i.output::jsonb,
       i.error::jsonb, i.started_at, i.finished_at, i.wake_at
FROM items i
JOIN owned o ON o.id = i.run_id AND o.fencing_token = i.token
ON CONFLICT (run_id, name, attempt) DO UPDATE SET
    kind = EXCLUDED.kind, status = EXCLUDED.status, fencing_token = EXCLUDED.fencing_token,
    output = EXCLUDED.output, error = EXCLUDED.error, started_at = EXCLUDED.started_at,
    finished_at = EXCLUDED.finished_at, wake_at = EXCLUDED.wake_at
WHERE {schema}.steps.fencing_token <= EXCLUDED.fencing_token
RETURNING run_id, name, attempt;

-- name: lock_fact_name_shared
SELECT pg_advisory_xact_lock_shared(hashtextextended(%(name)s, 7219));

-- name: lock_fact_name
SELECT pg_advisory_xact_lock(hashtextextended(%(name)s, 7219));

-- name: end_execution
-- The one ending write (`Ending`: the SDK's decision, stored as given), fenced. Refused, with
-- nothing changed, when the awaited fact is already stored (`present`) or when the ending hands
-- the run back (pending, waiting) although its cancel was requested (`canceled`). With a
-- %(wait_for)s, run after lock_fact_name_shared, in a new statement of the same transaction,
-- so a concurrent signal is either seen here or sees this run waiting. A canceled execution
-- keeps the step it was in (the worker names it with a last beat): the timeline shows it.
-- An ending that finishes a child writes its parent's row (the fact and wake-up, or its
-- group's last member's) after its own: it locks the parent first (`parent_locked`, an
-- InitPlan run before `locked` takes the child's row), the order a cancel of the parent takes
-- (its row, then its children's), so the two cannot deadlock (test_family_lock_order.py).
WITH parent_locked AS MATERIALIZED (
    SELECT p.id FROM {schema}.runs p
    WHERE %(status)s::text IN ('completed', 'failed', 'canceled', 'compensated')
      AND p.id = (SELECT c.parent_run_id FROM {schema}.runs c WHERE c.id = %(run_id)s)
    FOR NO KEY UPDATE
), locked AS (
    SELECT id, status, cancel_requested_at IS NOT NULL AS cancel_requested FROM {schema}.runs
    WHERE id = %(run_id)s AND fencing_token = %(token)s
      AND (SELECT count(*) FROM parent_locked) >= 0
    FOR NO KEY UPDATE
), owned AS (
    SELECT id, cancel_requested FROM locked WHERE status = 'running'
), present AS (
    SELECT 1 FROM {schema}.facts
    WHERE %(wait_for)s::text IS NOT NULL AND name = %(wait_for)s
      AND scope IN (%(run_id)s::text, '*')
    LIMIT 1
), go AS (
    SELECT o.id FROM owned o
    WHERE NOT EXISTS (SELECT 1 FROM present)
      AND NOT (o.cancel_requested AND %(status)s::text IN ('pending', 'waiting'))
), step AS (
    -- Stored as record_steps stores a step (under the lease's token, replacing the same try,
    -- never over a newer token's record), without an output: an ending's step never carries
    -- one (`Ending` refuses it), it is the record that parks the run.
    INSERT INTO {schema}.steps (
        run_id, name, attempt, kind, status, fencing_token, started_at, finished_at,
        wake_at, error
    )
    SELECT g.id, %(step_name)s, %(step_attempt)s, %(step_kind)s, %(step_status)s, %(token)s,
           %(step_started_at)s, %(step_finished_at)s, %(step_wake_at)s, %(step_error)s::jsonb
    FROM go g WHERE %(step_name)s::text IS NOT NULL
    ON CONFLICT (run_id, name, attempt) DO UPDATE SET
        kind = EXCLUDED.kind, status = EXCLUDED.status, fencing_token = EXCLUDED.fencing_token,
        error = EXCLUDED.error, started_at = EXCLUDED.started_at,
        finished_at = EXCLUDED.finished_at, wake_at = EXCLUDED.wake_at
    WHERE {schema}.steps.fencing_token <= EXCLUDED.fencing_token
), ended_run AS (
    UPDATE {schema}.runs r SET
        status = %(status)s,
        output = COALESCE(%(output)s::jsonb, r.output),
        error = COALESCE(%(error)s::jsonb, r.error),
        failures = r.failures + %(add_failure)s,
        available_at = CASE
            WHEN %(status)s = 'pending' THEN COALESCE(%(available_at)s::timestamptz, now())
            WHEN %(status)s = 'waiting' THEN %(available_at)s::timestamptz END,
        wait_for = %(wait_for)s,
        finished_at = CASE WHEN %(status)s IN ('completed', 'failed', 'canceled', 'compensated')
                           THEN now() END,
        lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
    FROM go g WHERE r.id = g.id
    RETURNING r.id, r.parent_run_id, r.parent_fact, r.task_name, r.task_version,
              r.concurrency_key, r.count_waiting, r.child_group
), key_slot AS (
    -- A run with a key held a slot while running: it gives it back unless it waits holding
    -- it (`count_waiting`), and wants one again when handed back or parked without it. Runs
    -- without a key read nothing here (a NULL key matches no row).
    UPDATE {schema}.concurrency_keys k SET
        running = k.running
            - CASE WHEN %(status)s::text = 'waiting' AND x.count_waiting THEN 0 ELSE 1 END,
        queued = k.queued
            + CASE WHEN %(status)s::text = 'pending'
                        OR (%(status)s::text = 'waiting' AND NOT x.count_waiting)
                   THEN 1 ELSE 0 END
    FROM ended_run x
    WHERE k.task_name = x.task_name AND k.concurrency_key = x.concurrency_key
    RETURNING x.task_name, x.task_version, k.queued > 0 AND k.running < k.slot_limit AS opened
), ended AS (
    UPDATE {schema}.executions e SET outcome = %(outcome)s, ended_at = now(),
        current_step = CASE WHEN %(outcome)s::text = 'canceled' THEN e.current_step END,
        step_started_at = CASE WHEN %(outcome)s::text = 'canceled' THEN e.step_started_at END
    FROM ended_run x WHERE e.run_id = x.id AND e.fencing_token = %(token)s
), child_fact AS (
    -- A child that finishes stores its parent's fact (see finish_child, which does the same
    -- for a cancel): nothing for a run that is not a child.
    INSERT INTO {schema}.facts (scope, name, run_id, payload)
    SELECT x.parent_run_id::text, x.parent_fact, x.parent_run_id, 'null'::jsonb
    FROM ended_run x
    WHERE x.parent_fact IS NOT NULL AND %(status)s::text IN ('completed', 'failed', 'canceled', 'compensated')
    ON CONFLICT (scope, name) DO NOTHING
    RETURNING run_id, name
), parent_woken AS (
    -- By id alone, the test in the SET: a parent parking right now holds its row (lock_run),
    -- so this waits for its park to commit and then reads it waiting (a concurrent update is
    -- re-read before the SET is computed); or the park, after this commits, sees the fact.
    UPDATE {schema}.runs p SET
        available_at = CASE WHEN p.status = 'waiting' AND p.wait_for = f.name
                            THEN now() ELSE p.available_at END
    FROM child_fact f WHERE p.id = f.run_id
    RETURNING p.id, p.task_name, p.task_version, p.priority, p.available_at,
              p.status = 'waiting' AND p.wait_for = f.name AS woken,
              p.concurrency_key IS NULL OR p.count_waiting AS holds
), parent_queued AS (
    -- A keyed parent that gave its slot back is claimed through runs_claim_keyed instead.
    INSERT INTO {schema}.ready (run_id, task_name, task_version, priority, available_at, slot)
    SELECT w.id, w.task_name, w.task_version, w.priority, w.available_at, {schema}.ready_slot()
    FROM parent_woken w WHERE w.woken AND w.holds
), group_ended AS (
    -- A member of a child group counts itself out (see child_group_ended in schema.sql): it
    -- ran, so it also lets the group's next held member run. Nothing for other runs.
    SELECT {schema}.child_group_ended(x.parent_run_id, x.child_group, true, %(channel)s)
    FROM ended_run x
    WHERE x.child_group IS NOT NULL
      AND %(status)s::text IN ('completed', 'failed', 'canceled', 'compensated')
)
SELECT (SELECT count(*) FROM owned) AS owned,
       (SELECT count(*) FROM ended_run) AS ended,
       EXISTS (SELECT 1 FROM present) AS fact_present,
       (SELECT pg_notify(%(channel)s, string_agg(w.task_name || '@' || w.task_version, ','))
        FROM parent_woken w WHERE w.woken HAVING count(*) > 0) AS notified,
       -- A slot freed with runs of the key waiting for it: workers look now.
       (SELECT pg_notify(%(channel)s, string_agg(s.task_name || '@' || s.task_version, ','))
        FROM key_slot s WHERE s.opened HAVING count(*) > 0) AS slot_notified,
       (SELECT count(*) FROM group_ended) AS group_ended;

-- name: insert_fact
-- The fact, and (if it is new) the runs waiting for it woken: claimable now, queued in `ready`.
-- A fact for one run reads that run by id alone (see the note at the top); a broadcast fact
-- reads the runs waiting for its name through runs_waiting_for.
WITH fact AS (
    INSERT INTO {schema}.facts (scope, name, run_id, payload)
    VALUES (COALESCE(%(run_id)s::uuid::text, '*'), %(name)s, %(run_id)s::uuid, %(payload)s::jsonb)
    ON CONFLICT (scope, name) DO NOTHING
    RETURNING 1
), own AS MATERIALIZED (
    SELECT r.id, r.status, r.wait_for FROM {schema}.runs r
    WHERE %(run_id)s::uuid IS NOT NULL AND r.id = %(run_id)s AND EXISTS (SELECT 1 FROM fact)
    FOR NO KEY UPDATE
), broadcast AS (
    SELECT r.id, r.status, r.wait_for FROM {schema}.runs r
    WHERE %(run_id)s::uuid IS NULL AND r.status = 'waiting' AND r.wait_for = %(name)s
      AND EXISTS (SELECT 1 FROM fact)
    FOR NO KEY UPDATE
), waiters AS (
    SELECT id, status, wait_for FROM own UNION ALL SELECT id, status, wait_for FROM broadcast
), woken AS (
    UPDATE {schema}.runs r SET available_at = now(), updated_at = now()
    FROM waiters w
    WHERE r.id = w.id AND w.status = 'waiting' AND w.wait_for = %(name)s
    RETURNING r.id, r.task_name, r.task_version, r.priority, r.available_at,
              r.concurrency_key IS NULL OR r.count_waiting AS holds
), queued AS (
    -- A keyed run that gave its slot back is claimed through runs_claim_keyed instead.
    INSERT INTO {schema}.ready (run_id, task_name, task_version, priority, available_at, slot)
    SELECT w.id, w.task_name, w.task_version, w.priority, w.available_at, {schema}.ready_slot()
    FROM woken w WHERE w.holds
)
SELECT (SELECT count(*) FROM fact) AS stored,
       (SELECT pg_notify(%(channel)s, string_agg(DISTINCT task_name || '@' || task_version, ','))
        FROM woken HAVING count(*) > 0) AS notified;

-- name: get_facts
SELECT name, run_id, payload::text AS payload, created_at FROM {schema}.facts
WHERE name = %(name)s AND scope IN (%(run_id)s::text, '*');

-- name: lock_for_cancel
-- Before cancel_run, in its transaction: the run's parent's row (an unfinished child's), then
-- the run's own. A child that ends writes its parent's row after its own (finish_child,
-- group_member_canceled), and a cancel of a parent takes the parent's row, then the
-- children's (cancel_children): parent first everywhere (see end_execution), so the two cannot
-- deadlock. In a statement of its own, so that cancel_run, once these are granted, reads what
-- the writes it waited for committed.
WITH parent_locked AS MATERIALIZED (
    SELECT p.id FROM {schema}.runs p
    WHERE p.id = (SELECT c.parent_run_id FROM {schema}.runs c
                  WHERE c.id = %(run_id)s AND c.status NOT IN ('completed', 'failed', 'canceled', 'compensated'))
    FOR NO KEY UPDATE
)
SELECT 1 FROM {schema}.runs
WHERE id = %(run_id)s AND (SELECT count(*) FROM parent_locked) >= 0
FOR NO KEY UPDATE;

-- name: dequeue_runs
-- After a cascade (cancel_children), in its transaction: the `ready` rows of the runs it ended,
-- read afresh. cancel_children deletes them too, but a row it waited for (a signal that woke
-- the child and queued it) was committed after its snapshot: left, it would keep a slot of
-- the claim's scan until a rotation dropped it. The runs are canceled and locked by this
-- transaction: nothing queues them again.
DELETE FROM {schema}.ready WHERE run_id = ANY (%(run_ids)s::uuid[]);

-- name: cancel_run
-- The request is stored once (a later cancel keeps the first time and reason). A run nobody
-- holds ends canceled at once (`ends`): pending, waiting, or running with a lapsed lease
-- (`lapsed`, judged here once, by the database's clock: its holder is gone, and the lease is
-- counted and its execution interrupted as a takeover would). A held run keeps running: its
-- holder reads the request from its heartbeat. A finished run is left as it is (`status` NULL).
-- Run after lock_for_cancel, in a new statement of its transaction: its snapshot sees what
-- was committed before those locks were granted (a wake-up's `ready` row, which `dequeued`
-- must delete).
WITH target AS (
    SELECT r.id, r.status, r.fencing_token, n.lapsed,
           r.status IN ('pending', 'waiting') OR n.lapsed AS ends,
           r.task_name, r.task_version, r.concurrency_key, r.count_waiting,
           r.status = 'waiting' AND r.wait_for = 'umt turn' AND r.available_at IS NULL
               AS held
    FROM {schema}.runs r
    CROSS JOIN LATERAL (
        SELECT r.status = 'running' AND r.lease_expires_at <= now() AS lapsed
    ) AS n
    WHERE r.id = %(run_id)s
    FOR NO KEY UPDATE OF r
), changed AS (
    UPDATE {schema}.runs r SET
        cancel_requested_at = COALESCE(r.cancel_requested_at, now()),
        cancel_reason = COALESCE(r.cancel_reason, %(reason)s),
        status = CASE WHEN t.ends THEN 'canceled' ELSE r.status END,
        lease_expirations = r.lease_expirations + CASE WHEN t.lapsed THEN 1 ELSE 0 END,
        finished_at = CASE WHEN t.ends THEN now() ELSE r.finished_at END,
        available_at = CASE WHEN t.ends THEN NULL ELSE r.available_at END,
        lease_owner = CASE WHEN t.ends THEN NULL ELSE r.lease_owner END,
        lease_expires_at = CASE WHEN t.ends THEN NULL ELSE r.lease_expires_at END,
        wait_for = NULL,
        updated_at = now()
    FROM target t
    WHERE r.id = t.id AND t.status NOT IN ('completed', 'failed', 'canceled', 'compensated')
    RETURNING r.id, r.status
), dequeued AS (
    DELETE FROM {schema}.ready q USING changed c WHERE q.run_id = c.id AND c.status = 'canceled'
), key_slot AS (
    -- A keyed run that ends gives back the slot it held (running; waiting with
    -- count_waiting) or stops wanting one (pending; waiting without it).
    UPDATE {schema}.concurrency_keys k SET
        running = k.running - CASE WHEN t.status = 'running'
                                        OR (t.status = 'waiting' AND t.count_waiting)
                                   THEN 1 ELSE 0 END,
        queued = k.queued - CASE WHEN t.status = 'pending'
                                      OR (t.status = 'waiting' AND NOT t.count_waiting)
                                 THEN 1 ELSE 0 END
    FROM target t
    JOIN changed c ON c.id = t.id AND c.status = 'canceled'
    WHERE k.task_name = t.task_name AND k.concurrency_key = t.concurrency_key
    RETURNING t.task_name, t.task_version, k.queued > 0 AND k.running < k.slot_limit AS opened
), interrupted AS (
    UPDATE {schema}.executions e SET outcome = 'interrupted', ended_at = now()
    FROM target t
    WHERE t.lapsed AND e.run_id = t.id AND e.fencing_token = t.fencing_token
)
SELECT c.status,
       -- A slot freed with runs of the key waiting for it: workers look now.
       (SELECT pg_notify(%(channel)s, s.task_name || '@' || s.task_version)
        FROM key_slot s WHERE s.opened) AS slot_notified,
       t.held
FROM target t LEFT JOIN changed c ON c.id = t.id;

-- name: lock_run
-- Before a park on a fact: the run's own row, held until the park commits, so a child that
-- finishes meanwhile (end_execution's parent_woken, finish_child) waits for the park and then
-- wakes it, or committed first and the park's next statement sees its fact.
SELECT 1 FROM {schema}.runs WHERE id = %(run_id)s AND fencing_token = %(token)s
FOR NO KEY UPDATE;

-- name: finish_child
-- What a cancel that finished a child run also stores, in its transaction: the fact for its
-- parent (payload null, first write wins), and the parent woken if it waits for it (claimable
-- now, queued in `ready`, workers notified), as end_execution's child_fact and parent_woken do.
WITH child AS MATERIALIZED (
    SELECT parent_run_id, parent_fact FROM {schema}.runs
    WHERE id = %(run_id)s AND parent_fact IS NOT NULL
      AND status IN ('completed', 'failed', 'canceled', 'compensated')
), fact AS (
    INSERT INTO {schema}.facts (scope, name, run_id, payload)
    SELECT c.parent_run_id::text, c.parent_fact, c.parent_run_id, 'null'::jsonb FROM child c
    ON CONFLICT (scope, name) DO NOTHING
    RETURNING run_id, name
), woken AS (
    UPDATE {schema}.runs p SET
        available_at = CASE WHEN p.status = 'waiting' AND p.wait_for = f.name
                            THEN now() ELSE p.available_at END
    FROM fact f WHERE p.id = f.run_id
    RETURNING p.id, p.task_name, p.task_version, p.priority, p.available_at,
              p.status = 'waiting' AND p.wait_for = f.name AS woken,
              p.concurrency_key IS NULL OR p.count_waiting AS holds
), queued AS (
    -- A keyed parent that gave its slot back is claimed through runs_claim_keyed instead.
    INSERT INTO {schema}.ready (run_id, task_name, task_version, priority, available_at, slot)
    SELECT w.id, w.task_name, w.task_version, w.priority, w.available_at, {schema}.ready_slot()
    FROM woken w WHERE w.woken AND w.holds
)
SELECT (SELECT pg_notify(%(channel)s, string_agg(w.task_name || '@' || w.task_version, ','))
        FROM woken w WHERE w.woken HAVING count(*) > 0) AS notified;

-- name: group_member_canceled
-- What a cancel that finished a member of a child group also does, in its transaction: it
-- counts itself out of its group (child_group_ended), letting the next held member run unless
-- it was held itself (%(held)s, as cancel_run found it).
WITH member AS MATERIALIZED (
    SELECT parent_run_id, child_group, status FROM {schema}.runs WHERE id = %(run_id)s
)
SELECT {schema}.child_group_ended(m.parent_run_id, m.child_group, NOT %(held)s, %(channel)s)
FROM member m
WHERE m.child_group IS NOT NULL AND m.status = 'canceled';

-- name: cancel_children
-- A run that finished failed, canceled or compensated requests the cancel of its unfinished children that
-- asked for it (`cancel_with_parent`), as cancel_run does: a child nobody holds (pending,
-- waiting, or its lease lapsed, judged on the row as it is now) ends canceled at once, stores
-- its own parent fact (nobody parks on a finished parent: no lock needed) and is returned
-- (`ended`) so the caller cascades to its children in turn; a held one keeps running and is
-- told through the cancel channel.
WITH parents AS (
    SELECT id, status FROM {schema}.runs
    WHERE id = ANY (%(run_ids)s::uuid[]) AND status IN ('failed', 'canceled', 'compensated')
), judged AS (
    SELECT c.id, c.fencing_token, p.id AS parent_id, p.status AS parent_status,
           c.status AS previous_status, c.task_name, c.task_version, c.concurrency_key,
           c.count_waiting,
           c.status = 'running' AND c.lease_expires_at <= now() AS lapsed,
           c.status IN ('pending', 'waiting')
               OR (c.status = 'running' AND c.lease_expires_at <= now()) AS ends
    FROM parents p
    JOIN {schema}.runs c ON c.parent_run_id = p.id
    WHERE c.cancel_with_parent AND c.status NOT IN ('completed', 'failed', 'canceled', 'compensated')
    FOR NO KEY UPDATE OF c
), changed AS (
    UPDATE {schema}.runs r SET
        cancel_requested_at = COALESCE(r.cancel_requested_at, now()),
        cancel_reason = COALESCE(r.cancel_reason,
                                 'parent ' || j.parent_id || ' ' || j.parent_status),
        status = CASE WHEN j.ends THEN 'canceled' ELSE r.status END,
        lease_expirations = r.lease_expirations + CASE WHEN j.lapsed THEN 1 ELSE 0 END,
        finished_at = CASE WHEN j.ends THEN now() ELSE r.finished_at END,
        available_at = CASE WHEN j.ends THEN NULL ELSE r.available_at END,
        lease_owner = CASE WHEN j.ends THEN NULL ELSE r.lease_owner END,
        lease_expires_at = CASE WHEN j.ends THEN NULL ELSE r.lease_expires_at END,
        wait_for = CASE WHEN j.ends THEN NULL ELSE r.wait_for END,
        updated_at = now()
    FROM judged j
    WHERE r.id = j.id
    RETURNING r.id, j.ends, j.lapsed, j.fencing_token, r.parent_run_id, r.parent_fact,
              r.cancel_reason, r.child_group
), dequeued AS (
    DELETE FROM {schema}.ready q USING changed c WHERE q.run_id = c.id AND c.ends
), key_slots AS (
    -- As cancel_run's key_slot, summed per key (several children may share one).
    UPDATE {schema}.concurrency_keys k SET
        running = k.running - t.held, queued = k.queued - t.wanted
    FROM (
        SELECT j.task_name, j.concurrency_key,
               count(*) FILTER (WHERE j.previous_status = 'running'
                                   OR (j.previous_status = 'waiting' AND j.count_waiting))
                   AS held,
               count(*) FILTER (WHERE j.previous_status = 'pending'
                                   OR (j.previous_status = 'waiting' AND NOT j.count_waiting))
                   AS wanted
        FROM judged j
        WHERE j.ends AND j.concurrency_key IS NOT NULL
        GROUP BY j.task_name, j.concurrency_key
    ) AS t
    WHERE k.task_name = t.task_name AND k.concurrency_key = t.concurrency_key
    RETURNING t.task_name, k.queued > 0 AND k.running < k.slot_limit AS opened
), interrupted AS (
    UPDATE {schema}.executions e SET outcome = 'interrupted', ended_at = now()
    FROM changed c
    WHERE c.lapsed AND e.run_id = c.id AND e.fencing_token = c.fencing_token
), slot_notified AS (
    -- A slot freed with runs of the key waiting for it: workers look now (any version).
    SELECT pg_notify(%(work_channel)s, '') FROM key_slots s WHERE s.opened LIMIT 1
), facts AS (
    INSERT INTO {schema}.facts (scope, name, run_id, payload)
    SELECT c.parent_run_id::text, c.parent_fact, c.parent_run_id, 'null'::jsonb
    FROM changed c WHERE c.ends AND c.parent_fact IS NOT NULL
    ON CONFLICT (scope, name) DO NOTHING
), grouped AS (
    -- Members of a child group count themselves out; none lets another run (its parent
    -- finished: the cascade cancels the held ones too, or they were abandoned).
    SELECT {schema}.child_group_ended(c.parent_run_id, c.child_group, false, %(work_channel)s)
    FROM changed c WHERE c.ends AND c.child_group IS NOT NULL
)
SELECT c.id, c.ends,
       CASE WHEN NOT c.ends
            THEN pg_notify(%(cancel_channel)s, left(c.id || ':' || c.cancel_reason, 7000)) END,
       (SELECT count(*) FROM slot_notified) AS slot_notified,
       (SELECT count(*) FROM grouped) AS grouped
FROM changed c;

-- name: get_run
SELECT id, task_name, task_version, status, priority, created_at, updated_at, available_at,
       input::text AS input, idempotency_key, output::text AS output, error, claims, failures,
       lease_expirations, fencing_token, lease_owner, lease_expires_at, finished_at,
       cancel_requested_at, cancel_reason, wait_for, trace_context, parent_run_id, rerun_of,
       forked_from, forked_at_step, concurrency_key, tags, deadline_at, start_by,
       rate_limit, rate_limit_key, debounce_key, now() AS db_now,
       -- A fairness key's weight (migration 0025): one probe of the key's row, keyed runs only.
       CASE WHEN concurrency_key IS NOT NULL THEN (
           SELECT k.weight FROM {schema}.concurrency_keys k
           WHERE k.task_name = runs.task_name AND k.concurrency_key = runs.concurrency_key)
       END AS fairness_weight
FROM {schema}.runs WHERE id = %(run_id)s;

-- name: get_steps
SELECT name, kind, status, attempt, fencing_token, output::text AS output, error,
       started_at, finished_at, wake_at
FROM {schema}.steps WHERE run_id = %(run_id)s ORDER BY seq;

-- name: get_executions
SELECT fencing_token, worker_id, claimed_at, ended_at, outcome, current_step, step_started_at
FROM {schema}.executions WHERE run_id = %(run_id)s ORDER BY fencing_token;

-- name: list_runs
-- A page of runs, newest first, keyset-paginated by id: the primary key read backwards from the
-- cursor (or runs_by_task, runs_children, runs_idempotency when the filter names a task, a parent
-- or a key), stopping after %(limit)s matches. A filter by tag uses list_runs_tagged instead.
-- A filter by worker checks each run's executions by their primary key (no index of its own:
-- the claim writes no extra entry for it), so it reads runs back from the cursor until the
-- worker's runs fill the page: quick for a worker that ran recently. The runs needing attention
-- (%(needs_attention)s) are read through their own partial index, runs_needing_attention.
SELECT id, task_name, task_version, status, priority, created_at, updated_at, available_at,
       input::text AS input, idempotency_key, output::text AS output, error, claims, failures,
       lease_expirations, fencing_token, lease_owner, lease_expires_at, finished_at,
       cancel_requested_at, cancel_reason, wait_for, trace_context, parent_run_id, rerun_of,
       forked_from, forked_at_step, concurrency_key, tags, deadline_at, start_by,
       rate_limit, rate_limit_key, now() AS db_now
FROM {schema}.runs
WHERE (%(task_name)s::text IS NULL OR task_name = %(task_name)s)
  AND (%(task_version)s::integer IS NULL OR task_version = %(task_version)s)
  AND (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(parent_run_id)s::uuid IS NULL OR parent_run_id = %(parent_run_id)s)
  AND (%(concurrency_key)s::text IS NULL OR concurrency_key = %(concurrency_key)s)
  AND (%(idempotency_key)s::text IS NULL OR idempotency_key = %(idempotency_key)s)
  AND (%(worker_id)s::text IS NULL OR EXISTS (
        SELECT 1 FROM {schema}.executions e
        WHERE e.run_id = runs.id AND e.worker_id = %(worker_id)s))
  AND (%(created_after)s::timestamptz IS NULL OR created_at >= %(created_after)s)
  AND (%(created_before)s::timestamptz IS NULL OR created_at < %(created_before)s)
  AND (%(finished_after)s::timestamptz IS NULL OR finished_at >= %(finished_after)s)
  AND (%(finished_before)s::timestamptz IS NULL OR finished_at < %(finished_before)s)
  AND (NOT %(needs_attention)s::boolean
       OR (status = 'waiting' AND wait_for LIKE 'umt.attention:%%'))
  AND (%(before)s::uuid IS NULL OR id < %(before)s)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: list_runs_tagged
-- list_runs for a filter with tags: run_tags_lookup read backwards from the cursor for the first
-- tag (%(tag_key)s = %(tag_value)s), each of its runs then read by its key and checked against
-- the other filters (every tag: `tags @>`), until %(limit)s match. The LIMIT 1 of the lateral
-- read keeps it a nested loop in run-id order (a join the planner may not turn into a scan of
-- all runs and a sort).
SELECT r.*
FROM {schema}.run_tags t
CROSS JOIN LATERAL (
    SELECT r.id, r.task_name, r.task_version, r.status, r.priority, r.created_at, r.updated_at,
           r.available_at, r.input::text AS input, r.idempotency_key, r.output::text AS output,
           r.error, r.claims, r.failures, r.lease_expirations, r.fencing_token, r.lease_owner,
           r.lease_expires_at, r.finished_at, r.cancel_requested_at, r.cancel_reason,
           r.wait_for, r.trace_context, r.parent_run_id, r.rerun_of, r.forked_from,
           r.forked_at_step, r.concurrency_key, r.tags, r.deadline_at, r.start_by,
           r.rate_limit, r.rate_limit_key, now() AS db_now
    FROM {schema}.runs r
    WHERE r.id = t.run_id
      AND r.tags @> %(tags)s::jsonb
      AND (%(task_name)s::text IS NULL OR r.task_name = %(task_name)s)
      AND (%(task_version)s::integer IS NULL OR r.task_version = %(task_version)s)
      AND (%(status)s::text IS NULL OR r.status = %(status)s)
      AND (%(parent_run_id)s::uuid IS NULL OR r.parent_run_id = %(parent_run_id)s)
      AND (%(concurrency_key)s::text IS NULL OR r.concurrency_key = %(concurrency_key)s)
      AND (%(idempotency_key)s::text IS NULL OR r.idempotency_key = %(idempotency_key)s)
      AND (%(worker_id)s::text IS NULL OR EXISTS (
            SELECT 1 FROM {schema}.executions e
            WHERE e.run_id = r.id AND e.worker_id = %(worker_id)s))
      AND (%(created_after)s::timestamptz IS NULL OR r.created_at >= %(created_after)s)
      AND (%(created_before)s::timestamptz IS NULL OR r.created_at < %(created_before)s)
      AND (%(finished_after)s::timestamptz IS NULL OR r.finished_at >= %(finished_after)s)
      AND (%(finished_before)s::timestamptz IS NULL OR r.finished_at < %(finished_before)s)
      AND (NOT %(needs_attention)s::boolean
           OR (r.status = 'waiting' AND r.wait_for LIKE 'umt.attention:%%'))
    LIMIT 1
) AS r
WHERE t.key = %(tag_key)s AND t.value = %(tag_value)s
  AND (%(before)s::uuid IS NULL OR t.run_id < %(before)s)
ORDER BY t.run_id DESC
LIMIT %(limit)s;

-- name: ledger_here
-- Is there an operation ledger in this connection's database?
SELECT to_regclass('{schema}.op_ledger') IS NOT NULL;

-- name: probe_lock
-- `shares_database_with`: a session advisory lock on the caller's connection (two random keys;
-- a session lock, not a transaction one, so it can be released at once inside a transaction).
SELECT pg_advisory_lock(%(k1)s::integer, %(k2)s::integer), pg_backend_pid();

-- name: probe_unlock
SELECT pg_advisory_unlock(%(k1)s::integer, %(k2)s::integer);

-- name: probe_see
-- Run on the engine's pool: does it see that lock, held by that backend, in its own database?
-- Advisory locks belong to one server and one database, so only the same database sees it.
SELECT EXISTS (
    SELECT 1 FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.pid = %(pid)s AND l.granted
      AND l.classid = %(k1)s::integer::oid AND l.objid = %(k2)s::integer::oid AND l.objsubid = 2
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
);

-- name: ledger_check_run
-- Is the run still held under the attempt's token? A plain read, never a lock: a lock on the
-- run row held across the caller's commit callback would block takeovers, cancels and the
-- worker's heartbeat. The fence is the op_ledger row (see ledger_finish).
WITH run AS MATERIALIZED (
    SELECT status FROM {schema}.runs WHERE id = %(run_id)s AND fencing_token = %(token)s
)
SELECT 1 FROM run WHERE status = 'running';

-- name: ledger_peek
-- The op's state before the commit callback runs (fence first); no lock either.
SELECT fencing_token, result IS NOT NULL AS finished FROM {schema}.op_ledger
WHERE op_key = %(op_key)s;

-- name: ledger_get
SELECT fencing_token, result::text AS result FROM {schema}.op_ledger
WHERE op_key = %(op_key)s
FOR UPDATE;

-- name: ledger_begin
INSERT INTO {schema}.op_ledger (op_key, run_id, fencing_token)
VALUES (%(op_key)s, %(run_id)s, %(token)s)
ON CONFLICT (op_key) DO UPDATE SET run_id = EXCLUDED.run_id,
    fencing_token = EXCLUDED.fencing_token, started_at = now()
WHERE {schema}.op_ledger.result IS NULL
  AND {schema}.op_ledger.fencing_token <= EXCLUDED.fencing_token
RETURNING 1;

-- name: ledger_finish
-- The fence: the last statement before the commit. It lands only while the op's token is still
-- the attempt's (a newer attempt's begin raises it; if that begin is in flight, this waits for
-- it and then matches nothing), and its row lock, held until the commit, makes a later begin
-- wait and find the result.
UPDATE {schema}.op_ledger SET result = %(result)s::jsonb, finished_at = now()
WHERE op_key = %(op_key)s AND fencing_token = %(token)s AND result IS NULL
RETURNING 1;

-- name: queue_depths
-- Runs waiting to be claimed: in `ready`, or pending and not in it.
SELECT d.task_name, d.task_version, count(*) AS depth
FROM unnest(%(names)s::text[], %(versions)s::integer[]) AS p (name, version)
CROSS JOIN LATERAL (
    SELECT q.task_name, q.task_version FROM {schema}.ready q
    WHERE q.task_name = p.name AND q.task_version = p.version
    UNION ALL
    SELECT r.task_name, r.task_version FROM {schema}.runs r
    WHERE r.task_name = p.name AND r.task_version = p.version
      AND r.status = 'pending' AND NOT r.queued AND r.concurrency_key IS NULL
    UNION ALL
    SELECT r.task_name, r.task_version FROM {schema}.runs r
    WHERE r.task_name = p.name AND r.task_version = p.version
      AND r.concurrency_key IS NOT NULL AND r.status = 'pending'
) AS d
GROUP BY d.task_name, d.task_version;

-- name: missing_privileges
-- After a migration: what the engine's role cannot do that workers need. Rotating the `ready`
-- queue truncates its slots (see migrations/0003_ready_queue.sql); without TRUNCATE it works
-- but is not rotated, and claims slow down whenever a long transaction holds the horizon.
SELECT current_user AS role,
       array_agg(p.relname ORDER BY p.relname) FILTER (
           WHERE NOT has_table_privilege(format('%%I.%%I', %(schema)s::text, p.relname), 'TRUNCATE')
       ) AS missing
FROM unnest(ARRAY['ready_0', 'ready_1', 'ready_2']) AS p (relname);

-- name: install_ledger
-- The operation ledger alone, for a business database separate from the engine's.
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.op_ledger (
    op_key          text PRIMARY KEY,
    run_id          uuid NOT NULL,
    fencing_token   bigint NOT NULL,
    result          jsonb,
    started_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);

-- name: cli_engine_tables
-- The command line's check before a command: does the schema hold the engine's tables? The
-- parameters are quoted qualified names ("schema".table); no schema is substituted here.
SELECT to_regclass(%(migrations)s) IS NOT NULL, to_regclass(%(runs)s) IS NOT NULL;

-- Schedules (see migrations/0007_schedules.sql): the SDK decides, these store and compare.

-- name: insert_schedule
-- First write wins: no row comes back when a schedule of that name exists.
INSERT INTO {schema}.schedules (
    name, task_name, cron, timezone, input, overlap, catchup_window, paused, next_tick,
    last_tick, last_run_id, buffered_tick
)
VALUES (
    %(name)s, %(task_name)s, %(cron)s, %(timezone)s, %(input)s::jsonb, %(overlap)s,
    %(catchup_window)s::interval, %(paused)s, %(next_tick)s, %(last_tick)s, %(last_run_id)s,
    %(buffered_tick)s
)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: get_schedule
SELECT name, task_name, cron, timezone, input::text AS input, overlap, catchup_window, paused,
       next_tick, last_tick, last_run_id, buffered_tick, version, created_at, updated_at,
       now() AS db_now
FROM {schema}.schedules WHERE name = %(name)s;

-- name: list_schedules
-- %(due)s: only those a scheduler must look at now (not paused; a tick due, or one buffered).
SELECT name, task_name, cron, timezone, input::text AS input, overlap, catchup_window, paused,
       next_tick, last_tick, last_run_id, buffered_tick, version, created_at, updated_at,
       now() AS db_now
FROM {schema}.schedules
WHERE (%(task_names)s::text[] IS NULL OR task_name = ANY (%(task_names)s::text[]))
  AND (NOT %(due)s::boolean
       OR (NOT paused AND (next_tick <= now() OR buffered_tick IS NOT NULL)))
ORDER BY name;

-- name: update_schedule
-- Compare and set: the row changes only if it is still at %(expected_version)s.
UPDATE {schema}.schedules SET
    task_name = %(task_name)s, cron = %(cron)s, timezone = %(timezone)s,
    input = %(input)s::jsonb, overlap = %(overlap)s,
    catchup_window = %(catchup_window)s::interval, paused = %(paused)s,
    next_tick = %(next_tick)s, last_tick = %(last_tick)s, last_run_id = %(last_run_id)s,
    buffered_tick = %(buffered_tick)s, version = version + 1, updated_at = now()
WHERE name = %(name)s AND version = %(expected_version)s
RETURNING version;

-- name: delete_schedule
DELETE FROM {schema}.schedules WHERE name = %(name)s RETURNING name;

-- name: prune_runs
-- One retention batch, one pruner at a time: the statement takes the schema's pruning lock if
-- it is free (`held`; else it does nothing and the caller reports `busy`), picks up to
-- %(limit)s prunable runs, leaves a tombstone for each and deletes it;
-- its steps, executions, facts, tags and streams (every table that references runs ON DELETE
-- CASCADE) and its child groups go with it. Prunable: finished before now() - %(older_than)s,
-- of the tasks asked for, with no unfinished child (its finishing write stores a fact for its
-- parent) and no unfinished parent (which may still read its result).
-- The batch reads runs_finished (task, finishing time) task by task, in name order, oldest
-- first within a task, and stops once it has %(limit)s: the task names come from a skip over
-- the index (one probe each, only as far as the batch goes), each task's runs from its own
-- range, so the runs of a task kept longer are never read by the batches of the others, and
-- only the runs the batch deletes are read and locked.
WITH RECURSIVE lock AS MATERIALIZED (
    SELECT pg_try_advisory_xact_lock(hashtextextended(%(lock_name)s, 0)) AS held
), names (task_name) AS (
    SELECT min(r.task_name) FROM {schema}.runs r
    WHERE r.status IN ('completed', 'failed', 'canceled', 'compensated') AND (SELECT held FROM lock)
    UNION ALL
    SELECT (SELECT min(r.task_name) FROM {schema}.runs r
            WHERE r.status IN ('completed', 'failed', 'canceled', 'compensated') AND r.task_name > n.task_name)
    FROM names n WHERE n.task_name IS NOT NULL
), batch AS MATERIALIZED (
    SELECT c.id FROM names n
    CROSS JOIN LATERAL (
        SELECT r.id FROM {schema}.runs r
        WHERE r.task_name = n.task_name
          AND r.status IN ('completed', 'failed', 'canceled', 'compensated')
          AND r.finished_at < now() - %(older_than)s::interval
          -- Both checks are probes by index for each candidate run (scalar subqueries, which
          -- the planner never turns into joins): as NOT EXISTS, they were planned as an anti
          -- join that read every run of the table once per batch, its cost growing with the
          -- history (bench/history.py: 338,000 buffers a batch over ten million runs).
          AND NOT (SELECT EXISTS (
              SELECT 1 FROM {schema}.runs c
              WHERE c.parent_run_id = r.id
                AND c.status NOT IN ('completed', 'failed', 'canceled', 'compensated')
          ))
          AND (r.parent_run_id IS NULL OR NOT (SELECT EXISTS (
              SELECT 1 FROM {schema}.runs p
              WHERE p.id = r.parent_run_id
                AND p.status NOT IN ('completed', 'failed', 'canceled', 'compensated')
          )))
        ORDER BY r.finished_at
        LIMIT %(limit)s
        -- The statement's snapshot may predate the commit of the pruner that held the lock
        -- before: the row lock reads each run again and skips one it deleted.
        FOR UPDATE OF r SKIP LOCKED
    ) AS c
    WHERE n.task_name IS NOT NULL
      AND (%(task_names)s::text[] IS NULL OR n.task_name = ANY (%(task_names)s::text[]))
      AND NOT (n.task_name = ANY (%(exclude_task_names)s::text[]))
    LIMIT %(limit)s
), tombstones AS (
    INSERT INTO {schema}.pruned_runs (
        run_id, task_name, task_version, status, idempotency_key, input_hash, created_at,
        finished_at
    )
    SELECT r.id, r.task_name, r.task_version, r.status, r.idempotency_key, r.input_hash,
           r.created_at, r.finished_at
    FROM {schema}.runs r JOIN batch b ON b.id = r.id
), groups AS (
    DELETE FROM {schema}.child_groups g USING batch b WHERE g.parent_run_id = b.id
), deleted AS (
    DELETE FROM {schema}.runs r USING batch b WHERE r.id = b.id RETURNING r.id
)
SELECT (SELECT held FROM lock) AS held, (SELECT count(*) FROM deleted) AS pruned;

-- name: count_prunable
-- How many runs prune_runs would delete now, all batches together (a dry run).
SELECT count(*) AS prunable FROM {schema}.runs r
WHERE r.status IN ('completed', 'failed', 'canceled', 'compensated')
  AND r.finished_at < now() - %(older_than)s::interval
  AND (%(task_names)s::text[] IS NULL OR r.task_name = ANY (%(task_names)s::text[]))
  AND NOT (r.task_name = ANY (%(exclude_task_names)s::text[]))
  -- Probes by index per run, as in prune_runs.
  AND NOT (SELECT EXISTS (
      SELECT 1 FROM {schema}.runs c
      WHERE c.parent_run_id = r.id AND c.status NOT IN ('completed', 'failed', 'canceled', 'compensated')
  ))
  AND (r.parent_run_id IS NULL OR NOT (SELECT EXISTS (
      SELECT 1 FROM {schema}.runs p
      WHERE p.id = r.parent_run_id
        AND p.status NOT IN ('completed', 'failed', 'canceled', 'compensated')
  )));

-- name: get_pruned
SELECT run_id, task_name, task_version, status, idempotency_key, input_hash, created_at,
       finished_at, pruned_at
FROM {schema}.pruned_runs WHERE run_id = %(run_id)s;

-- name: forget_pruned
-- Drop up to %(limit)s tombstones older than %(older_than)s (their keys are free again), under
-- the same lock as prune_runs.
WITH lock AS MATERIALIZED (
    SELECT pg_try_advisory_xact_lock(hashtextextended(%(lock_name)s, 0)) AS held
), old AS MATERIALIZED (
    SELECT run_id FROM {schema}.pruned_runs
    WHERE (SELECT held FROM lock) AND pruned_at < now() - %(older_than)s::interval
    ORDER BY pruned_at
    LIMIT %(limit)s
), deleted AS (
    DELETE FROM {schema}.pruned_runs t USING old o WHERE t.run_id = o.run_id RETURNING 1
)
SELECT (SELECT held FROM lock) AS held, (SELECT count(*) FROM deleted) AS pruned;
-- Streams (see migrations/0008_streams.sql): the SDK keys each write, these store and number.

-- name: append_stream
-- One value, fenced: stored only while the run is held under %(token)s (`held` is 0 when it is
-- not, and nothing is written). A key already stored returns its entry and takes no seq; a new
-- one takes the stream's next seq by updating its `streams` row, locked until the commit, so
-- the entries of a stream commit in seq order.
WITH target AS MATERIALIZED (
    SELECT r.id, r.fencing_token, r.status FROM {schema}.runs r
    WHERE r.id = %(run_id)s
    FOR KEY SHARE
), held AS (
    SELECT t.id FROM target t WHERE t.fencing_token = %(token)s AND t.status = 'running'
), existing AS (
    SELECT e.seq, e.value::text AS value, e.written_at FROM {schema}.stream_entries e
    WHERE e.run_id = %(run_id)s AND e.name = %(name)s AND e.key = %(key)s
), counter AS (
    INSERT INTO {schema}.streams AS s (run_id, name, last_seq)
    SELECT h.id, %(name)s, 1 FROM held h WHERE NOT EXISTS (SELECT 1 FROM existing)
    ON CONFLICT (run_id, name) DO UPDATE SET last_seq = s.last_seq + 1
    RETURNING s.last_seq
), inserted AS (
    INSERT INTO {schema}.stream_entries (run_id, name, seq, key, value)
    SELECT %(run_id)s, %(name)s, c.last_seq, %(key)s, %(value)s::jsonb FROM counter c
    RETURNING seq, value::text AS value, written_at
)
SELECT (SELECT count(*) FROM held) AS held, x.seq, x.value, x.written_at, x.new
FROM (SELECT 1) AS one
LEFT JOIN (
    SELECT seq, value, written_at, true AS new FROM inserted
    UNION ALL
    SELECT seq, value, written_at, false AS new FROM existing
) AS x ON true;

-- name: read_stream
-- The entries after %(after)s, by seq: the primary key's range.
SELECT run_id, name, seq, key, value::text AS value, written_at
FROM {schema}.stream_entries
WHERE run_id = %(run_id)s AND name = %(name)s AND seq > %(after)s
ORDER BY seq
LIMIT %(limit)s;

-- name: last_stream_entries
-- The newest entry of each stream of the runs (of the stream %(name)s only, when given).
SELECT e.run_id, e.name, e.seq, e.key, e.value::text AS value, e.written_at
FROM {schema}.streams s
JOIN {schema}.stream_entries e
  ON e.run_id = s.run_id AND e.name = s.name AND e.seq = s.last_seq
WHERE s.run_id = ANY (%(run_ids)s::uuid[])
  AND (%(name)s::text IS NULL OR s.name = %(name)s);

-- Pauses (see migrations/0011_pause_rerun_fork.sql): task_version 0 is the whole task.

-- name: pause_task
-- First write wins for a pause; a new one also takes the pair's runs out of `ready` (they wait
-- in runs_claim_ready, pending and not queued), so paused runs never keep its slots from being
-- truncated. The runs of those `ready` rows are locked first, in id order, as a claim locks
-- them (the run's row, then its `ready` row): a pause that deleted a `ready` row and then waited
-- for its run's row, while a claim held that row and waited for the `ready` row, deadlocked.
WITH paused AS (
    INSERT INTO {schema}.paused_tasks (task_name, task_version)
    VALUES (%(task_name)s, %(task_version)s)
    ON CONFLICT (task_name, task_version) DO NOTHING
    RETURNING task_name, task_version
), held AS (
    SELECT r.id FROM paused p
    JOIN {schema}.ready q
      ON q.task_name = p.task_name AND p.task_version IN (0, q.task_version)
    JOIN {schema}.runs r ON r.id = q.run_id
    ORDER BY r.id
    FOR NO KEY UPDATE OF r
), dequeued AS (
    DELETE FROM {schema}.ready q USING held h WHERE q.run_id = h.id
    RETURNING q.run_id
), unqueued AS (
    UPDATE {schema}.runs r SET queued = false
    FROM dequeued d WHERE r.id = d.run_id AND r.status = 'pending' AND r.queued
)
SELECT count(*) AS stored FROM paused;

-- name: resume_task
-- %(task_version)s NULL: every pause of the task. Idle workers are woken (an empty payload:
-- whatever pair); the resumed runs are claimed from runs_claim_ready in their usual order.
WITH resumed AS (
    DELETE FROM {schema}.paused_tasks
    WHERE task_name = %(task_name)s
      AND (%(task_version)s::integer IS NULL OR task_version = %(task_version)s)
    RETURNING 1
)
SELECT count(*) AS deleted,
       (SELECT pg_notify(%(channel)s, '') FROM resumed HAVING count(*) > 0) AS notified
FROM resumed;

-- name: list_paused_tasks
SELECT task_name, task_version, paused_at FROM {schema}.paused_tasks
ORDER BY task_name, task_version;

-- name: start_group
-- A map's children, in one statement: the group (first write wins: nothing else is written when
-- it exists, and the caller reads its members with group_members), and each child as insert_run
-- stores a run; the first %(max_concurrency)s (all when NULL) pending and queued in `ready` (but
-- a child with a rate limit: the claim takes its token, as insert_run says), the rest held
-- (waiting for their turn, outside every claim index).
WITH grp AS (
    INSERT INTO {schema}.child_groups (parent_run_id, name, total, remaining, max_concurrency)
    VALUES (%(parent_run_id)s, %(name)s, cardinality(%(ids)s::uuid[]),
            cardinality(%(ids)s::uuid[]), %(max_concurrency)s)
    ON CONFLICT (parent_run_id, name) DO NOTHING
    RETURNING 1
), items AS (
    SELECT i.id, i.task_name, i.task_version, i.priority, i.idempotency_key, i.input_hash,
           i.input, i.ord - 1 AS group_index, i.rate_limit, i.rate_limit_key,
           %(max_concurrency)s::integer IS NOT NULL AND i.ord > %(max_concurrency)s AS held
    FROM unnest(%(ids)s::uuid[], %(task_names)s::text[], %(task_versions)s::integer[],
                %(priorities)s::smallint[], %(keys)s::text[], %(hashes)s::text[],
                %(inputs)s::text[], %(rate_limits)s::text[], %(rate_keys)s::text[])
         WITH ORDINALITY AS i (id, task_name, task_version, priority, idempotency_key,
                               input_hash, input, rate_limit, rate_limit_key, ord)
    WHERE EXISTS (SELECT 1 FROM grp)
), inserted AS (
    INSERT INTO {schema}.runs (
        id, task_name, task_version, status, priority, available_at, idempotency_key,
        input_hash, trace_context, input, queued, parent_run_id, parent_fact,
        cancel_with_parent, wait_for, child_group, group_index, deadline_at, rate_limit,
        rate_limit_key
    )
    SELECT i.id, i.task_name, i.task_version,
           CASE WHEN i.held THEN 'waiting' ELSE 'pending' END, i.priority,
           CASE WHEN i.held THEN NULL ELSE now() END, i.idempotency_key, i.input_hash,
           %(trace_context)s, i.input::jsonb,
           NOT i.held AND NOT z.paused AND i.rate_limit IS NULL,
           %(parent_run_id)s, NULL, %(cancel_with_parent)s,
           CASE WHEN i.held THEN 'umt turn' END, %(name)s, i.group_index,
           now() + %(timeout)s::interval, i.rate_limit,
           CASE WHEN i.rate_limit IS NOT NULL THEN i.rate_limit_key END
    FROM items i
    -- As insert_run: a paused task's runs hold no `ready` rows.
    CROSS JOIN LATERAL (
        SELECT EXISTS (
            SELECT 1 FROM {schema}.paused_tasks p
            WHERE p.task_name = i.task_name AND p.task_version IN (0, i.task_version)
        ) AS paused
    ) AS z
    ORDER BY i.group_index
    ON CONFLICT (task_name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, task_name, task_version, priority, available_at, queued
), queued AS (
    INSERT INTO {schema}.ready (run_id, task_name, task_version, priority, available_at, slot)
    SELECT i.id, i.task_name, i.task_version, i.priority, i.available_at, {schema}.ready_slot()
    FROM inserted i WHERE i.queued
)
SELECT (SELECT count(*) FROM grp) AS created,
       (SELECT count(*) FROM inserted) AS inserted,
       (SELECT pg_notify(%(channel)s, string_agg(DISTINCT i.task_name || '@' || i.task_version,
                                                 ','))
        FROM inserted i WHERE i.queued HAVING count(*) > 0) AS notified;

-- name: group_members
-- A group's members in order (what a second start_group returns, and group_runs' ids).
SELECT r.id, r.input_hash, r.task_version FROM {schema}.runs r
WHERE r.parent_run_id = %(parent_run_id)s AND r.child_group = %(name)s
ORDER BY r.group_index;

-- name: join_group
-- gather: the given children of the parent become the members of the group, in that order,
-- their rows locked (a member finishing concurrently either committed first and is counted as
-- finished, or waits for this write and then counts itself out); `remaining` is how many are
-- not finished, replacing a group of that name; at zero the group's fact is stored at once.
WITH wanted AS (
    SELECT w.id, w.ord - 1 AS group_index
    FROM unnest(%(ids)s::uuid[]) WITH ORDINALITY AS w (id, ord)
), members AS (
    UPDATE {schema}.runs r SET child_group = %(name)s, group_index = w.group_index
    FROM wanted w
    WHERE r.id = w.id AND r.parent_run_id = %(parent_run_id)s
    RETURNING r.id, r.status
), counted AS (
    SELECT count(*) FILTER (WHERE m.status NOT IN ('completed', 'failed', 'canceled', 'compensated')) AS left_over,
           count(*) AS found
    FROM members m
), grp AS (
    INSERT INTO {schema}.child_groups (parent_run_id, name, total, remaining)
    SELECT %(parent_run_id)s, %(name)s, c.found, c.left_over FROM counted c
    ON CONFLICT (parent_run_id, name) DO UPDATE SET
        total = EXCLUDED.total, remaining = EXCLUDED.remaining
    RETURNING remaining
), fact AS (
    INSERT INTO {schema}.facts (scope, name, run_id, payload)
    SELECT %(parent_run_id)s::text, %(name)s, %(parent_run_id)s, 'null'::jsonb
    FROM grp g WHERE g.remaining = 0
    ON CONFLICT (scope, name) DO NOTHING
)
SELECT c.found, c.left_over FROM counted c, grp g;

-- name: group_runs
-- A group's members in order, as get_run_head reads a run.
SELECT id, task_name, task_version, status, priority, created_at, updated_at, available_at,
       input::text AS input, idempotency_key, output::text AS output, error, claims, failures,
       lease_expirations, fencing_token, lease_owner, lease_expires_at, finished_at,
       cancel_requested_at, cancel_reason, wait_for, trace_context, parent_run_id,
       deadline_at, start_by, now() AS db_now
FROM {schema}.runs
WHERE parent_run_id = %(parent_run_id)s AND child_group = %(name)s
ORDER BY group_index;

-- name: record_worker
-- A worker's newest report of itself (InsightStore.record_worker), stamped with now().
INSERT INTO {schema}.workers AS w (worker_id, host, pid, pairs, concurrency, runs_held,
                                   started_at, last_seen_at, stopped_at)
VALUES (%(worker_id)s, %(host)s, %(pid)s, %(pairs)s, %(concurrency)s, %(runs_held)s,
        %(started_at)s, now(), CASE WHEN %(stopped)s THEN now() END)
ON CONFLICT (worker_id) DO UPDATE
SET host = EXCLUDED.host, pid = EXCLUDED.pid, pairs = EXCLUDED.pairs,
    concurrency = EXCLUDED.concurrency, runs_held = EXCLUDED.runs_held,
    started_at = EXCLUDED.started_at, last_seen_at = EXCLUDED.last_seen_at,
    stopped_at = EXCLUDED.stopped_at
RETURNING worker_id;

-- name: list_workers
SELECT worker_id, host, pid, pairs, concurrency, runs_held, started_at, last_seen_at,
       stopped_at, now() AS db_now
FROM {schema}.workers
ORDER BY last_seen_at DESC, worker_id DESC
LIMIT %(limit)s;

-- name: forget_workers
WITH gone AS (
    DELETE FROM {schema}.workers WHERE last_seen_at < %(seen_before)s RETURNING 1
)
SELECT count(*) AS forgotten FROM gone;

-- name: pair_activity
-- The unfinished runs per pair. Each branch is one partial index's predicate (runs_queued,
-- runs_claim_ready, runs_claim_keyed, runs_claim_timers), so the read touches unfinished runs
-- only, however many finished ones the table holds.
WITH open AS (
    SELECT task_name, task_version, status, available_at FROM {schema}.runs
    WHERE status = 'pending' AND queued
    UNION ALL
    SELECT task_name, task_version, status, available_at FROM {schema}.runs
    WHERE status = 'pending' AND NOT queued AND concurrency_key IS NULL
    UNION ALL
    SELECT task_name, task_version, status, available_at FROM {schema}.runs
    WHERE status = 'pending' AND NOT queued AND concurrency_key IS NOT NULL
    UNION ALL
    SELECT task_name, task_version, status, available_at FROM {schema}.runs
    WHERE status IN ('waiting', 'running')
)
SELECT task_name, task_version,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'waiting') AS waiting,
       min(available_at) FILTER (WHERE status = 'pending' AND available_at <= now())
           AS oldest_due_at,
       now() AS db_now
FROM open
GROUP BY task_name, task_version
ORDER BY task_name, task_version;

-- name: finished_counts
-- Runs finished since %(since)s per pair, status and bucket: the task names found by skipping
-- through runs_by_task (one descent per name), then each name's recent endings read from
-- runs_finished as a range, never the older finished runs.
WITH RECURSIVE names AS (
    (SELECT task_name FROM {schema}.runs ORDER BY task_name LIMIT 1)
    UNION ALL
    SELECT (SELECT r.task_name FROM {schema}.runs r
            WHERE r.task_name > names.task_name ORDER BY r.task_name LIMIT 1)
    FROM names
    WHERE names.task_name IS NOT NULL
)
SELECT f.task_name, f.task_version, f.status,
       date_bin(%(bucket)s::interval, f.finished_at, %(since)s::timestamptz) AS bucket_start,
       count(*) AS runs
FROM names
CROSS JOIN LATERAL (
    SELECT r.task_name, r.task_version, r.status, r.finished_at FROM {schema}.runs r
    WHERE r.task_name = names.task_name
      AND r.status IN ('completed', 'failed', 'canceled', 'compensated')
      AND r.finished_at >= %(since)s::timestamptz
) AS f
WHERE names.task_name IS NOT NULL
GROUP BY f.task_name, f.task_version, f.status, bucket_start
ORDER BY f.task_name, f.task_version, f.status, bucket_start;

-- name: key_usage
-- The concurrency keys in use: their exact counters, kept by every write that changes a keyed
-- run (see migrations/0009_concurrency_keys.sql).
SELECT task_name, concurrency_key, slot_limit, running AS holding, queued AS wanting
FROM {schema}.concurrency_keys
WHERE running > 0 OR queued > 0
ORDER BY task_name, concurrency_key
LIMIT %(limit)s;

-- name: define_rate_limit
-- A limit, stored unless one of that name is (first write wins); the stored one either way.
WITH inserted AS (
    INSERT INTO {schema}.rate_limits (name, token_limit, per_us)
    VALUES (%(name)s, %(limit)s, %(per_us)s)
    ON CONFLICT (name) DO NOTHING
    RETURNING name, token_limit, per_us, paused, created_at, updated_at
)
SELECT * FROM inserted
UNION ALL
SELECT name, token_limit, per_us, paused, created_at, updated_at FROM {schema}.rate_limits
WHERE name = %(name)s AND NOT EXISTS (SELECT 1 FROM inserted);

-- name: set_rate_limit
-- A limit stored or changed (its pause stays), with its interval before (NULL: new). Run first
-- in a transaction, then lock_rate_buckets, rescale_rate_buckets and unpark_rate_limited, each
-- its own statement.
WITH old AS (
    SELECT (l.per_us + l.token_limit - 1) / l.token_limit AS interval_us
    FROM {schema}.rate_limits l WHERE l.name = %(name)s
), stored AS (
    INSERT INTO {schema}.rate_limits (name, token_limit, per_us)
    VALUES (%(name)s, %(limit)s, %(per_us)s)
    ON CONFLICT (name) DO UPDATE SET
        token_limit = EXCLUDED.token_limit, per_us = EXCLUDED.per_us, updated_at = now()
    RETURNING name, token_limit, per_us, paused, created_at, updated_at
)
SELECT s.*, (s.per_us + s.token_limit - 1) / s.token_limit AS interval_us,
       (SELECT o.interval_us FROM old o) AS old_interval_us
FROM stored s;

-- name: rescale_rate_buckets
-- After a change of the limit, its buckets locked (lock_rate_buckets): the tokens taken stay
-- taken, each bucket's time ahead of now rescaled to the new interval (rounded up).
UPDATE {schema}.rate_buckets b SET
    tat = now() + ceil((extract(epoch FROM b.tat - now()) * 1000000)::numeric
                       * %(new_us)s / %(old_us)s)::bigint * interval '1 microsecond'
WHERE b.limit_name = %(name)s AND b.tat > now();

-- name: pause_rate_limit
-- Pause or resume a limit; no row when it is unknown or was so already. A resume is followed
-- by lock_rate_buckets and unpark_rate_limited in the same transaction.
UPDATE {schema}.rate_limits SET paused = %(paused)s, updated_at = now()
WHERE name = %(name)s AND paused <> %(paused)s
RETURNING name;

-- name: lock_rate_buckets
-- After a change or a resume of the limit: wait for the claims and steps taking its tokens
-- now, and forget the wait slots handed out (unpark_rate_limited makes those runs claimable:
-- they wait in new slots). Each take locks its bucket before it reads the limit, so a take
-- after this sees the change, and one before it has parked its runs by the time
-- unpark_rate_limited (a new statement, a new snapshot) looks for them.
UPDATE {schema}.rate_buckets b SET parked_until = '-infinity' WHERE b.limit_name = %(name)s;

-- name: unpark_rate_limited
-- The runs waiting for a token of the limit (parked by a claim, or by a step), claimable now:
-- they take their token by its new rule.
WITH unparked AS (
    UPDATE {schema}.runs r SET waits_for_limit = NULL, available_at = now(), updated_at = now()
    WHERE r.waits_for_limit = %(name)s
      AND r.status IN ('pending', 'waiting')
    RETURNING r.task_name, r.task_version
)
SELECT (SELECT count(*) FROM unparked) AS unparked,
       (SELECT pg_notify(%(channel)s, string_agg(DISTINCT u.task_name || '@' || u.task_version,
                                                 ','))
        FROM unparked u HAVING count(*) > 0) AS notified;

-- name: get_rate_limit
SELECT name, token_limit, per_us, paused, created_at, updated_at FROM {schema}.rate_limits
WHERE name = %(name)s;

-- name: list_rate_limits
SELECT name, token_limit, per_us, paused, created_at, updated_at FROM {schema}.rate_limits
ORDER BY name;

-- name: take_rate_token
-- One token for a step attempt of a held run (fenced by its token), once per attempt: an
-- attempt that has its grant is granted again without a take. The take waits for the
-- bucket's lock (a claim holds it for one statement). The run is read by id alone. Without a
-- token, the run is marked as waiting for the limit (its park follows), so a change or a
-- resume of the limit wakes it.
WITH run AS MATERIALIZED (
    SELECT r.id, r.status, r.fencing_token FROM {schema}.runs r WHERE r.id = %(run_id)s
), held AS (
    SELECT r.id FROM run r WHERE r.status = 'running' AND r.fencing_token = %(token)s
), granted AS (
    SELECT 1 FROM {schema}.rate_grants g
    WHERE g.run_id = %(run_id)s AND g.step_name = %(step)s AND g.attempt = %(attempt)s
), asking AS (
    SELECT %(limit)s::text AS limit_name, %(key)s::text AS bucket_key FROM held h
    WHERE NOT EXISTS (SELECT 1 FROM granted)
), took AS MATERIALIZED (
    SELECT a.limit_name, a.bucket_key, t.taken, t.next_at, t.state
    FROM asking a
    CROSS JOIN LATERAL {schema}.take_rate_tokens(a.limit_name, a.bucket_key, 1, false) AS t
), recorded AS (
    INSERT INTO {schema}.rate_grants (run_id, step_name, attempt, limit_name, bucket_key)
    SELECT %(run_id)s, %(step)s, %(attempt)s, t.limit_name, t.bucket_key
    FROM took t WHERE t.state = 'taken'
    ON CONFLICT DO NOTHING
), marked AS (
    UPDATE {schema}.runs r SET waits_for_limit = t.limit_name
    FROM took t WHERE r.id = %(run_id)s AND t.state IN ('wait', 'paused')
)
SELECT EXISTS (SELECT 1 FROM held) AS held, EXISTS (SELECT 1 FROM granted) AS granted,
       t.state, t.next_at, now() AS db_now
FROM (SELECT 1) AS one LEFT JOIN took t ON true;
