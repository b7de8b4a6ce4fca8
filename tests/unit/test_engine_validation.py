"""Engine arguments are checked before anything is stored."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any
from uuid import UUID, uuid4

import attrs
import pytest

from umt_backend_memory import MemoryBackend
from umt_sdk import Engine, Registry, TaskContext, connect, task
from umt_sdk.exceptions import (
    PayloadError,
    ResultTimeoutError,
    RunFailedError,
    RunNotFoundError,
    TaskDefinitionError,
    UnknownTaskError,
    UsageError,
)
from umt_sdk.testing import FakeClock


@attrs.frozen
class Job:
    key: str


@task("validation.job")
async def job(ctx: TaskContext[Job]) -> str:
    return ctx.input.key


@task("validation.no-input")
async def no_input(ctx: TaskContext[None]) -> None:
    assert ctx.input is None


@task("validation.bad-sleep")
async def bad_sleep(ctx: TaskContext[None]) -> None:
    await ctx.step.sleep("nap", 5)  # type: ignore[arg-type]  # the shape a user writes


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    engine = await connect(
        "memory://", registry=Registry([job, no_input, bad_sleep]), clock=FakeClock()
    )
    yield engine
    await engine.close()


async def _stored(engine: Engine) -> int:
    return len(await engine.list())


def _refused(caught: pytest.ExceptionInfo[UsageError], argument: str) -> None:
    """A runtime argument is refused with a plain UsageError (not a TaskDefinitionError: the
    task is declared fine) that names the argument, in its message and its `argument`."""
    assert type(caught.value) is UsageError, repr(caught.value)
    assert caught.value.argument == argument
    assert argument in str(caught.value)


@pytest.mark.parametrize("priority", [32768, -32769, True, False, 1.5, "1", None])
async def test_priority_must_be_a_small_integer(engine: Engine, priority: Any) -> None:
    with pytest.raises(
        UsageError, match=r"priority must be an integer in -32768\.\.32767"
    ) as caught:
        await engine.enqueue(job, Job(key="p"), priority=priority)
    _refused(caught, "priority")
    assert await _stored(engine) == 0


@pytest.mark.parametrize("priority", [-32768, 0, 32767])
async def test_priority_bounds_are_accepted(engine: Engine, priority: int) -> None:
    handle = await engine.enqueue(job, Job(key="p"), priority=priority)
    assert (await engine.get(handle.run_id)).priority == priority


@pytest.mark.parametrize("key", ["", "k" * 513, 5, b"bytes"])
async def test_idempotency_key_must_be_a_short_string(engine: Engine, key: Any) -> None:
    with pytest.raises(UsageError, match="idempotency_key must be a non-empty string") as caught:
        await engine.enqueue(job, Job(key="i"), idempotency_key=key)
    _refused(caught, "idempotency_key")
    assert await _stored(engine) == 0


async def test_a_512_character_key_is_accepted(engine: Engine) -> None:
    handle = await engine.enqueue(job, Job(key="i"), idempotency_key="k" * 512)
    assert (await engine.get(handle.run_id)).idempotency_key == "k" * 512


@pytest.mark.parametrize(
    ("key", "why"),
    [
        (f"umt.child:{UUID(int=7)}:start", "ctx.step.start_child"),
        ("umt.child:", "ctx.step.start_child"),
        (f"umt.map:{UUID(int=8)}:tenants:0", "ctx.step.map"),
        ("umt.schedule:nightly:2030-01-01T03:00:00Z", "schedules"),
    ],
)
async def test_idempotency_keys_umt_makes_itself_are_refused(
    engine: Engine, key: str, why: str
) -> None:
    """A caller's run under a child's key would take the child's place: the parent's step
    would find it and adopt it as its child."""
    with pytest.raises(UsageError, match=r"reserved by umt|made by umt only") as caught:
        await engine.enqueue(job, Job(key="r"), idempotency_key=key)
    _refused(caught, "idempotency_key")
    assert key in str(caught.value), "the message names the key"
    assert why in str(caught.value), "and says what makes such keys"
    assert await _stored(engine) == 0


@pytest.mark.parametrize("key", ["umt.children", "my:umt.child:x", "umt.mapping:1", "UMT.child:x"])
async def test_keys_that_only_look_reserved_are_accepted(engine: Engine, key: str) -> None:
    handle = await engine.enqueue(job, Job(key="r"), idempotency_key=key)
    assert (await engine.get(handle.run_id)).idempotency_key == key


async def test_a_childs_fact_name_cannot_be_sent(engine: Engine) -> None:
    """`umt.child:<child id>` is the fact a child's ending stores for its parent: a signal of
    that name would wake the parent as if its child had finished."""
    handle = await engine.enqueue(job, Job(key="f"))
    name = f"umt.child:{uuid4()}"
    with pytest.raises(UsageError, match="reserved by umt") as caught:
        await engine.signal(handle.run_id, name)
    _refused(caught, "name")
    assert name in str(caught.value)
    with pytest.raises(UsageError, match="reserved by umt"):
        await engine.broadcast(name)
    assert await engine.signal(handle.run_id, "umt.childhood") is True


@pytest.mark.parametrize("delay", [timedelta(microseconds=-1), timedelta(days=-1), 5, 0.5])
async def test_delay_must_be_a_non_negative_timedelta(engine: Engine, delay: Any) -> None:
    with pytest.raises(UsageError, match="delay must be a timedelta >= 0") as caught:
        await engine.enqueue(job, Job(key="d"), delay=delay)
    _refused(caught, "delay")
    assert await _stored(engine) == 0


async def test_a_delay_postpones_availability(engine: Engine) -> None:
    now = engine.backend.clock.now()  # type: ignore[union-attr]
    handle = await engine.enqueue(job, Job(key="d"), delay=timedelta(minutes=3))
    assert (await engine.get(handle.run_id)).available_at == now + timedelta(minutes=3)
    zero = await engine.enqueue(job, Job(key="z"), delay=timedelta(0))
    assert (await engine.get(zero.run_id)).available_at == now


async def test_a_task_without_input_takes_none(engine: Engine) -> None:
    with pytest.raises(PayloadError, match="expected null, got dict"):
        await engine.enqueue(no_input, {})
    handle = await engine.enqueue(no_input, None)
    async with engine.worker(poll_interval=timedelta(milliseconds=20)):
        assert await handle.result(timeout=5) is None
    assert (await engine.get(handle.run_id)).status == "completed"


async def test_unknown_tasks_cannot_be_enqueued(engine: Engine) -> None:
    with pytest.raises(UnknownTaskError):
        await engine.enqueue("validation.nope", {"key": "x"})
    with pytest.raises(TaskDefinitionError, match="conflicts with the definition passed"):
        await engine.enqueue(job, Job(key="x"), version=2)  # the typed handle would lie
    with pytest.raises(TaskDefinitionError, match="expected 'task_name@version'"):
        await engine.enqueue("validation.job@latest", {"key": "x"})
    assert await _stored(engine) == 0


@pytest.mark.parametrize("status", ["done", "PENDING", "", 1])
async def test_list_status_must_be_known(engine: Engine, status: Any) -> None:
    with pytest.raises(
        UsageError, match="status must be one of canceled, compensated, completed"
    ) as caught:
        await engine.list(status=status)
    _refused(caught, "status")


@pytest.mark.parametrize("limit", [0, -1, 10_001])
async def test_list_limit_must_be_in_range(engine: Engine, limit: int) -> None:
    with pytest.raises(UsageError, match=r"limit must be in 1\.\.10000") as caught:
        await engine.list(limit=limit)
    _refused(caught, "limit")


async def test_list_limit_bounds_are_accepted(engine: Engine) -> None:
    ids = [(await engine.enqueue(job, Job(key=str(i)))).run_id for i in range(3)]
    one = await engine.list(limit=1)
    assert [r.run_id for r in one] == [ids[-1]]
    assert one.next_cursor == ids[-1]
    everything = await engine.list(limit=10_000)
    assert [r.run_id for r in everything] == ids[::-1]
    assert everything.next_cursor is None


async def test_signal_to_an_unknown_run(engine: Engine) -> None:
    missing = uuid4()
    with pytest.raises(RunNotFoundError) as caught:
        await engine.signal(missing, "approved", {"by": "ops"})
    assert caught.value.run_id == missing
    assert isinstance(caught.value, LookupError)
    backend = engine.backend
    assert isinstance(backend, MemoryBackend)
    assert backend.facts() == [], "nothing is stored for a run that does not exist"


@pytest.mark.parametrize("name", ["", "has space", "a#b", 3])
async def test_fact_names_are_checked(engine: Engine, name: Any) -> None:
    handle = await engine.enqueue(job, Job(key="f"))
    with pytest.raises(UsageError, match="fact name must be") as caught:
        await engine.signal(handle.run_id, name)
    _refused(caught, "name")
    with pytest.raises(UsageError, match="fact name must be") as caught:
        await engine.broadcast(name)
    _refused(caught, "name")


async def test_fact_payloads_must_be_json(engine: Engine) -> None:
    handle = await engine.enqueue(job, Job(key="f"))
    with pytest.raises(PayloadError, match="payload of fact 'go'"):
        await engine.signal(handle.run_id, "go", object())


async def test_unknown_runs_everywhere(engine: Engine) -> None:
    missing = uuid4()
    with pytest.raises(RunNotFoundError):
        await engine.get(missing)
    with pytest.raises(RunNotFoundError):
        await engine.cancel(missing)
    with pytest.raises(RunNotFoundError):
        await engine.result(missing, timeout=1)


async def test_result_times_out(engine: Engine) -> None:
    handle = await engine.enqueue(job, Job(key="slow"))
    with pytest.raises(ResultTimeoutError, match="still pending") as caught:
        await handle.result(timeout=0.05)
    assert isinstance(caught.value, TimeoutError)


async def test_handle_fields(engine: Engine) -> None:
    handle = await engine.enqueue(job, {"key": "h"}, idempotency_key="h")
    again = await engine.enqueue(job, Job(key="h"), idempotency_key="h")
    assert handle.id == handle.run_id == again.run_id
    assert (handle.created, again.created) == (True, False)
    assert (handle.task_name, handle.task_version) == ("validation.job", 1)


@pytest.mark.parametrize("url", ["", None, 5])
async def test_connect_needs_a_url(url: Any) -> None:
    with pytest.raises(
        UsageError, match="connect\\(\\) needs a backend URL such as 'memory://'"
    ) as caught:
        await connect(url)
    assert type(caught.value) is UsageError
    assert caught.value.argument == "url"


async def test_worker_arguments_are_checked(engine: Engine) -> None:
    with pytest.raises(UsageError, match="concurrency must be >= 1") as caught:
        engine.worker(concurrency=0)
    _refused(caught, "concurrency")
    with pytest.raises(UsageError, match="lease must be at least 100 ms") as refused_lease:
        engine.worker(lease=timedelta(milliseconds=99))
    _refused(refused_lease, "lease")
    with pytest.raises(TaskDefinitionError, match="must be a list"):  # the Registry's check
        engine.worker(versions="validation.job@1")  # type: ignore[arg-type]


async def test_a_sleep_given_seconds_fails_the_run_at_once_naming_the_argument(
    engine: Engine,
) -> None:
    """`ctx.step.sleep("nap", 5)`: a usage error, which no retry can fix, so the run fails at
    once (not after its retries) with a message that says what to pass."""
    handle = await engine.enqueue(bad_sleep, None)
    async with engine.worker():
        with pytest.raises(RunFailedError) as caught:
            await handle.result(timeout=5)
    assert caught.value.error_type == "umt_sdk.UsageError"
    assert "duration must be a timedelta" in caught.value.error_message
    info = await engine.get(handle.run_id)
    assert info.failures == 1
