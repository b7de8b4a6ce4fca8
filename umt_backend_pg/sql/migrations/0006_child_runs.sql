-- Child runs: a run started by a step of another run (`ctx.step.start_child`).
--
-- `parent_fact` is the fact the child stores for its parent when it finishes, in the write that
-- finishes it (an ending, a cancel, a cascade): the parent waits for it to learn that the child
-- ended. `cancel_with_parent`: the child's cancel is requested when its parent finishes failed
-- or canceled. `runs_children` lists a run's children (get, list, the cascade).

ALTER TABLE {schema}.runs
    ADD COLUMN parent_run_id uuid,
    ADD COLUMN parent_fact text,
    ADD COLUMN cancel_with_parent boolean NOT NULL DEFAULT false;

CREATE INDEX runs_children ON {schema}.runs (parent_run_id, id) WHERE parent_run_id IS NOT NULL;
