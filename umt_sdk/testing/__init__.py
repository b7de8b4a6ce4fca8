"""Test kits: `FakeClock`, crash and freeze helpers, `explore_crashes` (a task crashed at every
point it passes), the `Replayer` (today's code against recorded histories), the deploy check
(`check_deploy`, `live_histories`, `read_histories`: what `umt check` runs), the backend
contract suite, and for testing your own tasks `run_inline` and the `assert_enqueued` family
(with the pytest plugin's fixtures: `umt_engine`, `umt_clock`, `umt_worker`; see
docs/testing.md).

`BackendContract` is a pytest test class: subclass it in your backend's tests and provide a
`harness` fixture returning a `BackendHarness` (see `tests/contract/` for the memory and
Postgres ones).
"""

from typing import TYPE_CHECKING

from umt_sdk.testing._clock import FakeClock
from umt_sdk.testing._deploy_check import (
    DeployCheck,
    check_deploy,
    live_histories,
    read_histories,
)
from umt_sdk.testing._enqueued import all_enqueued, assert_enqueued, refute_enqueued
from umt_sdk.testing._explorer import CrashPoint, CrashReport, Exploration, explore_crashes
from umt_sdk.testing._helpers import (
    BackendHarness,
    freeze_heartbeats,
    simulate_crash,
    thaw_heartbeats,
)
from umt_sdk.testing._replay import Replayer, ReplayResult, StepDrift
from umt_sdk.testing._run_inline import run_inline

__all__ = [
    "BackendContract",
    "BackendHarness",
    "CrashPoint",
    "CrashReport",
    "DeployCheck",
    "Exploration",
    "FakeClock",
    "ReplayResult",
    "Replayer",
    "StepDrift",
    "all_enqueued",
    "assert_enqueued",
    "check_deploy",
    "explore_crashes",
    "freeze_heartbeats",
    "live_histories",
    "read_histories",
    "refute_enqueued",
    "run_inline",
    "simulate_crash",
    "thaw_heartbeats",
]

if TYPE_CHECKING:  # type checkers see the class; at run time pytest is imported only when asked
    from umt_sdk.testing._contract import BackendContract


def __getattr__(name: str) -> object:
    # The contract suite imports pytest; load it only when asked for.
    if name == "BackendContract":
        from umt_sdk.testing._contract import BackendContract

        return BackendContract
    raise AttributeError(name)
