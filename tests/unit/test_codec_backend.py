"""The codec wrapper on the memory backend: what a reader without the codec sees (stand-ins,
never ciphertext), that it never writes a stand-in back, and `connect(codec=...)` itself."""

from __future__ import annotations

import pytest

from umt_sdk import (
    AesGcmCodec,
    CodecError,
    Engine,
    Registry,
    RetryPolicy,
    TaskContext,
    connect,
    task,
)
from umt_sdk._codec_backend import MaskingBackend, inner_backend, mask_backend
from umt_sdk.backend import CodecBackend
from umt_sdk.testing import FakeClock


def _fail(name: str) -> None:
    raise ValueError(f"no consent from {name}")


@task("unit.codec", version=1, retry=RetryPolicy.none())
async def codec_task(ctx: TaskContext[dict[str, str]]) -> str:
    if ctx.input.get("fail"):
        await ctx.step.run("consent", _fail, ctx.input["name"], output_type=str)
    return f"hello {ctx.input['name']}"


CODEC = AesGcmCodec(keys={"k": bytes(32)}, current="k")


async def test_a_reader_without_the_codec_sees_stand_ins() -> None:
    engine = await connect(
        "memory://",
        registry=Registry([codec_task]),
        clock=FakeClock(auto_advance=True),
        codec=CODEC,
    )
    async with engine:
        assert isinstance(engine.backend, CodecBackend)
        assert engine.codec is CODEC
        ok = await engine.enqueue(codec_task, {"name": "Ada"})
        failed = await engine.enqueue(codec_task, {"name": "Ada", "fail": "yes"})
        async with engine.worker():
            await engine.wait_idle([ok.run_id, failed.run_id])
        masked = mask_backend(inner_backend(engine.backend))
        reader = Engine(masked, engine.registry)
        assert reader.codec is None
        info = await reader.get(ok.run_id)
        assert (info.input, info.output) == ("<encrypted: aes-gcm>", "<encrypted: aes-gcm>")
        assert all(
            s.error is None or s.error.message == "<encrypted: aes-gcm>" for s in info.timeline
        )
        bad = await reader.get(failed.run_id)
        assert bad.error is not None
        assert (bad.error.message, bad.error.traceback) == ("<encrypted: aes-gcm>",) * 2
        assert masked.masked == {"aes-gcm"}
        with pytest.raises(CodecError, match=r"cannot write .*<encrypted: aes-gcm>.* back"):
            await reader.rerun(ok.run_id)
        # Plain runs read as they are, and can be written.
        plain = Engine(mask_backend(inner_backend(engine.backend)), engine.registry)
        clear = await plain.enqueue(codec_task, {"name": "Grace"})
        assert (await plain.get(clear.run_id)).input == {"name": "Grace"}
        assert isinstance(plain.backend, MaskingBackend)
        assert not plain.backend.masked
