"""The backend contract suite: every backend must pass it unchanged.

Subclass `BackendContract` in a test module and provide a `harness` fixture (an object
satisfying `BackendHarness`). Durations are short and real-time-safe: the same tests run on
the memory backend with a `FakeClock` and on Postgres with the wall clock.

One module per topic, each with the tasks its tests run next to the tests, as a mixin class;
`BackendContract` combines them. A backend author whose run fails a test reads one module:

- `_base`: the per-test `Tally`, the fixtures, the waiting helpers, the shared tasks
- `_runs`: enqueue and read back, idempotency keys, listing
- `_batches`: `enqueue_many` (one write, the outcome of single enqueues, keys honoured)
- `_replay`: replay by step name, non-determinism, plain tasks and steps
- `_facts`: durable sleeps and facts
- `_callbacks`: callback tokens (one per step, completed once, bad tokens refused)
- `_updates`: updates (recorded results, order, refusals, update_with_start) and queries
- `_children`: child runs, their results, and the cancels a parent's end cascades
- `_fanout`: `map` and `gather`: order, partial failure, `max_concurrency`, one wake-up
- `_user_code`: handlers and steps as users write them
- `_arguments`: argument checks
- `_aborts`: the abort table (shutdown and cancel against each handler shape)
- `_cancel`: cancel
- `_deadlines`: step timeouts, run deadlines and start deadlines
- `_claims`: claim order, priority, the pairs a worker serves
- `_retries`: step and handler retries
- `_leases`: leases, takeover and fencing, lost leases
- `_ledger`: the ledger behind `with_attempt_token`
- `_payloads`: payloads a backend cannot store, serde on replay
- `_timeline`: the timeline of runs that did not end well
- `_spi_meanings`: what a backend decides on its own (an ending's step, a cancel, `available_at`)
- `_schedules`: the schedule store (first write wins, compare-and-set) and a due tick's one run
- `_codecs`: a payload codec in front of the backend: every payload sealed at rest, read back
- `_listing`: tags, and listing by key, tag, time range and cursor
- `_pruning`: retention (what is deleted, what is kept, what a pruned run leaves)
- `_streams`: streams of runs (order, live follow, no duplicates on re-runs) and their store
- `_lifecycle`: pause and resume (held in the claim), rerun, and fork (kept steps, facts, children)
- `_concurrency`: concurrency keys (a key's limit in the claim, slots given back, strategies)
- `_flow_keys`: singletons (skip, replace, serialized per key), debounce, per-key FIFO
- `_fairness`: fairness keys (weighted turns in the claim, bad input refused)
- `_insight`: what operators look at (workers' reports, load per pair, runs by worker)
- `_rate_limits`: rate limits (tokens in the claim and for steps, parking, pause, change, keys)
- `_events`: event triggers (one run per subscriber and event, repeats, transactions, late
  subscribers and the window)
- `_sagas`: compensation (reverse order, each a durable step, `compensated`, what cannot run)
- `_transactions`: transactional steps (writes and record commit together, once; fenced)
- `_attention`: outcomes an operator settles (`uncertain_on`, `needs_attention`, `settle`)
- `_patches`: `ctx.patched` decided once per run and replayed, `deprecate_patch`, a reused id
"""

from __future__ import annotations

from typing import Any

from umt_sdk import TaskDefinition
from umt_sdk.testing._contract import (
    _aborts,
    _arguments,
    _attention,
    _base,
    _batches,
    _callbacks,
    _cancel,
    _children,
    _claims,
    _codecs,
    _concurrency,
    _deadlines,
    _events,
    _facts,
    _fairness,
    _fanout,
    _flow_keys,
    _insight,
    _leases,
    _ledger,
    _lifecycle,
    _listing,
    _patches,
    _payloads,
    _pruning,
    _rate_limits,
    _replay,
    _retries,
    _runs,
    _sagas,
    _schedules,
    _spi_meanings,
    _streams,
    _timeline,
    _transactions,
    _updates,
    _user_code,
)

__all__ = ["BackendContract"]

ALL_TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    *_base.TASKS,
    *_runs.TASKS,
    *_batches.TASKS,
    *_replay.TASKS,
    *_facts.TASKS,
    *_callbacks.TASKS,
    *_updates.TASKS,
    *_children.TASKS,
    *_fanout.TASKS,
    *_user_code.TASKS,
    *_arguments.TASKS,
    *_aborts.TASKS,
    *_cancel.TASKS,
    *_claims.TASKS,
    *_retries.TASKS,
    *_leases.TASKS,
    *_ledger.TASKS,
    *_payloads.TASKS,
    *_timeline.TASKS,
    *_schedules.TASKS,
    *_codecs.TASKS,
    *_listing.TASKS,
    *_pruning.TASKS,
    *_streams.TASKS,
    *_lifecycle.TASKS,
    *_concurrency.TASKS,
    *_flow_keys.TASKS,
    *_fairness.TASKS,
    *_rate_limits.TASKS,
    *_deadlines.TASKS,
    *_insight.TASKS,
    *_sagas.TASKS,
    *_events.TASKS,
    *_transactions.TASKS,
    *_attention.TASKS,
    *_patches.TASKS,
)
"""Every task the suite's engine registers: one registry for all topics, since a worker of
one test serves every pair (tasks that clash by name, or that a test adds itself, are left
out: each topic's `TASKS` says which)."""


class BackendContract(
    _runs.RunsContract,
    _batches.BatchesContract,
    _replay.ReplayContract,
    _facts.FactsContract,
    _callbacks.CallbacksContract,
    _updates.UpdatesContract,
    _children.ChildrenContract,
    _fanout.FanOutContract,
    _user_code.UserCodeContract,
    _arguments.ArgumentsContract,
    _aborts.AbortsContract,
    _cancel.CancelContract,
    _claims.ClaimsContract,
    _retries.RetriesContract,
    _leases.LeasesContract,
    _ledger.LedgerContract,
    _payloads.PayloadsContract,
    _timeline.TimelineContract,
    _spi_meanings.SpiMeaningsContract,
    _schedules.SchedulesContract,
    _codecs.CodecsContract,
    _listing.ListingContract,
    _pruning.PruningContract,
    _streams.StreamsContract,
    _lifecycle.LifecycleContract,
    _concurrency.ConcurrencyContract,
    _flow_keys.FlowKeysContract,
    _fairness.FairnessContract,
    _rate_limits.RateLimitsContract,
    _deadlines.DeadlinesContract,
    _insight.InsightContract,
    _sagas.SagasContract,
    _events.EventsContract,
    _transactions.TransactionsContract,
    _attention.AttentionContract,
    _patches.PatchesContract,
    _base.ContractBase,
):
    """The rules every backend keeps. Provide a `harness` fixture in the subclass."""

    contract_tasks = ALL_TASKS
