-- Two changes that need no data migration.
--
-- 1. The token epoch's incarnation key no longer depends on the session. It was
--    `pg_postmaster_start_time()::text`, whose text follows the session's TimeZone (and
--    DateStyle): two workers with different PGTZ, or a pool that sets TimeZone, opened a new
--    epoch on almost every claim (each a durable commit under the epoch lock), and the epoch ran
--    ahead of the clock by one a claim. Tokens still increased, so none was reused. Epochs keyed
--    the old way are left as they are: the first claim after this migration opens one more
--    epoch, greater than every one stored, as after a restart.
--
-- 2. Autovacuum settings for the tables every run updates (see docs/operations.md). The
--    defaults vacuum a table once its dead rows pass 20% of its rows: with a million finished
--    runs kept, `runs` would gather 200,000 dead versions, which every claim and lookup by
--    index walks, before a vacuum; and the default cost limit makes that vacuum sleep.
--    - runs: vacuum at 1,000 dead rows plus 1% of the table (pgqueuer's setting for its queue
--      table), with no cost delay: vacuuming the queue table quickly is worth more than the I/O
--      it saves to sleep. The launcher still visits a database only every
--      `autovacuum_naptime` (1 min by default, a server setting no table can change).
--    - executions: the same (one update a step start and one an ending, all HOT, so its
--      vacuums are cheap and keep the HOT chains short).
--    - steps: insert-only; the default insert threshold already vacuums it for the visibility
--      map, so it keeps the defaults.
--    - ready_0..2: emptied by TRUNCATE; vacuum matters only while rotation cannot run (a
--      role without TRUNCATE, a slot held by a long transaction): at 1,000 dead rows, no delay.

CREATE OR REPLACE FUNCTION {schema}.next_fencing_token() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    -- The start time as seconds since 1970 (numeric text): the same in every session, whatever
    -- its TimeZone or DateStyle (a timestamptz's text is not).
    incarnation constant text := extract(epoch FROM pg_postmaster_start_time())::text;
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

ALTER TABLE {schema}.runs SET (
    autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0, autovacuum_vacuum_cost_limit = 10000
);
ALTER TABLE {schema}.executions SET (
    autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0, autovacuum_vacuum_cost_limit = 10000
);
ALTER TABLE {schema}.ready_0 SET (
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE {schema}.ready_1 SET (
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE {schema}.ready_2 SET (
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);
