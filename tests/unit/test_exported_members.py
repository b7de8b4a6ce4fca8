"""The public surface: every `__all__` is sorted and resolves, re-exports name a public module."""

from __future__ import annotations

import importlib
import typing
from datetime import timedelta
from types import ModuleType

import attrs
import cattrs
import pytest

import umt_sdk
import umt_sdk.exceptions
from umt_sdk import _serde

PUBLIC_MODULES = [
    "umt_sdk",
    "umt_sdk.agents",
    "umt_sdk.backend",
    "umt_sdk.dashboard",
    "umt_sdk.exceptions",
    "umt_sdk.testing",
    "umt_backend_memory",
]


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_all_is_sorted_without_duplicates(module_name: str) -> None:
    exported = _module(module_name).__all__
    assert exported == sorted(set(exported))


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_exported_name_resolves(module_name: str) -> None:
    module = _module(module_name)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_star_import_gives_exactly_all(module_name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {module_name} import *", namespace)
    namespace.pop("__builtins__")
    assert sorted(namespace) == sorted(_module(module_name).__all__)


@pytest.mark.parametrize("module_name", ["umt_sdk", "umt_sdk.agents", "umt_backend_memory"])
def test_reexported_classes_report_the_public_module(module_name: str) -> None:
    module = _module(module_name)
    classes = {
        n: getattr(module, n) for n in module.__all__ if isinstance(getattr(module, n), type)
    }
    assert classes, "expected some classes to check"
    wrong = {n: c.__module__ for n, c in classes.items() if c.__module__ != module_name}
    assert wrong == {}


def test_reexported_functions_report_the_public_module() -> None:
    functions = {
        n: getattr(umt_sdk, n)
        for n in umt_sdk.__all__
        if callable(getattr(umt_sdk, n)) and not isinstance(getattr(umt_sdk, n), type)
    }
    assert {"connect", "connect_sync", "step", "task", "with_attempt_token"} <= set(functions)
    assert {n: f.__module__ for n, f in functions.items() if f.__module__ != "umt_sdk"} == {}


@pytest.mark.parametrize("module_name", ["umt_sdk", "umt_sdk.agents", "umt_backend_memory"])
def test_renamed_classes_still_resolve_their_annotations(module_name: str) -> None:
    # Renaming __module__ must not break get_type_hints / attrs / cattrs, which look names up
    # in the namespace of __module__.
    module = _module(module_name)
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, type):
            typing.get_type_hints(obj)
            if attrs.has(obj):
                attrs.resolve_types(obj)


def test_renamed_annotations_are_the_real_types() -> None:
    assert typing.get_type_hints(umt_sdk.RetryPolicy)["initial"] is timedelta
    assert typing.get_type_hints(umt_sdk.RunInfo)["error"] == umt_sdk.ErrorInfo | None


def test_public_records_serialize_with_cattrs() -> None:
    error = umt_sdk.ErrorInfo(type="ValueError", message="bad", traceback="tb")
    page = umt_sdk.RunPage(runs=(), next_cursor=None)
    assert cattrs.Converter().unstructure(page) == {"runs": [], "next_cursor": None}
    text = _serde.encode(error, umt_sdk.ErrorInfo)
    assert _serde.decode(text, umt_sdk.ErrorInfo) == error


def test_exceptions_reexported_from_umt_sdk_are_the_same_objects() -> None:
    for name in umt_sdk.__all__:
        if hasattr(umt_sdk.exceptions, name):
            assert getattr(umt_sdk, name) is getattr(umt_sdk.exceptions, name), name


def test_every_exception_is_an_umt_error() -> None:
    for name in umt_sdk.exceptions.__all__:
        cls = getattr(umt_sdk.exceptions, name)
        assert issubclass(cls, umt_sdk.exceptions.UmtError), name
        assert str(cls()), f"{name} needs a default message"


def test_the_testing_kit_exports_its_assertions_and_run_inline() -> None:
    import umt_sdk.testing

    kit = {"all_enqueued", "assert_enqueued", "refute_enqueued", "run_inline"}
    assert kit <= set(umt_sdk.testing.__all__)
    assert all(callable(getattr(umt_sdk.testing, name)) for name in kit)
