-- Fairness keys (issue 28, part 2): `enqueue(fairness_key=..., weight=...)`.
--
-- A fairness key is a concurrency key (migration 0009) whose limit no key reaches (the SDK
-- stores 2147483647) and whose row has a `weight`; NULL for the other keys. The claim already
-- serves a task's keys least recently served first (`claimed_at`, through
-- concurrency_keys_open); for a key with a weight it also takes at most `weight` of its runs,
-- and places them in the batch's order as if they became ready at the key's `claimed_at`, not
-- at their enqueue: a key with a backlog of 100,000 runs was served a moment ago, so a key
-- served earlier (or never) goes first, and one key's backlog delays another key's run by one
-- turn at most. No new index: the claim reads the same ones, and a task without fairness keys
-- reads nothing more.

ALTER TABLE {schema}.concurrency_keys ADD COLUMN weight integer CHECK (weight >= 1);
