"""The web dashboard: runs, a run's timeline, tasks, workers, schedules, and the actions an
operator takes on them, as an ASGI app (`create_app(engine)`) that `umt dashboard` serves.

Needs the `dashboard` extra: `pip install 'umt-tasks[dashboard]'` (Starlette, Jinja2, uvicorn
and the OpenTelemetry Prometheus exporter). Importing `umt_sdk` never needs it.
"""

from __future__ import annotations

try:
    import jinja2  # noqa: F401
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        f"umt_sdk.dashboard needs the dashboard extra ({exc.name} is missing): "
        "pip install 'umt-tasks[dashboard]'",
        name=exc.name,
    ) from exc

from umt_sdk.dashboard._app import create_app
from umt_sdk.dashboard._callbacks import sign_callback

__all__ = ["create_app", "sign_callback"]
