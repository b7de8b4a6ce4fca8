"""DBOS Transact workload process (runs in the peers' virtualenv; see bench/_peers.py).

    python dbos_worker.py enqueue --dsn URL --n N --k K
    python dbos_worker.py work    --dsn URL --k K --wid I --concurrency C --poll S

Workflows of K no-op steps on a DB-backed queue. The queue is registered at GO, so nothing is
dequeued before the harness says so (DBOS notices new queues within ~1 s; the harness measures
from the first workflow start).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _proto import Control, send

QUEUE = "bench_q"
FIRST_START: list[float] = []
HANDLED = [0]
_LOCK = threading.Lock()


def sqlalchemy_url(url: str) -> str:
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def build(dsn: str, wid: str, pool: int = 0):  # type: ignore[no-untyped-def]  # runs in the peers venv; dbos types not here
    from dbos import DBOS

    @DBOS.step(name="bench_noop")
    def noop(i: int) -> int:
        return i

    @DBOS.workflow(name="bench_wf")
    def wf(k: int) -> int:
        with _LOCK:
            if not FIRST_START:
                FIRST_START.append(time.time())
            HANDLED[0] += 1
        for i in range(k):
            noop(i)
        return k

    config = {
        "name": "umt-bench",
        "system_database_url": sqlalchemy_url(dsn),
        "application_version": "bench-1",
        "executor_id": wid,
        "log_level": "WARNING",
    }
    if pool:
        config["sys_db_pool_size"] = pool
    DBOS(config=config)  # type: ignore[arg-type]  # a plain dict, DBOS takes its TypedDict
    logging.getLogger("dbos").setLevel(logging.WARNING)
    DBOS.launch()
    return DBOS, wf


def enqueue(args: argparse.Namespace) -> None:
    dbos, wf = build(args.dsn, "enqueuer")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: dbos.enqueue_workflow(QUEUE, wf, args.k), range(args.n)))
    seconds = time.perf_counter() - t0
    dbos.destroy(destroy_registry=True)
    send("RESULT", {"enqueue_s": seconds, "enqueue_per_s": args.n / seconds if seconds else 0})


def work(args: argparse.Namespace) -> None:
    control = Control()
    dbos, _ = build(args.dsn, f"w{args.wid}", args.pool)
    send("READY")
    control.go.wait()
    dbos.register_queue(QUEUE, worker_concurrency=args.concurrency, polling_interval_sec=args.poll)
    control.stop.wait()
    cpu = control.cpu_since_go()
    count, first = HANDLED[0], (FIRST_START[0] if FIRST_START else None)
    send("RESULT", {"count": count, "first_start": first, "cpu_s": cpu})
    try:
        dbos.destroy(destroy_registry=True)
    finally:
        os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["enqueue", "work", "version"])
    parser.add_argument("--dsn", default="")
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--wid", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--poll", type=float, default=0.1)
    parser.add_argument("--pool", type=int, default=0, help="sys_db_pool_size (0: default)")
    args = parser.parse_args()
    if args.mode == "enqueue":
        enqueue(args)
    elif args.mode == "work":
        work(args)


if __name__ == "__main__":
    main()
