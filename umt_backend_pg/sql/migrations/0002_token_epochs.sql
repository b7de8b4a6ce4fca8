-- Fencing tokens that no crash or failover can hand out twice.
--
-- Claims commit asynchronously, so the sequence advance behind a token can be lost in a crash
-- (or never reach a replica that is then promoted) and `nextval` would return the same value
-- again. Every server incarnation (a start, or a promotion: a promoted standby has a postmaster
-- start time of its own, and nothing could write here while it was a standby) therefore draws
-- its tokens from an epoch of its own: token = epoch * 2^22 + n. The epoch is created by a
-- durable commit and is the greater of (milliseconds since 2020 by the server's clock) and
-- (the largest epoch stored + 1), so it is larger than every token of an earlier incarnation,
-- whose tokens all lie below (its epoch + 1) * 2^22: after a crash because the earlier epoch is
-- stored, after a failover to a standby that missed it because the clock has moved on since.

CREATE TABLE {schema}.token_epochs (
    server_key  text PRIMARY KEY,
    epoch       bigint NOT NULL UNIQUE CHECK (epoch > 0),
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION {schema}.next_fencing_token() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    incarnation constant text := pg_postmaster_start_time()::text;
    block constant bigint := 4194304;  -- 2^22 tokens per epoch
    current_epoch bigint;
    token bigint;
BEGIN
    -- Look, and if this incarnation has no epoch (or it is used up) look again under the lock:
    -- another claim may have opened it meanwhile.
    FOR locked IN 0..1 LOOP
        IF locked = 1 THEN
            PERFORM pg_advisory_xact_lock(hashtextextended('{schema}.token_epochs', 0));
        END IF;
        SELECT e.epoch INTO current_epoch FROM {schema}.token_epochs e
        WHERE e.server_key = incarnation;
        IF current_epoch IS NOT NULL THEN
            token := nextval('{schema}.fencing_tokens');
            IF token >= current_epoch * block AND token < (current_epoch + 1) * block THEN
                RETURN token;
            END IF;
        END IF;
    END LOOP;
    -- The first token of this incarnation, or the epoch is used up: open a new epoch, once.
    SELECT greatest(
               floor(extract(epoch FROM clock_timestamp() - timestamptz '2020-01-01 00:00+00')
                     * 1000)::bigint,
               coalesce(max(e.epoch), 0) + 1)
    INTO current_epoch FROM {schema}.token_epochs e;
    INSERT INTO {schema}.token_epochs (server_key, epoch) VALUES (incarnation, current_epoch)
    ON CONFLICT (server_key) DO UPDATE SET epoch = EXCLUDED.epoch, created_at = now();
    PERFORM setval('{schema}.fencing_tokens', current_epoch * block, false);
    -- This claim's commit must be durable: it carries the new epoch.
    PERFORM set_config('synchronous_commit', 'on', true);
    RETURN nextval('{schema}.fencing_tokens');
END
$$;
