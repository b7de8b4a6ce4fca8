"""A task as declared: what `@task` makes, below everything that runs it (the context, the
steps, the execution), so each can name it without importing the decorator."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Generic, Literal, TypeVar

from attrs import field, frozen

from umt_sdk._concurrency import Concurrency
from umt_sdk._rate_limits import RateLimit
from umt_sdk._retry import RetryPolicy
from umt_sdk._spi import TaskPair

__all__ = ["DEFAULT_MAX_LOST_LEASES", "OnFailure", "TaskDefinition"]

OnFailure = Literal["fail", "compensate"]

I = TypeVar("I")
O = TypeVar("O")

DEFAULT_MAX_LOST_LEASES = 10
"""How many times a run may lose its lease without recording a step before it fails: enough to
ride out deploys, node losses and database restarts, few enough that a run which kills its
worker every time (an OOM, a segfault) ends within minutes, not never."""


@frozen(kw_only=True, eq=False)
class TaskDefinition(Generic[I, O]):
    """A task as declared by `@task`: enqueue it, register it, serve it with a worker."""

    name: str
    version: int
    fn: Callable[..., Any]
    is_async: bool
    input_type: Any
    output_type: Any
    retry: RetryPolicy
    max_lost_leases: int = DEFAULT_MAX_LOST_LEASES
    """Lost leases without progress after which a run of this task fails (see `task`)."""
    retention: timedelta | None = None
    """How long this task's finished runs are kept before workers delete them (see `task`);
    None: the engine's `connect(retention=...)`."""
    concurrency: Concurrency[Any] | None = None
    """At most `limit` runs of a key running at once (see `Concurrency`); None: no limit."""
    timeout: timedelta | None = None
    """How long a run may take from its enqueue before it fails (see `task`); None: no limit."""
    rate_limit: RateLimit[Any] | None = None
    """The rate limit a run takes a token of to start (see `RateLimit`); None: none."""
    on_failure: OnFailure = "fail"
    """What a run does when it fails for good: `"fail"`, or `"compensate"` (run the
    compensations of its completed steps in reverse order, then end `compensated`)."""
    updates: Mapping[str, Any] = field(factory=dict)
    """The update handlers by name (`@update`, `umt_sdk._handlers.UpdateDefinition`)."""
    queries: Mapping[str, Any] = field(factory=dict)
    """The query handlers by name (`@query`, `umt_sdk._handlers.QueryDefinition`)."""
    on_event: str | None = None
    """The event whose every publish starts a run of this task (`engine.publish`); None: none."""

    @property
    def pair(self) -> TaskPair:
        return TaskPair(name=self.name, version=self.version)

    def __repr__(self) -> str:
        return f"<task {self.name}@{self.version} ({self.fn.__qualname__})>"
