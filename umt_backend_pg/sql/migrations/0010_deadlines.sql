-- Deadlines: when a run must be finished by (`@task(timeout=...)`, `enqueue(deadline=...)`)
-- and when it must have been started by (`enqueue(start_within=...)`), as the enqueue stored
-- them. The SDK decides what they mean: the claim hands both out, and a worker ends a run past
-- either one failed. No index: a run that must end at its deadline is made claimable then
-- (its `available_at` is never later than its deadline: insert_run, and the SDK's parking
-- writes), so the claim's own indexes find it and the claim reads two more columns of rows it
-- already reads.

ALTER TABLE {schema}.runs
    ADD COLUMN deadline_at timestamptz,
    ADD COLUMN start_by timestamptz;
