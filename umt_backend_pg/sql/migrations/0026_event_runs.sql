-- The runs of an event, for operators (issue 28: `engine.events()`, `umt events list`, the
-- dashboard's events page). An event's runs are the runs whose idempotency key is
-- `umt.event:<event id>`, of any task; runs_idempotency is keyed by task name first, so a
-- lookup by the key alone would read every run. This partial index holds only the runs events
-- started.

CREATE INDEX runs_event_key ON {schema}.runs (idempotency_key)
    WHERE idempotency_key LIKE 'umt.event:%';
