"""The examples' runs whose histories are the golden files of `tests/replay/`.

Regenerate the files after a deliberate change of an example's task (a new version, say):
`.venv/bin/python -m tests.replay.examples`. Each example is loaded from its file, its runs are
executed on the memory backend with a `FakeClock` by the inline driver, and their histories are
written to `tests/replay/<example>.jsonl` (one `umt.history` line per run). `test_golden.py`
replays every file against the example's code as it is now.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from umt_sdk import Registry, RunHistory, TaskDefinition, connect
from umt_sdk.testing import FakeClock
from umt_sdk.testing._inline import Facts, drive

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GOLDEN = Path(__file__).resolve().parent

Runs = list[tuple[str, Any, Facts | None]]
"""Per run: the name of the task's definition in the module, its input, the facts it gets."""


def load(stem: str) -> ModuleType:
    """examples/<stem>.py as a module (its `main()` is not run)."""
    name = f"umt_example_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{stem}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # attrs and cattrs resolve annotations through it
    spec.loader.exec_module(module)
    return module


def registry_of(module: ModuleType, runs: Runs) -> Registry:
    """The tasks of `runs` as the example's code has them now."""
    tasks: list[TaskDefinition[Any, Any]] = []
    for attribute, _, _ in runs:
        definition = getattr(module, attribute)
        if definition not in tasks:
            tasks.append(definition)
    return Registry(tasks)


def _crash_and_resume(module: ModuleType) -> Runs:
    module.RELEASE_PROBE.set()  # the example holds the probe until it crashed a worker
    return [("submit_download", module.SubmitDownload("p1"), {"approved": {"by": "ops"}})]


def _steps_and_replay(module: ModuleType) -> Runs:
    module.BODIES["charge"] = 1  # the example hangs the first charge until it crashes a worker
    return [("ship_order", "o-42", None)]


def _sleep_and_facts(module: ModuleType) -> Runs:
    return [
        ("trial", "alice", None),
        ("await_fact", "email-verified", {"email-verified": {"by": "alice"}}),
        ("await_fact", "manager-approval", None),
    ]


def _versioning(module: ModuleType) -> Runs:
    return [("invoice_v1", 3, {"approved": True}), ("invoice_v2", 3, None)]


def _fakeclock(module: ModuleType) -> Runs:
    return [
        ("expense_approval", "e-1", {"decision": {"approved": True}}),
        ("expense_approval", "e-2", {"decision": {"approved": False}}),
        ("expense_approval", "e-3", None),
    ]


def _replay_before_deploy(module: ModuleType) -> Runs:
    return [("refund", "order-1", {"approval": {"by": "support"}})]


EXAMPLE_RUNS: dict[str, Callable[[ModuleType], Runs]] = {
    "00_crash_and_resume": _crash_and_resume,
    "01_hello": lambda module: [("hello", "world", None)],
    "02_steps_and_replay": _steps_and_replay,
    "03_sleep_and_facts": _sleep_and_facts,
    "05_versioning_two_groups": _versioning,
    "07_testing_with_fakeclock": _fakeclock,
    "10_replay_before_deploy": _replay_before_deploy,
}
"""The examples on the memory backend whose tasks make histories (04 and 06 need Postgres and
business tables, 08 a backend of its own)."""


async def histories_of(stem: str) -> list[RunHistory]:
    """Run the example's runs to their end and export their histories."""
    module = load(stem)
    runs = EXAMPLE_RUNS[stem](module)
    engine = await connect("memory://", registry=registry_of(module, runs), clock=FakeClock())
    try:
        histories = []
        for attribute, payload, facts in runs:
            definition = getattr(module, attribute)
            handle = await engine.enqueue(definition, payload, version=definition.version)
            await drive(engine, handle.run_id, facts=facts)
            histories.append(await engine.export_history(handle.run_id))
        return histories
    finally:
        await engine.close()


async def regenerate() -> None:
    for stem in EXAMPLE_RUNS:
        histories = await histories_of(stem)
        path = GOLDEN / f"{stem}.jsonl"
        path.write_text("".join(h.to_json() + "\n" for h in histories), encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)} ({len(histories)} runs)")


if __name__ == "__main__":
    asyncio.run(regenerate())
