"""The face for backend authors: the SPI protocol, its records, `hookimpl`, and the one rule
of what a backend cannot store (`unstorable_reason`, `unstorable_json_reason`), and the SDK's
encoding of an untyped payload (`encode_payload`), and payload codecs as a backend meets them
(`CodecBackend`, the wrapper `connect(codec=...)` puts in front of a backend; `seal_json`,
`open_json` and `sealed_by` for payloads a backend keeps outside the SPI, such as an outbox row).

A backend package provides a plugin module registered under the `umt` entry-point group that
implements `umt_backend_schemes` and `umt_open_backend` (see `BackendHookspecs`), and a class
satisfying `Backend`. Run `umt_sdk.testing.BackendContract` against it.
"""

from umt_sdk._clock import SystemClock
from umt_sdk._codec import check_codec, open_json, seal_json, sealed_by
from umt_sdk._codec_backend import CodecBackend
from umt_sdk._engine import new_run_id
from umt_sdk._hookspecs import BackendHookspecs, hookimpl
from umt_sdk._serde import encode_payload, unstorable_json_reason, unstorable_reason
from umt_sdk._spi import (
    TERMINAL_STATUSES,
    Backend,
    Beat,
    CancelOutcome,
    ClaimedRun,
    Clock,
    ControllableClock,
    Ending,
    EndResult,
    EndStatus,
    EnqueueResult,
    ErrorInfo,
    ExecutionOutcome,
    ExecutionRecord,
    Fact,
    HeartbeatResult,
    Lease,
    Ledger,
    LedgerEntry,
    NewRun,
    OverlapPolicy,
    RunQuery,
    RunRecord,
    RunStatus,
    ScheduleQuery,
    ScheduleRecord,
    ScheduleState,
    ScheduleStore,
    SimulatedCrash,
    StepKind,
    StepRecord,
    StepStatus,
    TaskPair,
)

__all__ = [
    "Backend",
    "BackendHookspecs",
    "Beat",
    "CancelOutcome",
    "ClaimedRun",
    "Clock",
    "CodecBackend",
    "ControllableClock",
    "EndResult",
    "EndStatus",
    "Ending",
    "EnqueueResult",
    "ErrorInfo",
    "ExecutionOutcome",
    "ExecutionRecord",
    "Fact",
    "HeartbeatResult",
    "Lease",
    "Ledger",
    "LedgerEntry",
    "NewRun",
    "OverlapPolicy",
    "RunQuery",
    "RunRecord",
    "RunStatus",
    "ScheduleQuery",
    "ScheduleRecord",
    "ScheduleState",
    "ScheduleStore",
    "SimulatedCrash",
    "StepKind",
    "StepRecord",
    "StepStatus",
    "SystemClock",
    "TERMINAL_STATUSES",
    "TaskPair",
    "check_codec",
    "encode_payload",
    "hookimpl",
    "new_run_id",
    "open_json",
    "seal_json",
    "sealed_by",
    "unstorable_json_reason",
    "unstorable_reason",
]
