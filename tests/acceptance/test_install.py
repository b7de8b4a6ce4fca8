"""umt as a user installs it: the sdist and the wheel built from the tracked files, the wheel
installed into fresh virtualenvs outside the checkout with no extras, with `[pg]` and with
`[pg,embedded]`, each used as README.md's "Use it in your project" says.

Everything runs in a folder of its own with the environment's PYTHONPATH removed, so nothing
is imported from this checkout. The installs fetch the dependencies from the package index
(pip's cache makes the second and third quick).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXTRA_HINT = "pip install 'umt-tasks[pg]'"
NO_SERVER = "postgresql://nobody@127.0.0.1:9/nowhere"

USER_SCRIPT = """
import asyncio
from umt_sdk import Registry, TaskContext, connect, task

@task("install.double", version=1)
async def double(ctx: TaskContext[int]) -> int:
    return await ctx.step.run("double", lambda: ctx.input * 2)

async def main() -> None:
    engine = await connect("memory://", registry=Registry([double]))
    async with engine.worker():
        run = await engine.enqueue(double, 21)
        print("result", await run.result(timeout=10))
    await engine.close()

asyncio.run(main())
"""

CONNECT_PG = f'''
import asyncio
from umt_sdk import Registry, connect
from umt_sdk.exceptions import BackendNotFoundError

async def main() -> None:
    try:
        await connect("{NO_SERVER}", registry=Registry([]))
    except BackendNotFoundError as exc:
        print("refused:", exc)

asyncio.run(main())
'''

TYPED_USER_FILE = """
from datetime import timedelta

from umt_backend_pg import migrate
from umt_sdk import Engine, Registry, TaskContext, connect, task
from umt_sdk.testing import FakeClock


@task("typed.greet", version=1)
async def greet(ctx: TaskContext[str]) -> str:
    return await ctx.step.run("greet", lambda: "hello " + ctx.input)


async def main(url: str) -> str:
    await migrate(url, schema="umt")
    engine: Engine = await connect(url, registry=Registry([greet]), run_migrations=False)
    run = await engine.enqueue(greet, "you")
    out: str = await run.result(timeout=timedelta(seconds=5).total_seconds())
    await engine.close()
    return out


CLOCK = FakeClock(auto_advance=True)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.pop("UMT_DATABASE_URL", None)
    env.update(extra)
    return env


def _run(
    args: list[str | Path], cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, (
        f"{done.args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build` of the tracked files: the sdist, and the wheel built from it."""
    src = tmp_path_factory.mktemp("src")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
    ).stdout.split(b"\0")
    for name in filter(None, tracked):
        path = REPO / name.decode()
        if path.is_file():
            (src / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name.decode())
    out = tmp_path_factory.mktemp("dist")
    _ok(_run([sys.executable, "-m", "build", "--outdir", out, src], src, _env(), timeout=600))
    return out


def _only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {folder}, found {found}"
    return found[0]


def test_the_wheel_and_the_sdist_hold_every_sql_file_py_typed_and_the_dashboard_files(
    dist: Path,
) -> None:
    sql = sorted(str(p.relative_to(REPO)) for p in (REPO / "umt_backend_pg").rglob("*.sql"))
    assert any("migrations/" in s for s in sql), sql
    typed = [
        f"{package}/py.typed" for package in ("umt_sdk", "umt_backend_memory", "umt_backend_pg")
    ]
    # The dashboard's templates and static files (umt-tasks[dashboard] serves them from there).
    typed += sorted(
        str(p.relative_to(REPO))
        for folder in ("templates", "static")
        for p in (REPO / "umt_sdk" / "dashboard" / folder).iterdir()
    )
    assert "umt_sdk/dashboard/templates/run.html" in typed
    with zipfile.ZipFile(_only(dist, "*.whl")) as wheel:
        names = set(wheel.namelist())
    assert set(sql + typed) <= names, sorted(set(sql + typed) - names)
    with tarfile.open(_only(dist, "*.tar.gz")) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    assert set(sql + typed) <= members, sorted(set(sql + typed) - members)


@pytest.fixture(scope="module")
def outside() -> Iterator[Path]:
    """A folder outside pytest's base temp, for the virtualenvs and the user's folders: the
    embedded Postgres runs as the `embedded_postgres` user when the tests run as root, and every
    pytest session that starts beside this one (an xdist worker, a pytester run) resets
    `pytest-of-<user>` to 0700, which shuts that user out of anything inside it (initdb: "could
    not open file .../share/postgresql.conf.sample for reading: Permission denied")."""
    path = Path(tempfile.mkdtemp(prefix="umt-install-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def venv(dist: Path, outside: Path) -> Callable[[str], Path]:
    """The bin folder of a fresh virtualenv with the wheel installed with these extras."""
    made: dict[str, Path] = {}

    def make(extras: str) -> Path:
        if extras not in made:
            root = outside / f"venv-{extras.replace(',', '-') or 'plain'}"
            root.mkdir()
            _ok(_run([sys.executable, "-m", "venv", root], root, _env()))
            wheel = _only(dist, "*.whl")
            spec = f"{wheel}[{extras}]" if extras else str(wheel)
            _ok(_run([root / "bin" / "python", "-m", "pip", "install", "-q", spec], root, _env()))
            made[extras] = root / "bin"
        return made[extras]

    return make


@pytest.fixture
def home(outside: Path) -> Path:
    """A folder of the user's own, outside the checkout (and outside pytest's base temp)."""
    return Path(tempfile.mkdtemp(prefix="project-", dir=outside))


def test_a_plain_install_runs_the_memory_backend_and_names_the_extra_for_postgres(
    venv: Callable[[str], Path], home: Path
) -> None:
    bin_ = venv("")
    env = _env(PYTHONWARNINGS="error::RuntimeWarning")
    (home / "app.py").write_text(USER_SCRIPT)
    assert "result 42" in _ok(_run([bin_ / "python", "app.py"], home, env))
    shutil.copy(REPO / "examples" / "00_crash_and_resume.py", home)
    assert _ok(_run([bin_ / "python", "00_crash_and_resume.py"], home, env)).strip()

    assert "worker" in _ok(_run([bin_ / "umt", "--help"], home, env))
    version = _ok(_run([bin_ / "umt", "--version"], home, env))
    assert "umt-tasks" in version or "0." in version, version
    assert _ok(_run([bin_ / "python", "-m", "umt_sdk.cli", "--version"], home, env)) == version

    listed = _run([bin_ / "umt", "--database-url", NO_SERVER, "runs", "list"], home, env)
    assert listed.returncode != 0
    assert EXTRA_HINT in listed.stderr, listed.stderr
    assert "Traceback" not in listed.stderr
    assert "RuntimeWarning" not in listed.stderr
    assert len(listed.stderr.strip().splitlines()) == 1, listed.stderr

    (home / "connect_pg.py").write_text(CONNECT_PG)
    refused = _ok(_run([bin_ / "python", "connect_pg.py"], home, env))
    assert "refused:" in refused
    assert EXTRA_HINT in refused, refused


def _enqueue_and_serve(bin_: Path, home: Path, url: str) -> None:
    """The deployment examples' command: `umt worker tasks:registry`, stopped by SIGTERM."""
    for name in ("tasks.py",):
        shutil.copy(REPO / "examples" / "deploy" / name, home)
    env = _env(UMT_DATABASE_URL=url, UMT_REGISTRY="tasks:registry")
    _ok(_run([bin_ / "umt", "migrate"], home, env))
    enqueued = _ok(
        _run(
            [bin_ / "umt", "enqueue", "deploy.greet@1", "--input", '"deploy"', "--json"], home, env
        )
    )
    worker = subprocess.Popen(
        [str(bin_ / "umt"), "worker", "tasks:registry", "--concurrency", "4", "--grace", "5s"],
        cwd=home,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        shown = ""
        while time.monotonic() < deadline:
            shown = _ok(_run([bin_ / "umt", "runs", "list", "--task", "deploy.greet"], home, env))
            if "completed" in shown:
                break
            time.sleep(0.5)
        assert "completed" in shown, f"{enqueued}\n{shown}"
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            _, err = worker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()  # never left running past the test
            _, err = worker.communicate(timeout=10)
            raise AssertionError(f"umt worker ignored SIGTERM for 30 s:\n{err}") from None
    assert worker.returncode == 0, err


def test_the_pg_install_runs_the_examples_the_worker_command_and_type_checks(
    venv: Callable[[str], Path], home: Path, pg_url: str
) -> None:
    bin_ = venv("pg")
    # No database named and no `embedded` extra: one line saying how to get one.
    nowhere = _run(
        [bin_ / "umt", "runs", "list"], home, _env(PYTHONWARNINGS="error::RuntimeWarning")
    )
    assert nowhere.returncode != 0
    assert "UMT_DATABASE_URL" in nowhere.stderr, nowhere.stderr
    assert "Traceback" not in nowhere.stderr
    assert "RuntimeWarning" not in nowhere.stderr
    assert len(nowhere.stderr.strip().splitlines()) == 1, nowhere.stderr

    env = _env(UMT_DATABASE_URL=pg_url, PYTHONWARNINGS="error::RuntimeWarning")
    for example in ("00_crash_and_resume.py", "06_transactional_enqueue.py"):
        shutil.copy(REPO / "examples" / example, home)
        assert _ok(_run([bin_ / "python", example], home, env)).strip()
    _enqueue_and_serve(bin_, home, pg_url)

    (home / "typed_app.py").write_text(TYPED_USER_FILE)
    mypy = Path(sys.executable).parent / "mypy"
    checked = _run(
        [
            mypy,
            "--strict",
            "--no-incremental",
            "--python-executable",
            bin_ / "python",
            "typed_app.py",
        ],
        home,
        _env(),
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_deploy_unit_file_is_valid_for_systemd(
    venv: Callable[[str], Path], tmp_path: Path
) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is needed to check examples/deploy (apt-get install systemd)"
    bin_ = venv("pg")
    unit = (REPO / "examples" / "deploy" / "umt-worker.service").read_text()
    env_file = tmp_path / "worker.env"
    env_file.write_text("UMT_DATABASE_URL=postgresql://localhost/app\n")
    here = (
        unit.replace("/srv/app/.venv/bin", str(bin_))
        .replace("/srv/app", str(tmp_path))
        .replace("/etc/umt/worker.env", str(env_file))
        .replace("User=umt", "User=root")
    )
    assert here != unit
    (tmp_path / "umt-worker.service").write_text(here)
    done = _run([analyze, "verify", "--man=no", tmp_path / "umt-worker.service"], tmp_path, _env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert not done.stderr.strip(), done.stderr


def test_the_embedded_install_runs_the_examples_without_a_database_url(
    venv: Callable[[str], Path], home: Path
) -> None:
    bin_ = venv("pg,embedded")
    env = _env(PYTHONWARNINGS="error::RuntimeWarning")
    for example in ("00_crash_and_resume.py", "06_transactional_enqueue.py"):
        shutil.copy(REPO / "examples" / example, home)
        assert _ok(_run([bin_ / "python", example], home, env)).strip()
