-- Schedules: cron expressions that start runs, stored so they outlive every process.
--
-- The SDK computes every time and decides every tick (umt_sdk._schedules); a row holds what it
-- wrote and a version. A scheduler that handled a tick writes the row back only if the version
-- is still the one it read (update_schedule in queries.sql): of the schedulers racing for one
-- tick, one moves the schedule on. The runs themselves are made once by their idempotency key,
-- `umt.schedule:<name>:<tick>`, whichever scheduler enqueues first.

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

-- The workers' scheduler loops read the due schedules of the tasks they serve.
CREATE INDEX schedules_by_task ON {schema}.schedules (task_name, next_tick);
