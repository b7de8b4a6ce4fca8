"""Test kits: `FakeClock`, crash and freeze helpers, the `Replayer` (today's code against
recorded histories) and the backend contract suite.

`BackendContract` is a pytest test class: subclass it in your backend's tests and provide a
`harness` fixture returning a `BackendHarness` (see `tests/contract/` for the memory and
Postgres ones).
"""

from typing import TYPE_CHECKING

from umt_sdk.testing._clock import FakeClock
from umt_sdk.testing._explorer import CrashPoint, CrashReport, Exploration, explore_crashes
from umt_sdk.testing._helpers import (
    BackendHarness,
    freeze_heartbeats,
    simulate_crash,
    thaw_heartbeats,
)
from umt_sdk.testing._replay import Replayer, ReplayResult

__all__ = [
    "BackendContract",
    "BackendHarness",
    "CrashPoint",
    "CrashReport",
    "Exploration",
    "FakeClock",
    "ReplayResult",
    "Replayer",
    "explore_crashes",
    "freeze_heartbeats",
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
