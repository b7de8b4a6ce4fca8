"""The SQL of the backend, read once from the package's .sql files."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

from umt_backend_pg._args import described
from umt_sdk.exceptions import UsageError

__all__ = [
    "SCHEMA_NAME",
    "blocks",
    "migrations",
    "queries",
    "render",
    "render_identifiers",
    "schema_sql",
    "validate_identifier",
    "validate_schema",
]

SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_BLOCK = re.compile(r"^-- name: (?P<name>[a-z_]+)\s*$", re.MULTILINE)


def validate_schema(schema: str) -> str:
    """Schema names are lowercase identifiers; anything else is refused before reaching SQL."""
    if not isinstance(schema, str) or not SCHEMA_NAME.match(schema):
        raise UsageError(
            "schema must be a lowercase identifier (letters, digits, _; at most 63 characters), "
            f"got {described(schema)}",
            argument="schema",
        )
    return schema


def validate_identifier(value: str, what: str) -> str:
    """Table and other names follow the same rule as schema names."""
    if not isinstance(value, str) or not SCHEMA_NAME.match(value):
        raise UsageError(
            f"{what} must be a lowercase identifier (letters, digits, _; at most 63 "
            f"characters), got {described(value)}",
            argument=what,
        )
    return value


def _read(name: str) -> str:
    return (resources.files("umt_backend_pg") / "sql" / name).read_text(encoding="utf-8")


@cache
def queries() -> dict[str, str]:
    """Named query blocks of queries.sql, unrendered."""
    return blocks("queries.sql")


@cache
def blocks(filename: str) -> dict[str, str]:
    """Named blocks (`-- name: x`) of one of the package's .sql files, unrendered."""
    text = _read(filename)
    found: dict[str, str] = {}
    matches = list(_BLOCK.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        found[match["name"]] = text[match.end() : end].strip()
    return found


@cache
def migrations() -> list[tuple[int, str, str]]:
    """(version, name, text) of every numbered migration, in order."""
    folder = resources.files("umt_backend_pg") / "sql" / "migrations"
    found = []
    for entry in folder.iterdir():
        match = re.match(r"^(\d{4})_([a-z0-9_]+)\.sql$", entry.name)
        if match:
            found.append((int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    return sorted(found)


def schema_sql() -> str:
    return _read("schema.sql")


def render(text: str, schema: str) -> str:
    """Put the quoted schema identifier into `{schema}`; nothing else is ever formatted in."""
    composed = sql.SQL(text).format(  # our own .sql files, never input
        schema=sql.Identifier(validate_schema(schema))
    )
    return composed.as_string(None)


def render_identifiers(text: str, **identifiers: str) -> str:
    """Put each quoted identifier into its `{name}`; nothing else is ever formatted in."""
    composed = sql.SQL(text).format(  # our own .sql files, never input
        **{
            name: sql.Identifier(validate_identifier(value, name))
            for name, value in identifiers.items()
        }
    )
    return composed.as_string(None)
