-- Rate limits (issue 16, part 3): named token buckets, taken by runs in the claim and by steps.
--
-- `rate_limits` keeps each named limit (`token_limit` tokens per `per_us` microseconds, and
-- whether it is paused); `rate_buckets` one row per (limit, key) with the one time GCRA needs,
-- `tat` (see umt_sdk._rate_limits.take_tokens: a bucket holds at most `token_limit` tokens and
-- one comes back every ceil(per_us / token_limit) microseconds). Every take goes through
-- take_rate_tokens, under the bucket's row lock, so takes of a bucket are serialized across
-- workers and hosts and the bucket never gives more than the rule allows.
--
-- A run with a limit (`runs.rate_limit`, `rate_limit_key`) is never queued in `ready`: it
-- waits in runs_claim_ready like a delayed run. The claim takes a token for each run it starts
-- (a first claim, a pending run's), in its one statement; a run it finds no token for is
-- parked: `available_at` moved to when the bucket's next token is due (the i-th such run i
-- intervals later), `waits_for_limit` set. Parked runs are read again only then, so a
-- bucket's backlog costs nothing while it has no token. A step's token is recorded in
-- `rate_grants` with the take, once per step attempt; a step that finds none sets
-- `waits_for_limit` too (its run then parks, waiting, until the token is due). Changing or
-- resuming a limit makes the runs waiting for it claimable at once (runs_waits_for_limit).
-- Runs without a limit never call the function.

ALTER TABLE {schema}.runs
    ADD COLUMN rate_limit text,
    ADD COLUMN rate_limit_key text,
    ADD COLUMN waits_for_limit text;

CREATE INDEX runs_waits_for_limit ON {schema}.runs (waits_for_limit)
    WHERE waits_for_limit IS NOT NULL;

CREATE TABLE {schema}.rate_limits (
    name            text PRIMARY KEY,
    token_limit     integer NOT NULL CHECK (token_limit >= 1),
    per_us          bigint NOT NULL CHECK (per_us >= 1),
    paused          boolean NOT NULL DEFAULT false,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {schema}.rate_buckets (
    limit_name      text NOT NULL,
    bucket_key      text NOT NULL,
    tat             timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (limit_name, bucket_key)
) WITH (
    fillfactor = 50, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 100,
    autovacuum_vacuum_cost_delay = 0
);

CREATE TABLE {schema}.rate_grants (
    run_id          uuid NOT NULL REFERENCES {schema}.runs (id) ON DELETE CASCADE,
    step_name       text NOT NULL,
    attempt         integer NOT NULL,
    limit_name      text NOT NULL,
    bucket_key      text NOT NULL,
    granted_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, step_name, attempt)
);

-- Take up to p_wanted tokens of the bucket (p_limit, p_key) now, under its row lock (with
-- p_skip_locked, a bucket another transaction holds is left alone: state 'busy', nothing
-- taken). Each statement reads the newest committed rows (a volatile function in READ
-- COMMITTED), and the limit is read after the bucket is locked, so a change or a resume that
-- locked the limit's buckets first is seen. States: 'taken' (taken > 0), 'wait' (no free
-- token: next_at is when one is due), 'paused', 'unknown' (no such limit: nothing to keep,
-- every token asked for is given), 'busy'.
CREATE FUNCTION {schema}.take_rate_tokens(
    p_limit text, p_key text, p_wanted integer, p_skip_locked boolean,
    OUT taken integer, OUT next_at timestamptz, OUT interval_us bigint, OUT state text
) LANGUAGE plpgsql AS $$
DECLARE
    lim record;
    b_tat timestamptz;
    base timestamptz;
    owed bigint;
    free bigint;
BEGIN
    IF p_skip_locked THEN
        SELECT b.tat INTO b_tat FROM {schema}.rate_buckets b
        WHERE b.limit_name = p_limit AND b.bucket_key = p_key
        FOR NO KEY UPDATE SKIP LOCKED;
    ELSE
        SELECT b.tat INTO b_tat FROM {schema}.rate_buckets b
        WHERE b.limit_name = p_limit AND b.bucket_key = p_key
        FOR NO KEY UPDATE;
    END IF;
    IF NOT FOUND THEN
        INSERT INTO {schema}.rate_buckets (limit_name, bucket_key) VALUES (p_limit, p_key)
        ON CONFLICT DO NOTHING
        RETURNING tat INTO b_tat;
        IF NOT FOUND THEN  -- it exists: another transaction holds it (or just made it)
            IF p_skip_locked THEN
                taken := 0; state := 'busy';
                RETURN;
            END IF;
            SELECT b.tat INTO b_tat FROM {schema}.rate_buckets b
            WHERE b.limit_name = p_limit AND b.bucket_key = p_key
            FOR NO KEY UPDATE;
        END IF;
    END IF;
    SELECT l.token_limit, l.per_us, l.paused INTO lim
    FROM {schema}.rate_limits l WHERE l.name = p_limit;
    IF NOT FOUND THEN
        taken := p_wanted; next_at := now(); state := 'unknown';
        RETURN;
    END IF;
    IF lim.paused THEN
        taken := 0; state := 'paused';
        RETURN;
    END IF;
    interval_us := (lim.per_us + lim.token_limit - 1) / lim.token_limit;
    base := greatest(b_tat, now());
    owed := (extract(epoch FROM base - now()) * 1000000)::bigint;
    free := lim.token_limit - (owed + interval_us - 1) / interval_us;
    taken := greatest(0, least(p_wanted, free));
    base := base + (taken * interval_us) * interval '1 microsecond';
    IF taken > 0 THEN
        UPDATE {schema}.rate_buckets SET tat = base
        WHERE limit_name = p_limit AND bucket_key = p_key;
    END IF;
    next_at := base - ((lim.token_limit - 1) * interval_us) * interval '1 microsecond';
    state := CASE WHEN taken > 0 THEN 'taken' ELSE 'wait' END;
END
$$;
