"""`umt enqueue` with the keys that shape the flow (`--singleton`, `--debounce`, `--sequence`),
what `umt runs show` says of them, and every bad combination refused, naming the option, with
nothing stored."""

from __future__ import annotations

import json

from tests.integration.cli.test_cli import REGISTRY, Umt, one_error_line


def _enqueue(umt: Umt, name: str, *args: str) -> tuple[str, str]:
    result = umt(
        "enqueue", "greet@1", "--input", json.dumps({"name": name}), "--registry", REGISTRY, *args
    )
    assert result.exit_code == 0, result.output
    return result.stdout.strip(), result.stderr


def test_a_singleton_skips_while_its_run_is_active(umt: Umt) -> None:
    first, _ = _enqueue(umt, "Ada", "--singleton", "mailbox-7")
    again, said = _enqueue(umt, "Bob", "--singleton", "mailbox-7")
    assert again == first
    assert "active run of singleton key 'mailbox-7': nothing stored" in said
    assert umt.show(first)["concurrency_key"] == "mailbox-7"
    assert umt.show(first)["input"] == {"name": "Ada", "times": 1}
    replaced, _ = _enqueue(umt, "Cy", "--singleton", "mailbox-7", "--singleton-mode", "replace")
    assert replaced != first
    assert umt.show(first)["status"] == "canceled"


def test_a_debounced_burst_joins_one_run_that_takes_the_last_input(umt: Umt) -> None:
    first, _ = _enqueue(umt, "Ada", "--debounce", "doc-1", "--debounce-period", "1h")
    again, said = _enqueue(
        umt, "Bob", "--debounce", "doc-1", "--debounce-period", "1h", "--debounce-max-wait", "2h"
    )
    assert again == first
    assert "debounced run of key 'doc-1': it takes this input" in said
    shown = umt.show(first)
    assert (shown["debounce_key"], shown["input"]["name"]) == ("doc-1", "Bob")
    assert "debounce key       doc-1" in umt.ok("runs", "show", first).stdout


def test_a_sequence_key_is_the_runs_key(umt: Umt) -> None:
    first, _ = _enqueue(umt, "Ada", "--sequence", "account-9")
    second, _ = _enqueue(umt, "Bob", "--sequence", "account-9")
    assert first != second
    assert umt.show(second)["concurrency_key"] == "account-9"
    listed = umt.ok("runs", "list", "--json", "--task", "greet", "--key", "account-9").stdout
    assert [r["run_id"] for r in json.loads(listed)] == [second, first]


def test_bad_keys_are_refused_naming_the_option_and_nothing_is_stored(umt: Umt) -> None:
    cases = [
        (["--singleton-mode", "replace"], "--singleton-mode needs --singleton"),
        (["--debounce", "k"], "--debounce needs --debounce-period"),
        (["--debounce-period", "5s"], "--debounce-period needs --debounce"),
        (["--debounce-max-wait", "5s"], "--debounce-max-wait needs --debounce"),
        (["--singleton", ""], "--singleton: "),
        (["--singleton", "x" * 300], "--singleton: "),
        (["--debounce", "k", "--debounce-period", "0s"], "--debounce-period: "),
        (
            ["--debounce", "k", "--debounce-period", "10s", "--debounce-max-wait", "5s"],
            "--debounce-max-wait: ",
        ),
        (["--sequence", ""], "--sequence: "),
        (["--singleton", "a", "--sequence", "b"], "--sequence: "),
        (["--debounce", "k", "--debounce-period", "1s", "--delay", "5s"], "--delay: "),
        (["--singleton", "a", "--idempotency-key", "i"], "--singleton: "),
    ]
    for args, says in cases:
        result = umt(
            "enqueue", "greet@1", "--input", '{"name": "Ada"}', "--registry", REGISTRY, *args
        )
        assert result.exit_code == 2, (args, result.output)
        assert says in one_error_line(result), (args, result.stderr)
    keyed = umt(
        "enqueue",
        "order_report",
        "--input",
        '{"order_id": "o1"}',
        "--registry",
        REGISTRY,
        "--sequence",
        "s",
    )
    assert keyed.exit_code == 2
    assert "has concurrency=" in one_error_line(keyed)
    assert json.loads(umt.ok("runs", "list", "--json").stdout) == []
