-- Event triggers (issue 28, part 3): `engine.publish(name, payload, key=...)` and
-- `@task(on_event=name)`.
--
-- An event is stored once per (name, key), with its publish time (the database's). The runs it
-- starts are ordinary runs whose idempotency key is `umt.event:<event id>`: the unique index on
-- (task_name, idempotency_key) and the pruned runs' tombstones make one run per (event, task),
-- whoever starts it (the publish, in its transaction, or a worker that finds a subscriber with
-- no run for an event of the window). A subscriber whose input type refuses an event's payload
-- is recorded in `event_refusals` and not offered that event again. Events older than the
-- window are deleted by the workers, their refusals with them.

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
