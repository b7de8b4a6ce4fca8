-- Rate limits, wait slots: the runs (and steps) a bucket with no token parks keep their order.
--
-- Migration 0014 parked every run a claim found no token for at the bucket's next token (the
-- i-th of one claim i intervals later): runs parked by different claims then came due at the
-- same times, and a run enqueued meanwhile (due at once) went ahead of the backlog at every
-- token. Now each bucket keeps the last wait slot it handed out (`parked_until`); the next run
-- or step with no token waits one interval after it, or until the next token if that is later
-- (umt_sdk._rate_limits.park_slot). A change or a resume of the limit forgets the slots
-- (lock_rate_buckets) as it makes the waiting runs claimable.

ALTER TABLE {schema}.rate_buckets
    ADD COLUMN parked_until timestamptz NOT NULL DEFAULT '-infinity';

-- Take up to p_wanted tokens of the bucket (p_limit, p_key) now, under its row lock (with
-- p_skip_locked, a bucket another transaction holds is left alone: state 'busy', nothing
-- taken). Each statement reads the newest committed rows (a volatile function in READ
-- COMMITTED), and the limit is read after the bucket is locked, so a change or a resume that
-- locked the limit's buckets first is seen. States: 'taken' (taken > 0), 'wait' (no free
-- token), 'paused', 'unknown' (no such limit: nothing to keep, every token asked for is
-- given), 'busy'. When fewer than p_wanted are taken, next_at is the wait slot of the first
-- left without one (the i-th waits i intervals later; the bucket keeps the last as
-- parked_until); else when the next token is due.
CREATE OR REPLACE FUNCTION {schema}.take_rate_tokens(
    p_limit text, p_key text, p_wanted integer, p_skip_locked boolean,
    OUT taken integer, OUT next_at timestamptz, OUT interval_us bigint, OUT state text
) LANGUAGE plpgsql AS $$
DECLARE
    lim record;
    b_tat timestamptz;
    b_parked timestamptz;
    base timestamptz;
    owed bigint;
    free bigint;
BEGIN
    IF p_skip_locked THEN
        SELECT b.tat, b.parked_until INTO b_tat, b_parked FROM {schema}.rate_buckets b
        WHERE b.limit_name = p_limit AND b.bucket_key = p_key
        FOR NO KEY UPDATE SKIP LOCKED;
    ELSE
        SELECT b.tat, b.parked_until INTO b_tat, b_parked FROM {schema}.rate_buckets b
        WHERE b.limit_name = p_limit AND b.bucket_key = p_key
        FOR NO KEY UPDATE;
    END IF;
    IF NOT FOUND THEN
        INSERT INTO {schema}.rate_buckets (limit_name, bucket_key) VALUES (p_limit, p_key)
        ON CONFLICT DO NOTHING
        RETURNING tat, parked_until INTO b_tat, b_parked;
        IF NOT FOUND THEN  -- it exists: another transaction holds it (or just made it)
            IF p_skip_locked THEN
                taken := 0; state := 'busy';
                RETURN;
            END IF;
            SELECT b.tat, b.parked_until INTO b_tat, b_parked FROM {schema}.rate_buckets b
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
    next_at := base - ((lim.token_limit - 1) * interval_us) * interval '1 microsecond';
    IF taken < p_wanted THEN
        next_at := greatest(next_at, b_parked + interval_us * interval '1 microsecond');
        UPDATE {schema}.rate_buckets SET
            tat = base,
            parked_until = next_at
                + ((p_wanted - taken - 1) * interval_us) * interval '1 microsecond'
        WHERE limit_name = p_limit AND bucket_key = p_key;
    ELSIF taken > 0 THEN
        UPDATE {schema}.rate_buckets SET tat = base
        WHERE limit_name = p_limit AND bucket_key = p_key;
    END IF;
    state := CASE WHEN taken > 0 THEN 'taken' ELSE 'wait' END;
END
$$;
