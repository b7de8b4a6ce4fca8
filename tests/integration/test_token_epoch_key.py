"""The token epoch's incarnation key is the same in every session: workers whose sessions have
different TimeZone or DateStyle settings (PGTZ, a pool's `options`) share one epoch instead of
opening a new one, a durable commit under the epoch lock, on every claim."""

from __future__ import annotations

import psycopg
from psycopg import sql

SETTINGS = [
    "SET TimeZone = 'UTC'",
    "SET TimeZone = 'Asia/Kolkata'",
    "SET TimeZone = 'America/St_Johns'; SET DateStyle = 'SQL, DMY'",
    "SET TimeZone = 'Pacific/Chatham'; SET DateStyle = 'German'",
]


def test_sessions_with_different_time_zones_share_one_epoch(pg_url: str, pg_schema: str) -> None:
    token = sql.SQL("SELECT {}.next_fencing_token()").format(sql.Identifier(pg_schema))
    sessions = [psycopg.connect(pg_url, autocommit=True) for _ in SETTINGS]
    try:
        for conn, setting in zip(sessions, SETTINGS, strict=True):
            conn.execute(setting)  # the test's own constant statements
        tokens = []
        for _ in range(50):
            for conn in sessions:  # alternately, as workers with different PGTZ would claim
                row = conn.execute(token).fetchone()
                assert row is not None
                tokens.append(int(row[0]))
        epochs = (
            sessions[0]
            .execute(
                sql.SQL("SELECT server_key, epoch FROM {}.token_epochs").format(
                    sql.Identifier(pg_schema)
                )
            )
            .fetchall()
        )
    finally:
        for conn in sessions:
            conn.close()
    assert tokens == sorted(set(tokens)), "tokens must strictly increase"
    assert len(epochs) == 1, f"one epoch for one server incarnation, found {epochs}"
    (key, epoch) = epochs[0]
    assert all(t >> 22 == epoch for t in tokens), "every token comes from that epoch"
    assert float(key) > 0, f"the key is the start time in seconds, not a text of it: {key!r}"
