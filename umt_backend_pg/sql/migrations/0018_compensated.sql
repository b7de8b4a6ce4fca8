-- Compensation (sagas): a new terminal status, `compensated`.
--
-- A run that gives up and runs the compensations of its completed steps ends `compensated`
-- (umt_sdk._sagas decides; the store keeps the status). It is terminal like completed, failed
-- and canceled: it has a finished_at, retention deletes it, the listing of finished runs and
-- the cascade of a parent's end to its children (like failed) include it. The compensations
-- themselves are step records (`umt.compensation:<step>`, `umt.compensating`,
-- `umt.compensate:<step>`): no new column.

ALTER TABLE {schema}.runs DROP CONSTRAINT runs_status_check;
ALTER TABLE {schema}.runs ADD CONSTRAINT runs_status_check CHECK (
    status IN ('pending', 'running', 'waiting', 'completed', 'failed', 'canceled', 'compensated')
);

-- The index of finished runs (retention, time-range listing) takes the new terminal status.
DROP INDEX {schema}.runs_finished;
CREATE INDEX runs_finished ON {schema}.runs (task_name, finished_at)
    WHERE status IN ('completed', 'failed', 'canceled', 'compensated');
