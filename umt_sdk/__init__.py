"""umt: durable tasks for Python.

A task is a function decorated with `@task(name, version=...)`; inside it, named steps run once
per run and are replayed from their records when the run resumes after a crash, a sleep or a
wait. Backends (memory, Postgres, third-party) are pluggy plugins chosen by URL in `connect`.
"""

import contextlib
import inspect

from umt_sdk._attention import Settlement
from umt_sdk._codec import AesGcmCodec, CodecChain, PayloadCodec, ZlibCodec
from umt_sdk._concurrency import Concurrency, ConcurrencyStrategy
from umt_sdk._context import (
    ChildError,
    ChildHandle,
    ParentClose,
    StepApi,
    SyncChildHandle,
    SyncStepApi,
    SyncTaskContext,
    TaskContext,
)
from umt_sdk._engine import Engine, PublishedEvent, RunHandle, connect
from umt_sdk._event_list import EventInfo, EventRunInfo
from umt_sdk._event_spi import EventRefusal
from umt_sdk._export import HistoryStep, RunHistory
from umt_sdk._fencing import AttemptInfo, with_attempt_token
from umt_sdk._flow_keys import Debounce, Singleton, SingletonMode
from umt_sdk._handlers import QueryDefinition, UpdateDefinition, query, update
from umt_sdk._insight import TaskStats, WorkerInfo
from umt_sdk._rate_limits import RateLimit, RateLimits
from umt_sdk._retention import PruneReport
from umt_sdk._retry import RetryPolicy
from umt_sdk._schedules import ScheduleInfo, Schedules, TickReport
from umt_sdk._spi import (
    ErrorInfo,
    ExecutionRecord,
    KeyUsage,
    OverlapPolicy,
    PausedTask,
    RateLimitInfo,
    RunStatus,
    TaskPair,
)
from umt_sdk._streams import StreamApi, StreamItem, SyncStreamApi
from umt_sdk._sync import SyncEngine, SyncRateLimits, connect_sync
from umt_sdk._task import AsyncStep, Registry, Schedule, SyncStep, TaskDefinition, step, task
from umt_sdk._updates import AppliedUpdate
from umt_sdk._views import RunInfo, RunPage, StepView
from umt_sdk._worker import Worker
from umt_sdk.exceptions import (
    BackendError,
    CallbackTimeoutError,
    CallbackTokenError,
    CanceledError,
    ChildCanceledError,
    ChildFailedError,
    ChildrenFailedError,
    CodecError,
    Compensate,
    CompensationFailedError,
    DeadlineExceededError,
    FactTimeoutError,
    FencingError,
    IdempotencyConflictError,
    LeaseLostTooOftenError,
    NonDeterminismError,
    PayloadError,
    RunCanceledError,
    RunCompensatedError,
    RunFailedError,
    RunNotFoundError,
    RunPrunedError,
    ScheduleNotFoundError,
    StartDeadlineExceededError,
    StepFailedError,
    StepTimeoutError,
    UmtError,
    UpdateFailedError,
    UpdateTimeoutError,
    UsageError,
)

__all__ = [
    "AesGcmCodec",
    "AppliedUpdate",
    "AsyncStep",
    "AttemptInfo",
    "BackendError",
    "CallbackTimeoutError",
    "CallbackTokenError",
    "CanceledError",
    "ChildCanceledError",
    "ChildError",
    "ChildFailedError",
    "ChildHandle",
    "ChildrenFailedError",
    "CodecChain",
    "CodecError",
    "Compensate",
    "CompensationFailedError",
    "Concurrency",
    "ConcurrencyStrategy",
    "DeadlineExceededError",
    "Debounce",
    "Engine",
    "ErrorInfo",
    "EventInfo",
    "EventRefusal",
    "EventRunInfo",
    "ExecutionRecord",
    "FactTimeoutError",
    "FencingError",
    "HistoryStep",
    "IdempotencyConflictError",
    "KeyUsage",
    "LeaseLostTooOftenError",
    "NonDeterminismError",
    "OverlapPolicy",
    "ParentClose",
    "PausedTask",
    "PayloadCodec",
    "PayloadError",
    "PruneReport",
    "PublishedEvent",
    "QueryDefinition",
    "RateLimit",
    "RateLimitInfo",
    "RateLimits",
    "Registry",
    "RetryPolicy",
    "RunCanceledError",
    "RunCompensatedError",
    "RunFailedError",
    "RunHandle",
    "RunHistory",
    "RunInfo",
    "RunNotFoundError",
    "RunPage",
    "RunPrunedError",
    "RunStatus",
    "Schedule",
    "ScheduleInfo",
    "ScheduleNotFoundError",
    "Schedules",
    "Settlement",
    "Singleton",
    "SingletonMode",
    "StartDeadlineExceededError",
    "StepApi",
    "StepFailedError",
    "StepTimeoutError",
    "StepView",
    "StreamApi",
    "StreamItem",
    "SyncChildHandle",
    "SyncEngine",
    "SyncRateLimits",
    "SyncStep",
    "SyncStepApi",
    "SyncStreamApi",
    "SyncTaskContext",
    "TaskContext",
    "TaskDefinition",
    "TaskPair",
    "TaskStats",
    "TickReport",
    "UmtError",
    "UpdateDefinition",
    "UpdateFailedError",
    "UpdateTimeoutError",
    "UsageError",
    "Worker",
    "WorkerInfo",
    "ZlibCodec",
    "connect",
    "connect_sync",
    "query",
    "step",
    "task",
    "update",
    "with_attempt_token",
]

for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        # Evaluate string annotations in the defining module first: get_type_hints, attrs and
        # cattrs resolve them in the namespace of `__module__`, which is about to change.
        _obj.__annotations__ = inspect.get_annotations(_obj, eval_str=True)
    if isinstance(_obj, type) or callable(_obj):
        with contextlib.suppress(AttributeError, TypeError):
            _obj.__module__ = __name__
del _name, _obj
