"""Targets (reported, never asserted), the Markdown table and the plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plots", "markdown", "targets"]


def _med(node: Any, *path: str) -> float | None:
    """The median at `path` (a summary dict), or a plain number, or None."""
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if isinstance(node, dict):
        node = node.get("median")
    return float(node) if isinstance(node, int | float) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _target(
    name: str, value: float | None, threshold: float, op: str, unit: str = "", note: str = ""
) -> dict[str, Any]:
    met = None
    if value is not None:
        met = {
            ">=": value >= threshold,
            "<=": value <= threshold,
            "<": value < threshold,
            ">": value > threshold,
        }[op]
    return {
        "target": name,
        "value": value,
        "threshold": threshold,
        "op": op,
        "unit": unit,
        "met": met,
        "note": note,
    }


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    d1, d10 = r.get("drain_1step", {}), r.get("drain_10step", {})
    out = []
    peer_note = "peer not measured"
    umt10 = _med(d10, "umt", "steps_per_s")
    dbos10 = _med(d10, "dbos", "steps_per_s")
    out.append(
        _target(
            "umt >= 20x DBOS, 10-step drain throughput (steps/s)",
            _ratio(umt10, dbos10),
            20,
            ">=",
            "x",
            "" if dbos10 else peer_note,
        )
    )
    cpu = r.get("client_cpu_per_step_ms", {})
    out.append(
        _target(
            "umt >= 20x less client CPU per step than DBOS",
            _ratio(_med(cpu, "dbos"), _med(cpu, "umt")),
            20,
            ">=",
            "x",
            "" if _med(cpu, "dbos") else peer_note,
        )
    )
    pgq = _med(d1, "pgqueuer", "runs_per_s")
    out.append(
        _target(
            "umt >= pgqueuer, 1-step runs/s at equal connections",
            _ratio(_med(d1, "umt", "runs_per_s"), pgq),
            1.0,
            ">=",
            "x",
            "" if pgq else peer_note,
        )
    )
    out.append(
        _target(
            "<= 1 server transaction per step (umt, 10-step drain)",
            _med(r.get("db_work_per_step", {}), "umt", "xact_per_step"),
            1.0,
            "<=",
            "xact/step",
        )
    )
    out.append(
        _target("ratio_vs_ceiling >= 0.8 (1-step)", _med(d1, "ratio_vs_ceiling"), 0.8, ">=", "")
    )
    out.append(
        _target(
            "enqueue-to-start p50 < 5 ms (LISTEN on)",
            _med(r.get("enqueue_to_start_ms", {}), "listen", "p50"),
            5.0,
            "<",
            "ms",
        )
    )
    claim = r.get("claim_ms_foreign_backlog", {})
    backlog = claim.get("backlog_foreign")
    size = f"{backlog:,}" if isinstance(backlog, int) else "?"
    out.append(
        _target(
            f"claim < 2 ms with a foreign backlog ({size} pending runs; p50)",
            _med(claim, "umt", "p50"),
            2.0,
            "<",
            "ms",
            "" if backlog == 200_000 else "target is stated for 200,000",
        )
    )
    for key, entry in sorted(r.get("recovery_after_sigkill_s", {}).items()):
        if not isinstance(entry, dict) or "lease_s" not in entry:
            continue
        lease = float(entry["lease_s"])
        worst = entry.get("recovery_s", {}).get("max")
        reexec = entry.get("reexecuted_completed_steps")
        t = _target(
            f"recovery within lease + 1 s ({key}, worst repetition)",
            worst,
            lease + 1.0,
            "<=",
            "s",
            f"re-executed completed steps: {reexec}",
        )
        if reexec not in (0, None) and t["met"]:
            t["met"] = False
        out.append(t)
    out.append(
        _target(
            "memory backend > 5,000 runs/s (3-step runs)",
            _med(r.get("memory_backend_runs_per_s", {}), "runs_per_s"),
            5000,
            ">",
            "runs/s",
        )
    )
    return out


def _fmt(node: Any, digits: int = 1) -> str:
    if isinstance(node, dict) and "missing" in node:
        return "missing"
    if isinstance(node, dict):
        med, lo, hi = node.get("median"), node.get("min"), node.get("max")
        if med is None:
            return "-"
        if lo is None or hi is None or lo == hi:
            return f"{med:,.{digits}f}"
        return f"{med:,.{digits}f} [{lo:,.{digits}f}-{hi:,.{digits}f}]"
    if isinstance(node, int | float):
        return f"{node:,.{digits}f}"
    return "-"


def _get(node: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(node, dict):
            return None
        if "missing" in node:
            return node
        node = node.get(key)
    return node


def markdown(r: dict[str, Any]) -> str:
    meta = r.get("meta", {})
    machine, pg = meta.get("machine", {}), meta.get("postgres", {})
    d1, d10 = r.get("drain_1step", {}), r.get("drain_10step", {})
    raw = r.get("raw_ceiling", {})
    lines = [
        f"## umt benchmark ({'quick' if meta.get('quick') else 'full'} mode)",
        "",
        f"- date: {machine.get('date')}, machine: {machine.get('cpu_model', '?')}, "
        f"{machine.get('cpu_count')} CPUs, {machine.get('platform')}",
        f"- Postgres {pg.get('server_version')} ({'embedded' if pg.get('embedded') else 'url'})"
        f", synchronous_commit={pg.get('synchronous_commit')}, fsync={pg.get('fsync')}, "
        f"shared_buffers={pg.get('shared_buffers')}, "
        f"pg_stat_statements={'on' if pg.get('pg_stat_statements') else 'off'}",
        f"- load average before {meta.get('loadavg_before')}, after "
        f"{meta.get('loadavg_after')}; {meta.get('reps')} repetitions interleaved, "
        f"{meta.get('workers')} worker processes x 1 connection each; median [min-max]",
        "",
        "### Drain throughput (pre-enqueued runs of no-op steps)",
        "",
        "| system | 1-step runs/s | 10-step steps/s | client CPU ms/step (10-step) | "
        "server xact/run (1-step) | WAL B/run (1-step) |",
        "|---|---|---|---|---|---|",
    ]
    rows = [
        ("raw psycopg ceiling", raw.get("drain"), None),
        ("raw ceiling incl. insert", raw.get("lifecycle"), None),
        ("umt", d1.get("umt"), d10.get("umt")),
        ("DBOS", d1.get("dbos"), d10.get("dbos")),
        ("pgqueuer (no durability)", d1.get("pgqueuer"), None),
        ("procrastinate (no durability)", d1.get("procrastinate"), None),
    ]
    for label, one, ten in rows:
        if one is None and ten is None:
            continue
        lines.append(
            f"| {label} | {_fmt(_get(one, 'runs_per_s'))} | "
            f"{_fmt(_get(ten, 'steps_per_s')) if ten is not None else '-'} | "
            f"{_fmt(_get(ten, 'client_cpu_ms_per_step'), 3) if ten is not None else '-'} | "
            f"{_fmt(_get(one, 'xact_per_run'), 2)} | {_fmt(_get(one, 'wal_bytes_per_run'), 0)} |"
        )
    missing = [
        f"{name}: {node['missing']}"
        for name, node in list(d1.items()) + list(d10.items())
        if isinstance(node, dict) and "missing" in node
    ]
    lines += ["", f"umt / raw ceiling (1-step): {_fmt(d1.get('ratio_vs_ceiling'), 2)}", ""]
    work = r.get("db_work_per_step", {})
    lines += [
        "### Server work per step and per run (10-step drain)",
        "",
        "| system | xact/step | statements/step | WAL B/step | xact/run | statements/run | "
        "WAL B/run |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("umt", "dbos"):
        w = work.get(name)
        if not isinstance(w, dict) or "missing" in w:
            lines.append(f"| {name} | missing | | | | | |")
            continue
        lines.append(
            f"| {name} | {_fmt(w.get('xact_per_step'), 2)} | "
            f"{_fmt(w.get('statements_per_step'), 2)} | {_fmt(w.get('wal_bytes_per_step'), 0)} |"
            f" {_fmt(w.get('xact_per_run'), 1)} | {_fmt(w.get('statements_per_run'), 1)} | "
            f"{_fmt(w.get('wal_bytes_per_run'), 0)} |"
        )
    lat = r.get("enqueue_to_start_ms", {})
    claim = r.get("claim_ms_foreign_backlog", {})
    lines += [
        "",
        "### Latency and recovery (umt)",
        "",
        "| figure | value |",
        "|---|---|",
        f"| enqueue-to-start, LISTEN on: p50 / p99 ms | {_fmt(_get(lat, 'listen', 'p50'), 2)}"
        f" / {_fmt(_get(lat, 'listen', 'p99'), 2)} |",
        f"| enqueue-to-start, poll only (poll {lat.get('poll_interval_s')} s): p50 / p99 ms | "
        f"{_fmt(_get(lat, 'poll', 'p50'), 1)} / {_fmt(_get(lat, 'poll', 'p99'), 1)} |",
        f"| claim with {claim.get('backlog_foreign', '?'):,} foreign pending: umt p50 / p99 ms |"
        f" {_fmt(_get(claim, 'umt', 'p50'), 3)} / {_fmt(_get(claim, 'umt', 'p99'), 3)} |"
        if isinstance(claim.get("backlog_foreign"), int)
        else "| claim | - |",
        f"| same data, unfiltered available_at-ordered claim (replaced engine): p50 / p99 ms | "
        f"{_fmt(_get(claim, 'legacy', 'p50'), 3)} / {_fmt(_get(claim, 'legacy', 'p99'), 3)} |",
        f"| umt claim plan uses only the pair's index | {claim.get('umt_uses_pair_index')} |",
    ]
    for key, entry in sorted(r.get("recovery_after_sigkill_s", {}).items()):
        if isinstance(entry, dict) and "recovery_s" in entry:
            reexecuted = entry.get("reexecuted_completed_steps")
            lines.append(
                f"| recovery after SIGKILL, {key.replace('_', ' ')}: s (re-executed completed "
                f"steps) | {_fmt(entry['recovery_s'], 2)} ({reexecuted}) |"
            )
    mem = r.get("memory_backend_runs_per_s", {})
    lines.append(
        f"| memory backend, 3-step runs end to end, runs/s | {_fmt(mem.get('runs_per_s'), 0)} |"
    )
    lines += [
        "",
        "### Targets (reported, not asserted)",
        "",
        "| target | value | met |",
        "|---|---|---|",
    ]
    for t in r.get("targets", []):
        value = "-" if t["value"] is None else f"{t['value']:,.3g} {t['unit']}".strip()
        met = {True: "met", False: "**missed**", None: "n/a"}[t["met"]]
        note = f" ({t['note']})" if t.get("note") else ""
        lines.append(
            f"| {t['target']} | {value} (threshold {t['op']} {t['threshold']:g}){note} | {met} |"
        )
    if missing:
        lines += ["", "Not measured: " + "; ".join(sorted(set(missing)))]
    notes = meta.get("notes") or []
    if notes:
        lines += ["", "Notes: " + "; ".join(notes)]
    return "\n".join(lines) + "\n"


def plots(r: dict[str, Any], folder: Path) -> list[str]:
    """PNG plots; returns the written file names, or raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def bars(
        ax: Any, items: list[tuple[str, Any]], title: str, ylabel: str, log: bool = False
    ) -> None:
        names, meds, lo, hi = [], [], [], []
        for name, node in items:
            if not isinstance(node, dict) or node.get("median") is None:
                continue
            names.append(name)
            meds.append(node["median"])
            lo.append(node["median"] - node["min"])
            hi.append(node["max"] - node["median"])
        ax.bar(names, meds, yerr=[lo, hi], capsize=4, color="#4477aa")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if log and meds:
            ax.set_yscale("log")
        ax.tick_params(axis="x", labelrotation=20)

    d1, d10 = r.get("drain_1step", {}), r.get("drain_10step", {})
    raw = r.get("raw_ceiling", {})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    bars(
        axes[0],
        [
            ("raw ceiling", _get(raw, "drain", "runs_per_s")),
            ("umt", _get(d1, "umt", "runs_per_s")),
            ("pgqueuer", _get(d1, "pgqueuer", "runs_per_s")),
            ("procrastinate", _get(d1, "procrastinate", "runs_per_s")),
            ("DBOS", _get(d1, "dbos", "runs_per_s")),
        ],
        "1-step drain",
        "runs/s",
        log=True,
    )
    bars(
        axes[1],
        [("umt", _get(d10, "umt", "steps_per_s")), ("DBOS", _get(d10, "dbos", "steps_per_s"))],
        "10-step drain",
        "steps/s",
        log=True,
    )
    fig.tight_layout()
    fig.savefig(folder / "drain_throughput.png", dpi=100)
    plt.close(fig)
    written.append("drain_throughput.png")

    work = r.get("db_work_per_step", {})
    cpu = r.get("client_cpu_per_step_ms", {})
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    bars(
        axes[0],
        [("umt", cpu.get("umt")), ("DBOS", cpu.get("dbos"))],
        "client CPU per step",
        "ms",
        log=True,
    )
    bars(
        axes[1],
        [
            ("umt", _get(work, "umt", "xact_per_step")),
            ("DBOS", _get(work, "dbos", "xact_per_step")),
        ],
        "server transactions per step",
        "xact",
    )
    bars(
        axes[2],
        [
            ("umt", _get(work, "umt", "wal_bytes_per_step")),
            ("DBOS", _get(work, "dbos", "wal_bytes_per_step")),
        ],
        "WAL per step",
        "bytes",
    )
    fig.tight_layout()
    fig.savefig(folder / "work_per_step.png", dpi=100)
    plt.close(fig)
    written.append("work_per_step.png")

    lat = r.get("enqueue_to_start_ms", {})
    claim = r.get("claim_ms_foreign_backlog", {})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    names = ["LISTEN p50", "LISTEN p99", "poll p50", "poll p99"]
    values = [
        _get(lat, "listen", "p50"),
        _get(lat, "listen", "p99"),
        _get(lat, "poll", "p50"),
        _get(lat, "poll", "p99"),
    ]
    pairs = [(n, v) for n, v in zip(names, values, strict=True) if isinstance(v, int | float)]
    axes[0].bar([p[0] for p in pairs], [p[1] for p in pairs], color="#228833")
    axes[0].set_yscale("log")
    axes[0].set_title("enqueue to start (umt)")
    axes[0].set_ylabel("ms")
    names = ["umt p50", "umt p99", "replaced p50", "replaced p99"]
    values = [
        _get(claim, "umt", "p50"),
        _get(claim, "umt", "p99"),
        _get(claim, "legacy", "p50"),
        _get(claim, "legacy", "p99"),
    ]
    pairs = [(n, v) for n, v in zip(names, values, strict=True) if isinstance(v, int | float)]
    axes[1].bar([p[0] for p in pairs], [p[1] for p in pairs], color="#ee6677")
    axes[1].set_yscale("log")
    axes[1].set_title(f"claim with {claim.get('backlog_foreign', '?')} foreign pending runs")
    axes[1].set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(folder / "latency.png", dpi=100)
    plt.close(fig)
    written.append("latency.png")
    return written
