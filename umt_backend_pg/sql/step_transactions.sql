-- Transactional steps (`ctx.step.transaction`): the statements the engine runs inside the
-- transaction whose other writes are the step body's. `{schema}` is the quoted engine schema.

-- name: step_transaction_fence
-- Fence first, before the body runs: is the run still held under the attempt's token? A plain
-- read, never a lock: no lock on the run is held while the body runs (a takeover, a cancel and
-- the worker's heartbeat never wait for user code).
WITH run AS MATERIALIZED (
    SELECT status FROM {schema}.runs WHERE id = %(run_id)s AND fencing_token = %(token)s
)
SELECT 1 FROM run WHERE status = 'running';

-- name: step_transaction_record
-- The fence at the commit, and the checkpoint: the last statement before the COMMIT. The run
-- row is locked (a claim skips it until the commit; a claim's UPDATE in flight makes this wait
-- and then see the new token: READ COMMITTED re-reads the locked row) and its lease always
-- moved on, so a claim whose snapshot was taken before this commit re-checks the row after it
-- and finds the lease held: no claim reads the run's steps without this record and takes it.
-- The record lands only while the run is held under the token; no row back means fenced.
WITH run AS MATERIALIZED (
    SELECT r.id, r.status FROM {schema}.runs r
    WHERE r.id = %(run_id)s AND r.fencing_token = %(token)s
    FOR NO KEY UPDATE
), owned AS (
    SELECT run.id FROM run WHERE run.status = 'running'
), extended AS (
    UPDATE {schema}.runs r SET lease_expires_at = now() + %(lease)s::interval
    FROM owned o
    WHERE r.id = o.id
), cleared AS (
    UPDATE {schema}.executions e SET current_step = NULL, step_started_at = NULL
    FROM owned o
    WHERE e.run_id = o.id AND e.fencing_token = %(token)s AND e.current_step = %(name)s
)
INSERT INTO {schema}.steps (
    run_id, name, attempt, kind, status, fencing_token, output, error,
    started_at, finished_at, wake_at
)
SELECT o.id, %(name)s, %(attempt)s, %(kind)s, %(status)s, %(token)s, %(output)s::jsonb,
       %(error)s::jsonb, %(started)s, %(finished)s, %(wake)s
FROM owned o
ON CONFLICT (run_id, name, attempt) DO UPDATE SET
    kind = EXCLUDED.kind, status = EXCLUDED.status, fencing_token = EXCLUDED.fencing_token,
    output = EXCLUDED.output, error = EXCLUDED.error, started_at = EXCLUDED.started_at,
    finished_at = EXCLUDED.finished_at, wake_at = EXCLUDED.wake_at
WHERE {schema}.steps.fencing_token <= EXCLUDED.fencing_token
RETURNING 1;
