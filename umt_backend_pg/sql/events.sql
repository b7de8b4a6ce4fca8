-- The event store's queries (`EventStore`, migrations/0023_events.sql).

-- name: insert_event
-- A new (name, key) is stored; a repeat returns nothing (the caller reads the stored one).
INSERT INTO {schema}.events (id, name, key, payload, payload_hash, trace_context)
VALUES (%(id)s, %(name)s, %(key)s, %(payload)s::jsonb, %(payload_hash)s,
        %(trace_context)s::jsonb)
ON CONFLICT (name, key) DO NOTHING
RETURNING id;

-- name: find_event
SELECT id, payload_hash FROM {schema}.events WHERE name = %(name)s AND key = %(key)s;

-- name: events_to_start
-- The events of a name in the window for which the task has no run, no tombstone of a pruned
-- run, and no refusal, oldest first.
SELECT e.id, e.name, e.key, e.payload::text, e.published_at, e.trace_context::text
FROM {schema}.events e
WHERE e.name = %(name)s AND e.published_at >= %(since)s
  AND NOT EXISTS (
    SELECT 1 FROM {schema}.runs r
    WHERE r.task_name = %(task_name)s AND r.idempotency_key = 'umt.event:' || e.id::text)
  AND NOT EXISTS (
    SELECT 1 FROM {schema}.pruned_runs t
    WHERE t.task_name = %(task_name)s AND t.idempotency_key = 'umt.event:' || e.id::text)
  AND NOT EXISTS (
    SELECT 1 FROM {schema}.event_refusals f
    WHERE f.event_id = e.id AND f.task_name = %(task_name)s)
ORDER BY e.published_at, e.id
LIMIT %(limit)s;

-- name: refuse_event
INSERT INTO {schema}.event_refusals (event_id, task_name, task_version, reason)
SELECT e.id, %(task_name)s, %(task_version)s, %(reason)s
FROM {schema}.events e WHERE e.id = %(event_id)s
ON CONFLICT (event_id, task_name) DO NOTHING;

-- name: event_refusals
SELECT f.event_id, e.name, e.key, f.task_name, f.task_version, f.reason, f.refused_at
FROM {schema}.event_refusals f JOIN {schema}.events e ON e.id = f.event_id
ORDER BY f.refused_at DESC, f.event_id, f.task_name
LIMIT %(limit)s;

-- name: expire_events
-- At most `limit` events published before `before`; their refusals go with them (cascade).
DELETE FROM {schema}.events
WHERE id IN (
    SELECT id FROM {schema}.events WHERE published_at < %(before)s
    ORDER BY published_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: list_events
-- The newest events (of a name, when given), newest first; after the event `before` (a cursor)
-- when given. Read backwards through events_published (or events_by_name for a name).
SELECT e.id, e.name, e.key, e.payload::text, e.published_at, e.trace_context::text
FROM {schema}.events e
WHERE (%(name)s::text IS NULL OR e.name = %(name)s)
  AND (%(before)s::uuid IS NULL OR NOT EXISTS (
        SELECT 1 FROM {schema}.events c WHERE c.id = %(before)s)
       OR (e.published_at, e.id) < (
        SELECT c.published_at, c.id FROM {schema}.events c WHERE c.id = %(before)s))
ORDER BY e.published_at DESC, e.id DESC
LIMIT %(limit)s;

-- name: event_runs
-- The runs of these events (their idempotency keys `umt.event:<event id>`), through the partial
-- index runs_event_key (migration 0026): the predicate is repeated so the planner can use it.
SELECT r.idempotency_key, r.id, r.task_name, r.task_version, r.status
FROM {schema}.runs r
WHERE r.idempotency_key = ANY(%(keys)s::text[])
  AND r.idempotency_key LIKE 'umt.event:%%';
