"""The command line on a store whose payloads are encrypted: with `--codec` / `UMT_CODEC` it
shows them decoded, its JSON included; without, it says "encrypted" (never the ciphertext,
never a crash) and how to read them, and refuses to write a stand-in back."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import timedelta
from typing import Any

import pytest

from tests.integration.cli import app_tasks
from tests.integration.cli.codec_app import make_codec
from tests.integration.cli.test_cli import REGISTRY, Umt
from umt_sdk import connect

CODEC = "tests.integration.cli.codec_app:make_codec"
SEALED = "<encrypted: zlib+aes-gcm>"


def _finish(umt: Umt, task: str, payload: dict[str, Any]) -> str:
    """Enqueue through an engine with the codec and serve it until the run finishes."""

    async def go() -> str:
        engine = await connect(
            umt.url,
            registry=app_tasks.registry,
            schema=umt.schema,
            run_migrations=False,
            codec=make_codec(),
        )
        try:
            handle = await engine.enqueue(task, payload)
            async with engine.worker(lease=timedelta(seconds=5), shutdown_grace=timedelta(0)):
                await engine.wait_idle([handle.run_id], timeout=30)
            return str(handle.run_id)
        finally:
            await engine.close()

    return asyncio.run(go())


@pytest.fixture
def greeted(umt: Umt) -> str:
    umt.ok("migrate")
    return _finish(umt, "greet", {"name": "Ada Lovelace", "times": 1})


def test_show_without_the_codec_says_encrypted(umt: Umt, greeted: str) -> None:
    result = umt.ok("runs", "show", greeted, "--json")
    data = json.loads(result.stdout)
    assert data["status"] == "completed"
    assert data["input"] == SEALED
    assert data["output"] == SEALED
    assert "Ada" not in result.stdout
    assert "umt-codec/1" not in result.stdout, "never the ciphertext"
    assert "payloads are encrypted (codec zlib+aes-gcm)" in result.stderr
    assert "--codec" in result.stderr
    text = umt.ok("runs", "show", greeted).stdout
    assert SEALED in text
    assert "Ada" not in text


def test_show_with_the_codec_decodes(umt: Umt, greeted: str) -> None:
    data = json.loads(umt.ok("--codec", CODEC, "runs", "show", greeted, "--json").stdout)
    assert data["input"] == {"name": "Ada Lovelace", "times": 1}
    assert data["output"] == "Hi, Ada Lovelace!"  # the newest version, greet@2
    from_env = umt.ok("runs", "show", greeted, "--json", UMT_CODEC=CODEC)
    assert json.loads(from_env.stdout)["input"] == {"name": "Ada Lovelace", "times": 1}
    assert from_env.stderr == ""
    listed = umt.ok("--codec", CODEC, "runs", "list")
    assert greeted in listed.stdout


def test_errors_are_encrypted_too(umt: Umt) -> None:
    umt.ok("migrate")
    run_id = _finish(umt, "boom", {"order_id": "o-1"})
    plain = json.loads(umt.ok("runs", "show", run_id, "--json").stdout)
    assert plain["error"]["message"] == SEALED
    assert plain["error"]["traceback"] == SEALED
    assert plain["error"]["type"].endswith("Error"), "the type stays readable"
    decoded = json.loads(umt.ok("--codec", CODEC, "runs", "show", run_id, "--json").stdout)
    assert "kaboom" in decoded["error"]["message"]
    assert "_explode" in decoded["error"]["traceback"]


def test_enqueue_with_the_codec_stores_it_sealed(umt: Umt) -> None:
    umt.ok("migrate")
    run_id = umt.ok(
        "--codec",
        CODEC,
        "enqueue",
        "greet",
        "--input",
        json.dumps({"name": "Grace Hopper"}),
        "--registry",
        REGISTRY,
    ).stdout.strip()
    uuid.UUID(run_id)
    assert json.loads(umt.ok("runs", "show", run_id, "--json").stdout)["input"] == SEALED
    shown = json.loads(umt.ok("--codec", CODEC, "runs", "show", run_id, "--json").stdout)
    assert shown["input"] == {"name": "Grace Hopper", "times": 1}


@pytest.mark.parametrize(
    ("ref", "code", "message"),
    [
        ("nocolon", 2, "expected the codec as module:attribute"),
        ("tests.integration.cli.codec_app:missing", 1, "has no attribute 'missing'"),
        ("tests.integration.cli.codec_app:not_a_codec", 2, "must be a payload codec"),
        ("no_such_module_here:make", 1, "cannot import 'no_such_module_here'"),
    ],
)
def test_a_bad_codec_is_one_line(umt: Umt, ref: str, code: int, message: str) -> None:
    umt.ok("migrate")
    result = umt("--codec", ref, "runs", "list")
    assert result.exit_code == code, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_rerun_needs_the_codec(umt: Umt, greeted: str) -> None:
    refused = umt("runs", "rerun", greeted)
    assert refused.exit_code == 1, refused.output
    assert "cannot write" in refused.stderr
    assert "--codec" in refused.stderr
    assert "Ada" not in refused.output
    new_id = umt.ok("--codec", CODEC, "runs", "rerun", greeted).stdout.strip()
    shown = json.loads(umt.ok("--codec", CODEC, "runs", "show", new_id, "--json").stdout)
    assert shown["input"] == {"name": "Ada Lovelace", "times": 1}
    assert json.loads(umt.ok("runs", "show", new_id, "--json").stdout)["input"] == SEALED
