-- Pause, rerun and fork (issue 16, parts 4 and 6).
--
-- A paused task: the claim takes no run of a pair that a row here names, by its version or by
-- the task alone (task_version 0: every version). The claim reads it once per pair it serves
-- (claim_runs in queries.sql), so a pause holds on every worker as soon as it commits. Runs of
-- a paused pair are left out of `ready` (pause_task takes them out; insert_run does not queue
-- them) and wait in runs_claim_ready, where the claim finds them again after the resume.
CREATE TABLE {schema}.paused_tasks (
    task_name       text NOT NULL,
    task_version    integer NOT NULL CHECK (task_version >= 0),
    paused_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_name, task_version)
);

-- A run started again: the run it reruns, or the run it forks and the step it forks from.
-- A fork's kept step records and its facts are copied from the old run when it is inserted.
ALTER TABLE {schema}.runs
    ADD COLUMN rerun_of uuid,
    ADD COLUMN forked_from uuid,
    ADD COLUMN forked_at_step text;
