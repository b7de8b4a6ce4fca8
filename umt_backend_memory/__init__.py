"""The in-memory umt backend: the full SPI in process, with an injectable clock, for tests.

Open it with `await umt_sdk.connect("memory://", registry=..., clock=FakeClock())`; reach the
backend object as `engine.backend` for its inspection and crash helpers.
"""

from umt_backend_memory._backend import CrashHook, MemoryBackend, MemoryLedger
from umt_backend_memory._store import MemoryStore, MemoryTransaction

__all__ = ["CrashHook", "MemoryBackend", "MemoryLedger", "MemoryStore", "MemoryTransaction"]

for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        _obj.__module__ = __name__
del _name, _obj
