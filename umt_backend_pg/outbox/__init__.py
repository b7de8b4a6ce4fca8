"""The transactional outbox: business transactions write events, a relay turns them into runs.

The business code inserts an `outbox_event` row in the same transaction as the business change
(`insert_outbox_event`, or a plain INSERT). An `OutboxRelay` claims due `pending` rows with
`FOR UPDATE SKIP LOCKED`, routes each by its `type` to a task, enqueues a run under the row's
idempotency key, and marks the row `dispatched` (a run of that task, version and input exists
under the key), or schedules a retry with exponential backoff, or marks it `dead`.

The default key is `outbox:<install id>:<schema>.<table>:<id>`: the install id is drawn at
random once per outbox table when it is installed (`umt_outbox_installs`), so the events of two
outbox tables, or of two business databases routed to one engine, never share a key.

Two layouts:
- same database (the engine's schema lives in the business database): the enqueue runs on the
  relay's own transaction (`engine.enqueue(..., conn=...)`), so the run and the row's new status
  commit together: a crash loses both or neither.
- two databases: the enqueue commits in the engine's database first, then the row is marked;
  a crash in between leaves the row pending, and the next dispatch finds the run already there
  under the same idempotency key (no second run).
`mode="auto"` finds out which applies when the relay first connects, by asking the engine's
backend (`PostgresBackend.shares_database_with`, an advisory lock its pool must see).

Rooms: `_schema` (the DDL, `install_outbox`, `insert_outbox_event`), `_relay` (the relay: its
lifecycle, loop, outages, listening and connections), `_dispatch` (claiming a batch and
dispatching its rows, with their spans; `DispatchReport`).
"""

from umt_backend_pg.outbox._dispatch import DispatchReport
from umt_backend_pg.outbox._relay import OutboxRelay
from umt_backend_pg.outbox._schema import insert_outbox_event, install_outbox, outbox_ddl

__all__ = ["DispatchReport", "OutboxRelay", "insert_outbox_event", "install_outbox", "outbox_ddl"]
