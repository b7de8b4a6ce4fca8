-- Streams: ordered values a run writes (`ctx.stream.write`), read by `engine.stream`.
--
-- `streams` holds one row per (run, stream name) with the seq of its newest entry: an append
-- takes the next seq by updating that row, whose lock it holds until it commits, so the
-- entries of one stream commit in seq order and a reader that has seen seq n misses nothing by
-- reading the entries after n. `stream_entries` keeps each value under its writer's key (unique
-- per stream: a write made again after a crash finds its entry). A run's streams go with it.

CREATE TABLE {schema}.streams (
    run_id      uuid NOT NULL REFERENCES {schema}.runs (id) ON DELETE CASCADE,
    name        text NOT NULL,
    last_seq    bigint NOT NULL,
    PRIMARY KEY (run_id, name)
);

CREATE TABLE {schema}.stream_entries (
    run_id      uuid NOT NULL,
    name        text NOT NULL,
    seq         bigint NOT NULL,
    key         text NOT NULL,
    value       jsonb NOT NULL,
    written_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, name, seq),
    UNIQUE (run_id, name, key),
    FOREIGN KEY (run_id, name) REFERENCES {schema}.streams (run_id, name) ON DELETE CASCADE
);
