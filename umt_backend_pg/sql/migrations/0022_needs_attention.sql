-- Runs in needs_attention (issue 29 part 4): a step declared `uncertain_on` failed so, and its
-- run waits for an operator to settle it (umt_sdk._attention). Such a run is stored `waiting`
-- on the fact `umt.attention:<attempt>:<step>`, with no available_at: no new status, no new
-- column. This index serves the listing of runs needing attention (list_runs with
-- needs_attention), newest first, without reading the other waiting runs.

CREATE INDEX runs_needing_attention ON {schema}.runs (id)
    WHERE status = 'waiting' AND wait_for LIKE 'umt.attention:%';
