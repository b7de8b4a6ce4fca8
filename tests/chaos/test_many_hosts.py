"""Past one machine (issue 18, parts 1 and 3): three worker hosts and a Postgres, each in a
network namespace of its own, under a steady load and a bounded series of faults.

The topology (`tests/chaos/netns.py`): Postgres (an embedded server of this test's own, started
inside its namespace with `ip netns exec`, listening on 10.231.0.10) and three hosts h1..h3,
each running one worker process of each worker group of `examples/download_approval` (`io`
and `agent`, `tests/chaos/hosts_tasks.py`) that reach Postgres over their own veth. h2 reaches
it through a user-space link (`tests/chaos/link_proxy.py`, in h2's namespace) that can add
delay and loss where the kernel has no `sch_netem`. The test process, on the root side, creates
plans (the example's outbox rows: its relay, running here, starts their runs), approves them,
plays the download client, and enqueues through Postgres's Unix socket.

The faults, one after the other while the load runs (each for about three leases, with a pause
between them; the test stops by itself):
1. partition: the host doing the housekeeping (the one that claimed the last scheduled tick)
   is cut off from Postgres (every packet dropped) for three leases, then healed;
2. latency: 200 ms more per round trip and 5% loss on h2 (`tc netem`, or the user-space link);
3. LISTEN cut: the server ends h3's LISTEN sessions only (`pg_terminate_backend`);
4. kill: every process of h3 SIGKILLed, the host restarted two leases later;
5. freeze: every process of h1 SIGSTOPped for two and a half leases, then SIGCONT.

Checked from the database and the workers' step log at the end: no run lost and every run
ended; each plan submitted to the download client once and one asset each (the fenced
effects); no completed step began again; no step recorded under a stale fencing token; the cut
host began no step once its leases had lapsed; the schedule ticked exactly once per tick,
through the partition of the host that was ticking, and retention kept deleting the ticks'
old runs (no elected leader: every worker does both, Postgres decides). Pickup latency and
recovery per fault are measured and printed, not asserted (docs/operations.md has them).

`UMT_SOAK_HOSTS=1` runs the long variant: more load, and the fault series three times.
Needs root and iproute2: where network namespaces cannot be made the test fails, saying why.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import tempfile
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import attrs
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests._procs.support import Process, Spawner, eventually, fetch, q
from tests.chaos import hosts_tasks
from tests.chaos.netns import (
    PG_ADDRESS,
    NamespacesUnavailableError,
    Topology,
    netem_available,
    require_namespaces,
)
from tests.fixtures.private_pg import PrivatePostgres, _embedded, _halt
from umt_backend_pg import OutboxRelay, migrate
from umt_sdk import Engine, Registry, connect
from umt_sdk._cron import tick_of_key

LEASE = 2.0
POLL = 0.5
SOAK = os.environ.get("UMT_SOAK_HOSTS") == "1"
ROUNDS = 3 if SOAK else 1
PLAN_EVERY = 0.25 if SOAK else 0.6
FAULT_FOR = 3 * LEASE
SETTLE = 4 * LEASE
HOSTS = ("h1", "h2", "h3")
PROXY_PORT = 15432


# -- the topology and its Postgres --------------------------------------------------------


@pytest.fixture
def topology() -> Iterator[Topology]:
    try:
        require_namespaces()
    except NamespacesUnavailableError as exc:
        pytest.fail(f"the multi-host test cannot run here: {exc}")
    topo = Topology(prefix=f"umt{os.getpid() % 100000}", hosts=HOSTS)
    try:
        topo.create()
        yield topo
    finally:
        topo.close()


@attrs.frozen
class NetPostgres:
    server: PrivatePostgres
    socket_url: str
    """For the test process (root side): the Unix socket, which namespaces do not separate."""
    tcp_url: str
    """For the hosts: 10.231.0.10 over their veth."""


@pytest.fixture
def net_pg(topology: Topology) -> Iterator[NetPostgres]:
    base = Path(tempfile.mkdtemp(prefix="umt-hosts-pg-"))
    try:
        made = _embedded().get_server(base / "pg", cleanup_mode=None)
        info = made.get_postmaster_info()
        server = PrivatePostgres(
            pgdata=Path(made.pgdata),
            socket_dir=Path(info.socket_dir),
            url=made.get_uri(),
            system_user=made.system_user,
        )
        server.configure({"max_connections": "300"})
        server.stop()
        with (server.pgdata / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {PG_ADDRESS.rsplit('.', 1)[0]}.0/24 trust\n")
        pg_ctl = str(Path(_embedded().__file__).parent / "pginstall" / "bin" / "pg_ctl")
        as_user = ["runuser", "-u", server.system_user, "--"] if server.system_user else []
        topology.run(
            "pg",
            [
                *as_user,
                *(pg_ctl, "-D", str(server.pgdata), "-w", "-l", str(server.pgdata / "log")),
                *("-o", f"-h {PG_ADDRESS}", "-o", f"-k {server.socket_dir}"),
                *("-o", f"-p {server.port}", "start"),
            ],
        )
        server.wait_running()
        tcp = tcp_url(server.url, PG_ADDRESS, server.port)
        try:
            yield NetPostgres(server=server, socket_url=server.url, tcp_url=tcp)
        finally:
            _halt(server)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def tcp_url(socket_url: str, host: str, port: int) -> str:
    """A postgresql:// URL (what `connect` takes) for the same user and database over TCP."""
    info = conninfo_to_dict(socket_url)
    user, dbname = info.get("user", "postgres"), info.get("dbname", "postgres")
    return f"postgresql://{user}@{host}:{port}/{dbname}"


# -- the hosts -------------------------------------------------------------------------------


@attrs.define
class Host:
    name: str
    url: str
    processes: list[Process] = attrs.field(factory=list)


@attrs.define
class Cluster:
    topology: Topology
    spawner: Spawner
    pg: NetPostgres
    hosts: dict[str, Host]
    netem: bool
    control: Path
    """The user-space link's control file (h2), when the kernel has no netem."""

    def start_host(self, name: str) -> list[Process]:
        host = self.hosts[name]
        host.processes = [
            self.spawner.start(
                versions=versions,
                lease=LEASE,
                group=f"{name}.{group}",
                concurrency=4,
                poll=POLL,
                grace=1.0,
                url=host.url,
                prune=1.0,
                prefix=self.topology.exec_prefix(name),
            )
            for group, versions in hosts_tasks.GROUPS.items()
        ]
        return host.processes

    def signal_host(self, name: str, signum: int) -> None:
        for proc in self.hosts[name].processes:
            if proc.alive:
                proc.signal(signum)

    def impair(self, name: str, *, delay: float, loss: float) -> None:
        if self.netem:
            self.topology.netem(name, "delay", f"{int(delay * 1000)}ms", "loss", f"{loss * 100:g}%")
        else:
            self.control.write_text(json.dumps({"delay": delay, "loss": loss}))

    def clear(self, name: str) -> None:
        if self.netem:
            self.topology.clear_netem(name)
        else:
            self.control.write_text("{}")


@pytest.fixture
async def cluster(
    topology: Topology, net_pg: NetPostgres, tmp_path: Path
) -> AsyncIterator[Cluster]:
    schema = "dl_hosts"
    await migrate(net_pg.socket_url, schema=schema)
    await hosts_tasks.dl_app.migrate_business(net_pg.socket_url, schema)
    with Spawner.under(
        tmp_path, tasks="tests.chaos.hosts_tasks", url=net_pg.tcp_url, schema=schema, poll=POLL
    ) as spawner:
        control = spawner.workdir / "h2-link.json"
        proxy = spawner.run(
            "tests.chaos.link_proxy",
            *("--listen", f"127.0.0.1:{PROXY_PORT}", "--to", f"{PG_ADDRESS}:{net_pg.server.port}"),
            *("--control", str(control)),
            name="h2-link",
            prefix=topology.exec_prefix("h2"),
        )
        await proxy.wait_for("READY", timeout=20)
        proxied = tcp_url(net_pg.socket_url, "127.0.0.1", PROXY_PORT)
        hosts = {
            name: Host(name=name, url=proxied if name == "h2" else net_pg.tcp_url) for name in HOSTS
        }
        built = Cluster(
            topology=topology,
            spawner=spawner,
            pg=net_pg,
            hosts=hosts,
            netem=netem_available(),
            control=control,
        )
        for name in HOSTS:
            for proc in built.start_host(name):
                await proc.wait_ready(timeout=60)
        yield built


# -- the load, from the root side -------------------------------------------------------------


@attrs.define
class Load:
    url: str
    schema: str
    engine: Engine
    plans: list[str] = attrs.field(factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            plan_id = await hosts_tasks.dl_app.create_plan(
                self.url, self.schema, url_to_fetch="https://example.test/f.bin", size=4096
            )
            await hosts_tasks.dl_app.approve(self.engine, self.url, self.schema, plan_id, "ops")
            self.plans.append(plan_id)
            await asyncio.sleep(PLAN_EVERY)


async def db_now(url: str) -> datetime:
    rows = await fetch(url, "SELECT clock_timestamp() AS now")
    now: datetime = rows[0]["now"]
    return now


@attrs.define
class Fault:
    name: str
    host: str
    began: datetime
    ended: datetime
    detail: str = ""


LISTEN_SESSIONS = (
    "SELECT pid, {act} AS done, clock_timestamp() AS at FROM pg_stat_activity"
    " WHERE client_addr = %s AND (query LIKE 'LISTEN %%'"
    # After a quiet while the LISTEN connection pings: its last query is then that ping.
    "  OR query LIKE '%%(the LISTEN connection, after a quiet while)%%')"
)


async def listening_again(url: str, address: tuple[str], cut: set[int]) -> datetime | None:
    """When the last of the new LISTEN sessions began, once each cut one has its successor."""
    rows = await fetch(url, LISTEN_SESSIONS.format(act="backend_start"), address)
    fresh = [r["done"] for r in rows if r["pid"] not in cut]
    return max(fresh) if len(fresh) >= len(cut) else None


async def frozen(proc: Process) -> bool:
    return not proc.alive or proc.stopped()


async def inject_faults(cluster: Cluster, url: str, schema: str, faults: list[Fault]) -> None:
    async def quiet() -> None:
        await asyncio.sleep(SETTLE)

    for _ in range(ROUNDS):
        # 1. partition the host doing the housekeeping: the one that claimed the last tick.
        rows = await fetch(
            url,
            q(
                "SELECT e.worker_id FROM {schema}.executions e JOIN {schema}.runs r"
                " ON r.id = e.run_id WHERE r.task_name = 'hosts.tick'"
                " ORDER BY e.claimed_at DESC LIMIT 1",
                schema,
            ),
        )
        leader = rows[0]["worker_id"].split(".")[0] if rows else "h1"
        began = await db_now(url)
        cluster.topology.cut(leader)
        await asyncio.sleep(FAULT_FOR)
        cluster.topology.heal(leader)
        faults.append(Fault("partition", leader, began, await db_now(url), "housekeeper"))
        await quiet()

        # 2. 200 ms more per round trip and 5% loss on h2.
        began = await db_now(url)
        cluster.impair("h2", delay=0.2, loss=0.05)
        await asyncio.sleep(FAULT_FOR)
        cluster.clear("h2")
        how = "tc netem" if cluster.netem else "user-space link"
        faults.append(Fault("latency", "h2", began, await db_now(url), how))
        await quiet()

        # 3. the LISTEN sessions of h3 only, ended by the server.
        h3 = (cluster.topology.address("h3"),)
        began = await db_now(url)
        cut = await fetch(url, LISTEN_SESSIONS.format(act="pg_terminate_backend(pid)"), h3)
        assert cut, "found no LISTEN session of h3 to cut"
        again = await eventually(
            lambda h3=h3, cut=cut: listening_again(url, h3, {r["pid"] for r in cut}),
            timeout=60,
            what="h3's LISTEN sessions to come back",
            interval=0.05,
        )
        back = (again - began).total_seconds()
        faults.append(
            Fault("listen-cut", "h3", began, began, f"{len(cut)} cut, back after {back:.2f} s")
        )
        await asyncio.sleep(FAULT_FOR)
        await quiet()

        # 4. SIGKILL every process of h3; the host comes back two leases later.
        began = await db_now(url)
        for proc in cluster.hosts["h3"].processes:
            proc.kill()
        await asyncio.sleep(2 * LEASE)
        for proc in cluster.start_host("h3"):
            await proc.wait_ready(timeout=60)
        faults.append(Fault("kill", "h3", began, began, "restarted after 2 leases"))
        await quiet()

        # 5. SIGSTOP every process of h1 past the lease, then SIGCONT.
        began = await db_now(url)
        cluster.signal_host("h1", signal.SIGSTOP)
        for proc in cluster.hosts["h1"].processes:
            await eventually(lambda p=proc: frozen(p), timeout=10, what="SIGSTOP on h1")
        await asyncio.sleep(2.5 * LEASE)
        cluster.signal_host("h1", signal.SIGCONT)
        faults.append(Fault("freeze", "h1", began, await db_now(url), "2.5 leases"))
        await quiet()


# -- the test ----------------------------------------------------------------------------------


@pytest.mark.slow
async def test_three_hosts_under_partitions_latency_kills_and_freezes(
    cluster: Cluster, tmp_path: Path
) -> None:
    url, schema = cluster.pg.socket_url, "dl_hosts"
    registry = Registry(hosts_tasks.TASKS)
    engine = await connect(url, registry=registry, schema=schema, run_migrations=False)
    app_schema = hosts_tasks.dl_app.app_schema(schema)
    relay = OutboxRelay(
        url,
        engine,
        hosts_tasks.dl_tasks.routes(2),
        schema=app_schema,
        poll_interval=timedelta(milliseconds=200),
    )
    stop = asyncio.Event()
    # The download client keeps finishing jobs until every run has ended: runs that submitted
    # a job while the load ran wait for its "downloaded" signal.
    client_stop = asyncio.Event()
    load = Load(url=url, schema=schema, engine=engine)
    client = asyncio.create_task(
        hosts_tasks.dl_app.client_daemon(url, schema, tmp_path / "incoming", engine, client_stop)
    )
    faults: list[Fault] = []
    loading: asyncio.Task[None] | None = None
    try:
        async with relay:
            loading = asyncio.create_task(load.run(stop))
            started = await db_now(url)
            await asyncio.sleep(SETTLE)  # the baseline
            baseline_end = await db_now(url)
            await inject_faults(cluster, url, schema, faults)
            stop.set()
            await loading
            ended_load = await db_now(url)
            await drained(cluster, url, schema, len(load.plans), {"the download client": client})
    finally:
        stop.set()
        client_stop.set()
        if loading is not None and not loading.done():  # a fault failed: the load is cut short
            await stopped(loading, "the load")
        await stopped(client, "the download client")
        await engine.close()

    report = await measure(url, schema, started, baseline_end, faults)
    print(report)
    (tmp_path / "report.txt").write_text(report)
    await check_outcomes(cluster, url, schema, load.plans, faults, started, ended_load)


# Once the load and the faults are over, a run waits at most a lease (its holder is gone) and
# a poll to be claimed again, and a step lasts at most the copy plus a few round trips; the
# download client answers a submitted job within its loop's 0.1 s. So some step begins, some
# run ends or an outbox row is dispatched every LEASE + POLL + COPY_SECONDS (4.5 s) while work
# is left, unless it waits for a time set in the database (a run's retry, an outbox row's
# retry after a failed dispatch: that wait counts as moving); five times that with nothing
# moving (a machine three times slower still moves within it) is a stall, which the failure
# reports (what was open and undispatched then).
STALLED_AFTER = 5 * (LEASE + POLL + hosts_tasks.COPY_SECONDS)
# And all of it within what pytest-timeout leaves after the load (about 100 s), so a slow drain
# fails here with the open runs named rather than with pytest-timeout's stack.
DRAIN_AT_MOST = 360.0


async def drained(
    cluster: Cluster, url: str, schema: str, plans: int, helpers: dict[str, asyncio.Task[None]]
) -> None:
    """Until every run has ended. Fails at once when a run ended failed or canceled (the
    counts can then never come right; each must complete), or a helper the runs need ended (the
    download client: a run waiting for its download would wait forever), or after `DRAIN_AT_MOST`,
    saying which runs are open, and what stood still when nothing had moved for
    `STALLED_AFTER` seconds."""
    steps_log = cluster.spawner.workdir / hosts_tasks.STEPS_LOG
    seen: dict[str, str] = {}
    loop = asyncio.get_running_loop()
    began = moved = loop.time()
    last: tuple[str, int] | None = None
    stalls: list[str] = []

    def state() -> str:
        steps = steps_log.read_text().splitlines()[-20:] if steps_log.exists() else []
        return (
            f"{seen.get('state', '')}\nthe last steps begun:\n" + "\n".join(steps) + "\n"
            f"{describe(cluster)}"
        )

    while True:
        for what, helper in helpers.items():
            if helper.done():
                error = None if helper.cancelled() else helper.exception()
                raise AssertionError(
                    f"{what} ended ({error!r}) while runs were open; nothing ends them now\n"
                    f"{state()}"
                ) from error
        if await all_ended(url, schema, plans, seen):
            return
        if seen["ended_badly"]:
            raise AssertionError(
                f"runs ended without completing (each must complete):\n{seen['ended_badly']}\n"
                f"{state()}"
            )
        now = loop.time()
        progress = (seen["progress"], steps_log.stat().st_size if steps_log.exists() else 0)
        if progress != last:
            last, moved = progress, now
        moved = max(moved, now + float(seen["due_in"]))  # waiting for a due time is no stall
        if now - moved > STALLED_AFTER and not stalls:
            # Not failed yet (a relay quiet for longer than this was seen to end well), but
            # what stood still is kept for the failure below, and printed.
            stalls.append(
                f"nothing moved for {STALLED_AFTER:g} s (no run ended, no step began, no outbox "
                f"row dispatched, nothing due later), {now - began:.0f} s into the drain:\n"
                f"{seen['state']}"
            )
            print(stalls[0])
        if now - began > DRAIN_AT_MOST:
            raise AssertionError(
                f"timed out after {DRAIN_AT_MOST:g} s waiting for every run to end\n"
                + "".join(f"{stall}\n" for stall in stalls)
                + f"now (moving: {seen['progress']}, due in {seen['due_in']} s, last moved "
                f"{now - moved:.0f} s ago):\n{state()}"
            )
        await asyncio.sleep(0.5)


async def stopped(helper: asyncio.Task[None], what: str) -> None:
    """Wait (boundedly) for a helper task told to stop; cancel it if it does not."""
    done, _ = await asyncio.wait({helper}, timeout=30)
    if not done:
        helper.cancel()
        await asyncio.wait({helper}, timeout=5)
        raise AssertionError(f"{what} did not stop within 30 s of being told to")
    if not helper.cancelled() and helper.exception() is not None:
        raise AssertionError(f"{what} failed") from helper.exception()


def describe(cluster: Cluster) -> str:
    return "\n".join(p.describe() for p in cluster.spawner.started)


async def all_ended(url: str, schema: str, plans: int, seen: dict[str, str]) -> bool:
    """Whether every plan's runs exist and ended; `seen["state"]` says what is still open."""
    rows = await fetch(
        url,
        q(
            "SELECT count(*) FILTER (WHERE task_name = 'download_plan') AS downloads,"
            " count(*) FILTER (WHERE task_name = 'describe_asset') AS describes,"
            " count(*) FILTER (WHERE status IN ('pending', 'running', 'waiting')"
            " AND task_name <> 'hosts.tick') AS open"
            " FROM {schema}.runs",
            schema,
        ),
    )
    row = rows[0]
    # What is due later, not stuck: an outbox row waiting for its retry (the relay backs off
    # after a failed dispatch), a run waiting for its retry's time.
    app_schema = hosts_tasks.dl_app.app_schema(schema)
    later = await fetch(
        url,
        q(
            "SELECT GREATEST("
            " (SELECT max(next_attempt_at) FROM {app}.outbox_event WHERE status = 'pending'),"
            " (SELECT max(available_at) FROM {schema}.runs WHERE status = 'pending'"
            "  AND task_name <> 'hosts.tick')) - now() AS due_in,"
            " (SELECT count(*) FROM {app}.outbox_event WHERE status = 'pending') AS outbox",
            schema,
            app=app_schema,
        ),
    )
    due_in = later[0]["due_in"]
    seen["due_in"] = str(max(due_in.total_seconds(), 0.0) if due_in is not None else 0.0)
    seen["progress"] = f"{row['downloads']} {row['describes']} {row['open']} {later[0]['outbox']}"
    outbox = await fetch(
        url,
        q(
            "SELECT id, type, attempts, next_attempt_at, last_error FROM {app}.outbox_event"
            " WHERE status <> 'dispatched' ORDER BY id LIMIT 10",
            schema,
            app=app_schema,
        ),
    )
    open_runs = await fetch(
        url,
        q(
            "SELECT r.id, r.task_name, r.status, r.available_at, r.wait_for, r.lease_owner,"
            " r.lease_expires_at"
            " FROM {schema}.runs r WHERE r.status IN ('pending', 'running', 'waiting')"
            " AND r.task_name <> 'hosts.tick' ORDER BY r.id LIMIT 20",
            schema,
        ),
    )
    # The plans whose runs are missing: the download run, the asset it records, the event
    # that starts the describe run, and that run (or its tombstone), each where it is.
    missing = await fetch(
        url,
        q(
            "SELECT p.id AS plan, p.status, p.run_id, a.id AS asset,"
            " (SELECT r.status FROM {schema}.runs r WHERE r.id = p.run_id) AS download,"
            " (SELECT array_agg(o.id || ' ' || o.status || ' ' || o.attempts) FROM"
            "  {app}.outbox_event o WHERE o.payload->>'asset_id' = a.id) AS events,"
            " (SELECT array_agg(r.status) FROM {schema}.runs r"
            "  WHERE r.task_name = 'describe_asset' AND r.input->>'asset_id' = a.id) AS describe,"
            " (SELECT array_agg(t.status) FROM {schema}.pruned_runs t"
            "  WHERE t.task_name <> 'hosts.tick' AND t.created_at >= p.created_at) AS pruned"
            " FROM {app}.plans p LEFT JOIN {app}.assets a ON a.plan_id = p.id"
            " WHERE p.run_id IS NULL OR a.id IS NULL OR NOT EXISTS (SELECT 1 FROM {schema}.runs r"
            "  WHERE r.task_name = 'describe_asset' AND r.input->>'asset_id' = a.id)"
            " ORDER BY p.created_at LIMIT 10",
            schema,
            app=app_schema,
        ),
    )
    # A run that ended failed or canceled never lets the count come right: said at once.
    ended_badly = await fetch(
        url,
        q(
            "SELECT r.id, r.task_name, r.status, r.error FROM {schema}.runs r"
            " WHERE r.status IN ('failed', 'canceled') AND r.task_name <> 'hosts.tick'"
            " ORDER BY r.id LIMIT 10",
            schema,
        ),
    )
    seen["ended_badly"] = "\n".join(str(dict(r)) for r in ended_badly)
    seen["state"] = (
        f"{plans} plans; {row['downloads']} download runs, {row['describes']} describe runs,"
        f" {row['open']} open:\n"
        + "\n".join(str(dict(r)) for r in open_runs)
        + f"\n{later[0]['outbox']} outbox rows not dispatched:\n"
        + "\n".join(str(dict(r)) for r in outbox)
        + "\nplans without their runs (or asset, or event):\n"
        + "\n".join(str(dict(r)) for r in missing)
    )
    return bool(row["downloads"] == plans and row["describes"] == plans and row["open"] == 0)


# -- measures ------------------------------------------------------------------------------


async def pickups(url: str, schema: str) -> list[tuple[datetime, float]]:
    """(created at, seconds until first claimed) of every download run."""
    rows = await fetch(
        url,
        q(
            "SELECT r.created_at, min(e.claimed_at) AS first FROM {schema}.runs r"
            " JOIN {schema}.executions e ON e.run_id = r.id"
            " WHERE r.task_name IN ('download_plan', 'describe_asset')"
            " GROUP BY r.id, r.created_at ORDER BY r.created_at",
            schema,
        ),
    )
    return [(r["created_at"], (r["first"] - r["created_at"]).total_seconds()) for r in rows]


async def measure(
    url: str, schema: str, started: datetime, baseline_end: datetime, faults: list[Fault]
) -> str:
    picked = await pickups(url, schema)
    base = sorted(p for at, p in picked if started <= at < baseline_end) or [0.0]
    p95 = base[min(len(base) - 1, int(len(base) * 0.95))]
    normal = max(2 * p95, p95 + 0.25)
    lines = [
        f"baseline pickup: median {statistics.median(base):.3f} s, p95 {p95:.3f} s over "
        f"{len(base)} runs; 'back to baseline' means every later run picked up within "
        f"{normal:.3f} s",
        "worst pickup: the slowest first claim of a run created during the fault or the pause "
        "after it; stranded: seconds from the fault's start until the last run the host held "
        "was claimed by another worker; host back: seconds from the fault's end until the "
        "host claimed a run again; baseline: seconds from the fault's end until pickups were "
        "back to baseline for good",
        f"{'fault':<11} {'host':<4} {'for s':>6} {'worst pickup':>13} {'stranded':>9} "
        f"{'host back':>13} {'baseline':>12}  detail",
    ]
    for fault in faults:
        window = [
            (at, p)
            for at, p in picked
            if fault.began <= at < fault.ended + timedelta(seconds=SETTLE)
        ]
        worst = max((p for _, p in window), default=0.0)
        # Back to baseline: the first moment after the fault's end from which every run created
        # (until the next fault) was picked up as fast as at baseline.
        after = [(at, p) for at, p in window if at >= fault.ended]
        late = [at for at, p in after if p > normal]
        back = 0.0 if not late else (max(late) - fault.ended).total_seconds()
        stranded = await stranded_resumed(url, schema, fault)
        again = await claims_again(url, schema, fault)
        lines.append(
            f"{fault.name:<11} {fault.host:<4} {(fault.ended - fault.began).total_seconds():>6.1f}"
            f" {worst:>13.3f} {stranded:>9} {again:>13} {back:>12.2f}  {fault.detail}"
        )
    return "\n".join(lines)


async def claims_again(url: str, schema: str, fault: Fault) -> str:
    rows = await fetch(
        url,
        q(
            "SELECT min(claimed_at) - %(ended)s AS after FROM {schema}.executions"
            " WHERE worker_id LIKE %(host)s AND claimed_at >= %(ended)s",
            schema,
        ),
        {"ended": fault.ended, "host": f"{fault.host}.%"},
    )
    after = rows[0]["after"]
    return "-" if after is None else f"{after.total_seconds():.2f}"


async def stranded_resumed(url: str, schema: str, fault: Fault) -> str:
    """How long after the fault began the last run the host held then was claimed again by
    another worker ('-' when it held none)."""
    rows = await fetch(
        url,
        q(
            "SELECT max(n.first - %(began)s) AS worst FROM ("
            "  SELECT e.run_id, min(o.claimed_at) AS first FROM {schema}.executions e"
            "  JOIN {schema}.executions o ON o.run_id = e.run_id"
            "   AND o.fencing_token > e.fencing_token"
            "  WHERE e.worker_id LIKE %(host)s AND e.claimed_at <= %(began)s"
            "   AND (e.ended_at IS NULL OR e.ended_at > %(began)s)"
            "  GROUP BY e.run_id) n",
            schema,
        ),
        {"began": fault.began, "host": f"{fault.host}.%"},
    )
    worst = rows[0]["worst"]
    return "-" if worst is None else f"{worst.total_seconds():.2f}"


async def stranded(url: str, schema: str, fault: Fault) -> list[tuple[str, int]]:
    """(run id, fencing token) of the executions the host held when the fault began that a
    later execution of another claim took over: those the takeover marked `interrupted`. An
    execution the host ended itself (a park, a completion) in the moment between the fault's
    start and the cut taking hold is not one, though its run goes on in a later execution."""
    rows = await fetch(
        url,
        q(
            "SELECT DISTINCT e.run_id, e.fencing_token FROM {schema}.executions e"
            " JOIN {schema}.executions o ON o.run_id = e.run_id"
            "  AND o.fencing_token > e.fencing_token"
            " WHERE e.worker_id LIKE %(host)s AND e.claimed_at <= %(began)s"
            "  AND e.outcome = 'interrupted' AND e.ended_at > %(began)s",
            schema,
        ),
        {"began": fault.began, "host": f"{fault.host}.%"},
    )
    return [(str(r["run_id"]), int(r["fencing_token"])) for r in rows]


# -- checks ---------------------------------------------------------------------------------


async def check_outcomes(
    cluster: Cluster,
    url: str,
    schema: str,
    plans: list[str],
    faults: list[Fault],
    started: datetime,
    ended_load: datetime,
) -> None:
    app_schema = hosts_tasks.dl_app.app_schema(schema)
    # 0 runs lost, every run ended, and ended well.
    runs = await fetch(
        url,
        q(
            "SELECT task_name, status, count(*) AS n FROM {schema}.runs"
            " WHERE task_name <> 'hosts.tick' GROUP BY 1, 2 ORDER BY 1, 2",
            schema,
        ),
    )
    assert {(r["task_name"], r["status"]): r["n"] for r in runs} == {
        ("describe_asset", "completed"): len(plans),
        ("download_plan", "completed"): len(plans),
    }, runs
    per_plan = await fetch(
        url,
        q(
            "SELECT p.id, p.status, p.run_id, (SELECT count(*) FROM {s}.client_jobs j"
            " WHERE j.tag = 'submit:' || p.id) AS jobs,"
            " (SELECT count(*) FROM {s}.assets a WHERE a.plan_id = p.id) AS assets,"
            " (SELECT count(*) FROM {s}.assets a WHERE a.plan_id = p.id"
            "  AND a.description IS NOT NULL) AS described"
            " FROM {s}.plans p",
            app_schema,
            s=app_schema,
        ),
    )
    assert sorted(r["id"] for r in per_plan) == sorted(plans)
    wrong = [
        r
        for r in per_plan
        if (r["status"], r["jobs"], r["assets"], r["described"]) != ("done", 1, 1, 1)
    ]
    # 0 doubled fenced effects: one client job (the fenced submit) and one asset per plan.
    if wrong:
        log = (cluster.spawner.workdir / "steps.log").read_text().splitlines()
        runs_of = {str(r["run_id"]) for r in wrong}
        began = [line for line in log if line.split()[1] in runs_of]
        raise AssertionError(
            f"plans whose effects are missing or doubled: {wrong}; their runs' steps: {began}"
        )

    # 0 completed steps begun again: no step began after a completed record of it, under a
    # newer token (a second before the record's time is allowed for the commit's order).
    completed = {
        (str(r["run_id"]), r["name"]): (r["fencing_token"], r["finished_at"].timestamp())
        for r in await fetch(
            url,
            q(
                "SELECT run_id, name, fencing_token, finished_at FROM {schema}.steps"
                " WHERE kind = 'step' AND status = 'completed'",
                schema,
            ),
        )
    }
    begins = [
        line.split() for line in (cluster.spawner.workdir / "steps.log").read_text().splitlines()
    ]
    rerun = [
        b
        for b in begins
        if (b[1], b[2]) in completed
        and int(b[3]) > completed[(b[1], b[2])][0]
        and float(b[5]) > completed[(b[1], b[2])][1] + 1.0
    ]
    assert not rerun, f"completed steps that began again: {rerun}"

    # No step recorded under a stale token: none finished after a newer execution of its run
    # had claimed it (plus a second for the order of commits).
    stale = await fetch(
        url,
        q(
            "SELECT s.run_id, s.name, s.fencing_token FROM {schema}.steps s"
            " WHERE EXISTS (SELECT 1 FROM {schema}.executions n WHERE n.run_id = s.run_id"
            "  AND n.fencing_token > s.fencing_token"
            "  AND s.finished_at > n.claimed_at + interval '1 second')",
            schema,
        ),
    )
    assert not stale, f"steps recorded under a stale fencing token: {stale}"

    # The cut host began no step once its leases had lapsed, until it was healed.
    for fault in faults:
        if fault.name != "partition":
            continue
        quiet_from = fault.began.timestamp() + LEASE + 1.0
        touched = [
            b
            for b in begins
            if b[4].startswith(f"{fault.host}.")
            and quiet_from < float(b[5]) < fault.ended.timestamp()
        ]
        assert not touched, f"{fault.host} began steps while cut off past its lease: {touched}"
        # ... and, of the runs it held then and another worker took over, those its workers
        # knew they held (they began a step under that claim) are said stopped in their logs.
        # A claim whose answer the cut swallowed gave runs no worker on the host ever saw: the
        # lease expiry alone hands those back.
        known = {
            (run_id, token)
            for run_id, token in await stranded(url, schema, fault)
            if any(
                b[1] == run_id and int(b[3]) == token and b[4].startswith(f"{fault.host}.")
                for b in begins
            )
        }
        ever = [p for p in cluster.spawner.started if p.name.startswith(f"{fault.host}.")]
        said = "".join(p.errors() for p in ever).splitlines()
        for run_id, _ in sorted(known):
            # Whichever way it learnt it: its lease lapsed unrenewed ("lost the lease of run
            # ...: ... stopping its execution"), or a write of it got no answer ("run ...: the
            # backend is unavailable (...); stopping this execution").
            about = [line for line in said if f"run {run_id}" in line]
            if not any("stopping" in line for line in about):
                whole = cluster.spawner.workdir / f"{fault.host}-said.log"
                whole.write_text("\n".join(said))
                ended = await fetch(
                    url,
                    q(
                        "SELECT fencing_token, worker_id, claimed_at, ended_at, outcome"
                        " FROM {schema}.executions WHERE run_id = %(run)s ORDER BY 1",
                        schema,
                    ),
                    {"run": run_id},
                )
                about.append(
                    f"(fault {fault.began} .. {fault.ended}; executions {ended};"
                    f" all the host's lines in {whole})"
                )
            assert any("stopping" in line for line in about), (
                f"{fault.host} held run {run_id} and never said it stopped; its lines about it: "
                f"{about}; the run's steps: {[' '.join(b) for b in begins if b[1] == run_id]}; "
                f"the host's last lines: {said[-40:]}"
            )

    await check_housekeeping(url, schema, faults, started, ended_load)


async def check_housekeeping(
    url: str, schema: str, faults: list[Fault], started: datetime, ended_load: datetime
) -> None:
    """Part 3: one run per tick, every tick (through the partition of the host that ticked),
    and retention kept deleting: no leader needed."""
    rows = await fetch(
        url,
        q(
            "SELECT idempotency_key, created_at, NULL::timestamptz AS pruned_at"
            " FROM {schema}.runs WHERE task_name = 'hosts.tick'"
            " UNION ALL SELECT idempotency_key, created_at, pruned_at"
            " FROM {schema}.pruned_runs WHERE task_name = 'hosts.tick'",
            schema,
        ),
    )
    keys = [r["idempotency_key"] for r in rows]
    assert len(keys) == len(set(keys)), "a tick started two runs"
    ticks = {tick_of_key(key) for key in keys}
    # Every tick due while the load ran (two seconds apart) has its run.
    at = (started + timedelta(seconds=2)).replace(microsecond=0)
    at += timedelta(seconds=at.second % 2)
    due = set()
    while at <= ended_load - timedelta(seconds=2):
        due.add(at)
        at += timedelta(seconds=2)
    assert due <= ticks, f"ticks without a run: {sorted(due - ticks)}"
    for fault in faults:
        if fault.name != "partition":
            continue
        started_during = [r for r in rows if fault.began <= r["created_at"] <= fault.ended]
        assert started_during, f"no tick started while {fault.host} was cut off"
        pruned_during = [
            r for r in rows if r["pruned_at"] and fault.began <= r["pruned_at"] <= fault.ended
        ]
        assert pruned_during, f"retention deleted nothing while {fault.host} was cut off"
