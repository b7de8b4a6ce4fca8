"""Payload codecs over the backend under test: every stored payload sealed, read back whole.

The engine of these tests puts a codec (zlib, then AES-GCM) in front of the harness's backend,
as `connect(url, codec=...)` does, and reads the store behind it (`CodecBackend.inner`) to
check what is at rest: inputs, outputs, step records, facts, schedules' inputs, ledger
results and errors' messages and tracebacks hold no plaintext, and come back unchanged
through the codec. Idempotency keys still match under encryption (the hash is the
plaintext's), a rotated key still reads old payloads, and a payload that was changed, or that
names a key the codec lacks, raises `CodecError` instead of decoding to something.
"""

from __future__ import annotations

import base64
import inspect
import json
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    AesGcmCodec,
    CodecChain,
    CodecError,
    Engine,
    IdempotencyConflictError,
    RetryPolicy,
    RunFailedError,
    Schedule,
    TaskContext,
    TaskDefinition,
    ZlibCodec,
    _serde,
    task,
)
from umt_sdk._codec import PayloadCodec, open_json
from umt_sdk._codec_backend import CodecBackend, wrap_backend
from umt_sdk._spi import (
    Backend,
    ChildGroupStore,
    Lease,
    LifecycleStore,
    RetentionStore,
    RunQuery,
    ScheduleQuery,
    ScheduleStore,
    StreamStore,
    TaskPair,
)
from umt_sdk.testing._contract._base import Job, Tally, current_tally, eventually
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["CodecsContract"]

SECRET = "pii-7f3a"
"""Put in every payload of these tests; never found in what the store holds."""

KEY_1 = bytes(range(32))
KEY_2 = bytes(range(32, 64))


def _codec(keys: dict[str, bytes], current: str) -> PayloadCodec:
    return CodecChain(ZlibCodec(min_size=0), AesGcmCodec(keys=keys, current=current))


@task("contract.codec", version=1)
async def codec_task(ctx: TaskContext[Job]) -> dict[str, Any]:
    looked_up = await ctx.step.run("look_up", lambda: {"record": f"{ctx.input.key}:{SECRET}"})
    fact: dict[str, Any] = await ctx.step.wait_for_fact(ctx.input.key)
    return {"looked_up": looked_up, "fact": fact, "n": ctx.input.n}


def _fails(key: str) -> str:
    raise ValueError(f"card {key} {SECRET} declined")


@task("contract.codec_fails", version=1, retry=RetryPolicy(max_attempts=1))
async def codec_failing_task(ctx: TaskContext[Job]) -> None:
    await ctx.step.run("charge", _fails, ctx.input.key, output_type=str)


def _look_up(key: str) -> dict[str, str]:
    current_tally().body_runs[(key, "look_up")] += 1
    return {"record": f"{key}:{SECRET}"}


@task("contract.codec_flow", version=1)
async def codec_flow_task(ctx: TaskContext[Job]) -> dict[str, Any]:
    looked_up = await ctx.step.run("look_up", _look_up, ctx.input.key)
    await ctx.stream.write("progress", {"note": SECRET, "done": 1})
    finished: dict[str, Any] = await ctx.step.run(
        "finish", lambda: {"looked_up": looked_up, "n": ctx.input.n}
    )
    return finished


@task("contract.codec_child", version=1)
async def codec_child_task(ctx: TaskContext[Job]) -> str:
    return f"{ctx.input.key}:{ctx.input.n}"


@task("contract.codec_fan_out", version=1)
async def codec_fan_out_task(ctx: TaskContext[Job]) -> list[str]:
    jobs = [Job(key=f"{ctx.input.key}-{SECRET}", n=n) for n in range(3)]
    return await ctx.step.map("children", codec_child_task, jobs, max_concurrency=1)


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    codec_task,
    codec_failing_task,
    codec_flow_task,
    codec_child_task,
    codec_fan_out_task,
)
"""The tasks of this topic that the suite's engine registers."""


def _clear(*texts: str | None) -> list[str]:
    """The texts among `texts` that hold the secret in clear."""
    return [t for t in texts if t is not None and SECRET in t]


class CodecsContract:
    """What a codec in front of the backend guarantees, on every backend."""

    @pytest.fixture
    def sealed(self, engine: Engine) -> Engine:
        """The suite's engine with a codec (zlib then AES-GCM) in front of its backend (the
        `engine` fixture closes the store)."""
        backend = wrap_backend(engine.backend, _codec({"k1": KEY_1}, "k1"))
        return Engine(backend, engine.registry, telemetry=engine.telemetry)

    @staticmethod
    def _raw(sealed: Engine) -> Backend:
        backend = sealed.backend
        assert isinstance(backend, CodecBackend)
        inner: Backend = backend.inner
        return inner

    async def test_payloads_at_rest_are_sealed_and_read_back(
        self, sealed: Engine, harness: BackendHarness
    ) -> None:
        handle = await sealed.enqueue(codec_task, Job(key=f"k-{SECRET}", n=7))
        async with sealed.worker(concurrency=1, lease=harness.lease):
            await eventually(lambda: _waits(sealed, handle.run_id))
            await sealed.signal(handle.run_id, f"k-{SECRET}", {"note": SECRET})
            output = await handle.result(timeout=20)
        assert output == {
            "looked_up": {"record": f"k-{SECRET}:{SECRET}"},
            "fact": {"note": SECRET},
            "n": 7,
        }
        raw = await self._raw(sealed).get_run(handle.run_id)
        assert raw is not None
        stored = [raw.input_json, raw.output_json, *(s.output_json for s in raw.steps)]
        assert _clear(*stored) == [], "input, output and step records are sealed at rest"
        assert all(s is None or s.startswith('"umt-codec/1:zlib+aes-gcm:') for s in stored)
        facts = await self._raw(sealed).get_facts(run_id=handle.run_id, name=f"k-{SECRET}")
        assert [_clear(f.payload_json) for f in facts] == [[]], "the fact's payload is sealed"
        head = await self._raw(sealed).get_run_head(handle.run_id)
        assert head is not None
        assert _clear(head.input_json, head.output_json) == []
        listed = await self._raw(sealed).list_runs(_query(handle.run_id))
        assert [_clear(r.input_json, r.output_json) for r in listed] == [[]]
        # Through the codec: every read gives the plaintext back.
        info = await sealed.get(handle.run_id)
        assert info.input == {"key": f"k-{SECRET}", "n": 7}
        assert info.output == output
        opened = await sealed.backend.get_facts(run_id=handle.run_id, name=f"k-{SECRET}")
        assert [json.loads(f.payload_json) for f in opened] == [{"note": SECRET}]
        history = await sealed.export_history(handle.run_id)
        assert SECRET in history.to_json()

    async def test_errors_are_sealed_but_their_type_is_not(
        self, sealed: Engine, harness: BackendHarness
    ) -> None:
        handle = await sealed.enqueue(codec_failing_task, Job(key="c1"))
        async with sealed.worker(concurrency=1, lease=harness.lease):
            with pytest.raises(RunFailedError, match=f"card c1 {SECRET} declined"):
                await handle.result(timeout=20)
        raw = await self._raw(sealed).get_run(handle.run_id)
        assert raw is not None
        assert raw.error is not None
        errors = [raw.error, *(s.error for s in raw.steps if s.error is not None)]
        assert len(errors) == 2, "the run's error and its step's"
        for error in errors:
            assert _clear(error.message, error.traceback) == []
            assert error.message.startswith("umt-codec/1:")
            assert error.type.endswith(("ValueError", "StepFailedError")), "types stay clear"
        info = await sealed.get(handle.run_id)
        assert info.error is not None
        assert SECRET in info.error.message
        assert "_fails" in info.error.traceback

    async def test_idempotency_keys_hold_under_encryption(self, sealed: Engine) -> None:
        # AES-GCM draws a fresh nonce per payload: the stored inputs differ, the hashes do not.
        first = await sealed.enqueue(codec_task, Job(key=SECRET), idempotency_key="once")
        again = await sealed.enqueue(codec_task, Job(key=SECRET), idempotency_key="once")
        assert (again.run_id, again.created) == (first.run_id, False)
        with pytest.raises(IdempotencyConflictError):
            await sealed.enqueue(codec_task, Job(key="other"), idempotency_key="once")

    async def test_a_batchs_inputs_are_sealed(self, sealed: Engine) -> None:
        handles = await sealed.enqueue_many(
            codec_task, [Job(key=SECRET), Job(key=f"b-{SECRET}")], idempotency_keys=["b1", None]
        )
        for handle in handles:
            raw = await self._raw(sealed).get_run(handle.run_id)
            assert raw is not None
            assert _clear(raw.input_json) == [], "a batch's inputs are sealed at rest"
        assert [(await sealed.get(h.run_id)).input["key"] for h in handles] == [
            SECRET,
            f"b-{SECRET}",
        ]
        again = await sealed.enqueue_many(codec_task, [Job(key=SECRET)], idempotency_keys=["b1"])
        assert (again[0].run_id, again[0].created) == (handles[0].run_id, False)

    async def test_claims_and_ledger_results_pass_through_the_codec(
        self, sealed: Engine, harness: BackendHarness
    ) -> None:
        handle = await sealed.enqueue(codec_task, Job(key=SECRET))
        (claimed,) = await sealed.backend.claim(
            worker_id="codec-test",
            pairs=[TaskPair(name="contract.codec", version=1)],
            limit=1,
            lease=harness.lease * 10,
        )
        assert json.loads(claimed.input_json) == {"key": SECRET, "n": 0}
        lease = Lease(
            run_id=handle.run_id,
            fencing_token=claimed.fencing_token,
            worker_id="codec-test",
            duration=harness.lease * 10,
        )
        conn = await harness.business_connection()
        try:

            async def commit(tx: Any) -> None:
                del tx

            op_key = f"codec:{handle.run_id}"
            await sealed.backend.ledger(conn).begin(op_key=op_key, lease=lease)
            await sealed.backend.ledger(conn).finish(
                op_key=op_key, lease=lease, result_json=json.dumps(SECRET), commit=commit
            )
            at_rest = await self._raw(sealed).ledger(conn).begin(op_key=op_key, lease=lease)
            assert at_rest.result_json is not None
            assert _clear(at_rest.result_json) == []
            opened = await sealed.backend.ledger(conn).begin(op_key=op_key, lease=lease)
            assert opened.result_json == json.dumps(SECRET)
        finally:
            await harness.business_release(conn)

    async def test_schedule_inputs_are_sealed(self, sealed: Engine) -> None:
        raw = self._raw(sealed)
        if not isinstance(raw, ScheduleStore):
            pytest.fail("the backend under test stores no schedules: drop this test for it")
        await sealed.schedules.create(
            Schedule(name="codec.nightly", task=codec_task, cron="0 3 * * *", input=Job(key=SECRET))
        )
        stored = await raw.get_schedule("codec.nightly")
        assert stored is not None
        assert _clear(stored.state.input_json) == []
        listed = await raw.list_schedules(_schedules())
        assert [_clear(r.state.input_json) for r in listed] == [[]]
        assert (await sealed.schedules.get("codec.nightly")).input == {"key": SECRET, "n": 0}

    async def test_rotated_keys_read_old_payloads(self, engine: Engine, sealed: Engine) -> None:
        old = await sealed.enqueue(codec_task, Job(key=SECRET))
        rotated = Engine(
            wrap_backend(self._raw(sealed), _codec({"k1": KEY_1, "k2": KEY_2}, "k2")),
            engine.registry,
        )
        new = await rotated.enqueue(codec_task, Job(key=SECRET, n=2))
        assert (await rotated.get(old.run_id)).input == {"key": SECRET, "n": 0}
        assert (await rotated.get(new.run_id)).input == {"key": SECRET, "n": 2}
        raw = await self._raw(sealed).get_run_head(new.run_id)
        assert raw is not None
        with pytest.raises(CodecError, match="key id 'k2'"):
            await sealed.get(new.run_id)  # the old codec never had the new key
        only_new = Engine(
            wrap_backend(self._raw(sealed), _codec({"k2": KEY_2}, "k2")), engine.registry
        )
        with pytest.raises(CodecError, match="key id 'k1'"):
            await only_new.get(old.run_id)

    async def test_a_changed_payload_is_refused(self, sealed: Engine) -> None:
        handle = await sealed.enqueue(codec_task, Job(key=SECRET))
        raw = await self._raw(sealed).get_run_head(handle.run_id)
        assert raw is not None
        # What a store-side change would do: the same sealed text with one byte flipped.
        prefix, _, body = raw.input_json.strip('"').rpartition(":")
        data = bytearray(base64.b64decode(body))
        data[-1] ^= 1
        tampered = f'"{prefix}:{base64.b64encode(bytes(data)).decode()}"'
        codec = sealed.codec
        assert codec is not None
        with pytest.raises(CodecError, match="failed authentication"):
            open_json(codec, tampered)
        assert json.loads(open_json(codec, raw.input_json)) == {"key": SECRET, "n": 0}

    async def test_an_engine_without_the_codec_says_encrypted(
        self, engine: Engine, sealed: Engine
    ) -> None:
        handle = await sealed.enqueue(codec_task, Job(key=SECRET))
        plain = Engine(self._raw(sealed), engine.registry)
        info = await plain.get(handle.run_id)
        assert SECRET not in info.input_json
        # What a worker without the codec does with the run's input: a clear CodecError.
        with pytest.raises(CodecError, match="encoded by codec 'zlib\\+aes-gcm'"):
            _serde.decode(info.input_json, Job, what="input")

    async def test_a_worker_without_the_codec_hands_runs_back(
        self, engine: Engine, sealed: Engine, harness: BackendHarness
    ) -> None:
        """A worker that cannot read a run (no codec, or not its key) must not fail it: the
        run goes back to pending, uncharged, for a worker that can."""
        handle = await sealed.enqueue(codec_task, Job(key=SECRET))
        plain = Engine(self._raw(sealed), engine.registry)
        async with plain.worker(concurrency=1, lease=harness.lease):
            await eventually(lambda: _released(sealed, handle.run_id))
        info = await sealed.get(handle.run_id)
        assert info.status == "pending"
        assert info.error is None
        raw = await self._raw(sealed).get_run_head(handle.run_id)
        assert raw is not None
        assert raw.failures == 0, "not charged to the run"

    async def test_stream_values_are_sealed(self, sealed: Engine, harness: BackendHarness) -> None:
        raw = self._raw(sealed)
        if not isinstance(raw, StreamStore):
            pytest.fail("the backend under test stores no streams: drop this test for it")
        handle = await sealed.enqueue(codec_flow_task, Job(key="s1"))
        async with sealed.worker(concurrency=1, lease=harness.lease):
            await handle.result(timeout=20)
        at_rest = await raw.read_stream(handle.run_id, "progress", after=0, limit=10)
        assert [_clear(e.value_json) for e in at_rest] == [[]]
        last = await raw.last_stream_entries([handle.run_id])
        assert [_clear(e.value_json) for e in last] == [[]]
        values = [
            item.value async for item in sealed.stream(handle.run_id, "progress", follow=False)
        ]
        assert values == [{"note": SECRET, "done": 1}]
        newest = await sealed.stream_last(handle.run_id, "progress")
        assert newest is not None
        assert newest.value == {"note": SECRET, "done": 1}

    async def test_a_fork_keeps_sealed_steps_and_reads_them(
        self, sealed: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        raw = self._raw(sealed)
        if not isinstance(raw, LifecycleStore):
            pytest.fail("the backend under test cannot fork runs: drop this test for it")
        handle = await sealed.enqueue(codec_flow_task, Job(key="f1", n=3))
        async with sealed.worker(concurrency=1, lease=harness.lease):
            output = await handle.result(timeout=20)
            fork = await sealed.fork(handle.run_id, "finish")
            assert await fork.result(timeout=20) == output
        assert tally.body_runs[("f1", "look_up")] == 1, "the kept step is replayed, not run"
        stored = await raw.get_run(fork.run_id)
        assert stored is not None
        texts = [stored.input_json, stored.output_json, *(s.output_json for s in stored.steps)]
        assert _clear(*texts) == []
        assert [s.name for s in stored.steps] == ["look_up", "finish"]
        rerun = await sealed.rerun(handle.run_id)
        head = await raw.get_run_head(rerun.run_id)
        assert head is not None
        assert _clear(head.input_json) == []
        assert (await sealed.get(rerun.run_id)).input == {"key": "f1", "n": 3}

    async def test_fanned_out_children_are_sealed(
        self, sealed: Engine, harness: BackendHarness
    ) -> None:
        raw = self._raw(sealed)
        if not isinstance(raw, ChildGroupStore):
            pytest.fail("the backend under test has no child groups: drop this test for it")
        handle = await sealed.enqueue(codec_fan_out_task, Job(key="p"))
        async with sealed.worker(concurrency=2, lease=harness.lease):
            outputs = await handle.result(timeout=30)
        assert outputs == [f"p-{SECRET}:{n}" for n in range(3)]
        members = await raw.list_runs(RunQuery(parent_run_id=handle.run_id, limit=10))
        assert len(members) == 3
        assert [_clear(m.input_json, m.output_json) for m in members] == [[]] * 3
        opened = await sealed.backend.list_runs(RunQuery(parent_run_id=handle.run_id, limit=10))
        assert sorted(json.loads(m.input_json)["n"] for m in opened) == [0, 1, 2]

    async def test_a_pruned_runs_key_still_matches_its_input(
        self, sealed: Engine, harness: BackendHarness
    ) -> None:
        if not isinstance(self._raw(sealed), RetentionStore):
            pytest.fail("the backend under test prunes nothing: drop this test for it")
        first = await sealed.enqueue(codec_child_task, Job(key=SECRET), idempotency_key="kept")
        async with sealed.worker(concurrency=1, lease=harness.lease):
            await first.result(timeout=20)
        await harness.advance(timedelta(seconds=1))
        report = await sealed.prune(older_than=timedelta(0), task="contract.codec_child")
        assert report.pruned >= 1
        # The tombstone keeps the plaintext's hash: the same input under the key still
        # finds the pruned run, another input is still refused.
        again = await sealed.enqueue(codec_child_task, Job(key=SECRET), idempotency_key="kept")
        assert (again.run_id, again.created) == (first.run_id, False)
        with pytest.raises(IdempotencyConflictError):
            await sealed.enqueue(codec_child_task, Job(key="other"), idempotency_key="kept")

    async def test_every_method_with_payloads_is_sealed(self, sealed: Engine) -> None:
        """Every public coroutine method of the backend has a sealing twin on the wrapper's
        class (a method added to the SPI later is covered by its `_json` names), and the
        wrapper implements the optional protocols the backend does, and only those."""
        raw = self._raw(sealed)
        wrapper = type(sealed.backend)
        for name, member in inspect.getmembers(type(raw)):
            if name.startswith("_") or not (
                inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)
            ):
                continue
            assert name in vars(wrapper) or name in vars(CodecBackend), name
        protocols = (ScheduleStore, StreamStore, LifecycleStore, RetentionStore, ChildGroupStore)
        for protocol in protocols:
            assert isinstance(sealed.backend, protocol) == isinstance(raw, protocol), protocol


async def _released(engine: Engine, run_id: Any) -> bool:
    executions = (await engine.get(run_id)).executions
    return bool(executions) and executions[0].outcome == "released"


async def _waits(engine: Engine, run_id: Any) -> bool:
    return (await engine.get(run_id)).status == "waiting"


def _query(run_id: Any) -> RunQuery:
    del run_id
    return RunQuery(task_name="contract.codec", limit=10)


def _schedules() -> ScheduleQuery:
    return ScheduleQuery(task_names=["contract.codec"])
