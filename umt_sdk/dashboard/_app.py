"""The dashboard's ASGI app: routes, the pages' rendering and the actions.

Everything it reads and writes goes through the engine's public API (`engine.list`, `get`,
`cancel`, `signal`, `settle`, `rerun`, `enqueue`, `pause`, `resume`, `schedules`) and the
backend SPI's read records (`umt_sdk.backend`): the dashboard holds no SQL and works on any backend.
Templates are Jinja2 with autoescape on for every template; no inline script or style runs
(the content security policy forbids it), so a stored value can only ever show as text.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode
from uuid import UUID

import jinja2
import markupsafe
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._definition import TaskDefinition
from umt_sdk._engine import Engine
from umt_sdk._insight import TaskStats, WorkerInfo
from umt_sdk._schedules import ScheduleInfo
from umt_sdk.dashboard import _callbacks as callbacks
from umt_sdk.dashboard import _forms as forms
from umt_sdk.dashboard import _pages as pages
from umt_sdk.dashboard import _security as security
from umt_sdk.dashboard._metrics import CONTENT_TYPE, StoreMetrics
from umt_sdk.exceptions import PayloadError, RunNotFoundError, UmtError, UsageError

__all__ = ["create_app"]

Handler = Callable[[Request], Awaitable[Response]]

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _visible(value: Any) -> Any:
    """Every value a template prints: control characters (but tab and newlines) shown as
    `\\xNN`, so a stored value cannot hide text or garble the page; escaping follows."""
    if (
        isinstance(value, str)
        and not isinstance(value, markupsafe.Markup)
        and _CONTROL.search(value)
    ):
        return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value)
    return value


_TEMPLATES = jinja2.Environment(
    finalize=_visible,
    loader=jinja2.PackageLoader("umt_sdk.dashboard", "templates"),
    autoescape=True,  # every template, whatever its name
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_TEMPLATES.globals.update(
    when=pages.when,
    age=pages.age,
    cell=pages.cell,
    pretty_json=pages.pretty_json,
    error_text=pages.error_text,
    finished=pages.finished,
    statuses=pages.STATUSES,
)


class _Dashboard:
    """The state behind the routes: the engine and how the app was configured."""

    def __init__(
        self,
        engine: Engine,
        *,
        read_only: bool,
        token: str | None,
        trace_url_template: str | None,
        title: str,
        callback_secrets: tuple[str, ...] = (),
    ) -> None:
        self.engine = engine
        self.callback_secrets = callback_secrets
        self.read_only = read_only
        self.token = token
        self.trace_url_template = trace_url_template
        self.title = title
        self.store_metrics = StoreMetrics(engine)

    # -- rendering ------------------------------------------------------------------------------

    def registered(self, name: str, version: int) -> TaskDefinition[Any, Any] | None:
        try:
            return self.engine.registry.get(name, version)
        except LookupError:
            return None

    def render(
        self, request: Request, template: str, status_code: int = 200, **context: Any
    ) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        context.setdefault("notice", "")
        html = _TEMPLATES.get_template(template).render(
            root=root,
            path=request.url.path,
            title=self.title,
            read_only=self.read_only,
            csrf_field=security.CSRF_FIELD,
            csrf=security.csrf_token(request),
            now=datetime.now(UTC),
            **context,
        )
        return HTMLResponse(html, status_code=status_code)

    def problem(self, request: Request, status_code: int, message: str) -> HTMLResponse:
        return self.render(request, "problem.html", status_code=status_code, message=message)

    def trace_url(self, trace_id: str | None) -> str | None:
        if trace_id is None or not self.trace_url_template:
            return None
        return self.trace_url_template.replace("{trace_id}", trace_id)

    # -- access ---------------------------------------------------------------------------------

    async def guard(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        """Middleware: with a token, nothing but the login page and the static files is served
        to a request that does not carry it."""
        path = request.url.path.removeprefix(request.scope.get("root_path", ""))
        if self.token is None or (path == "/callbacks/complete" and self.callback_secrets):
            # The callback endpoint is authenticated by its signature, not the access token.
            return await call_next(request)
        if path.startswith(("/login", "/static/")) or security.token_matches(request, self.token):
            return await call_next(request)
        if path == "/metrics" or "text/html" not in request.headers.get("accept", ""):
            return PlainTextResponse(
                "this dashboard needs its access token (Authorization: Bearer ...)",
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        root = request.scope.get("root_path", "")
        return RedirectResponse(f"{root}/login?{urlencode({'next': path})}", status_code=303)

    async def login(self, request: Request) -> Response:
        next_path = str(request.query_params.get("next", "/runs"))
        if not next_path.startswith("/") or next_path.startswith("//"):
            next_path = "/runs"
        if request.method == "GET":
            return self.render(request, "login.html", next_path=next_path, failed=False)
        form = await request.form()
        given = str(form.get("token", ""))
        if self.token is None or not security.csrf_ok(
            request, str(form.get(security.CSRF_FIELD, ""))
        ):
            return self.problem(request, 403, "the login form expired: load it again")
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return self.render(
                request, "login.html", status_code=401, next_path=next_path, failed=True
            )
        root = request.scope.get("root_path", "")
        response = RedirectResponse(f"{root}{next_path}", status_code=303)
        response.set_cookie(
            security.TOKEN_COOKIE, self.token, httponly=True, samesite="strict", path=root or "/"
        )
        return response

    async def action_form(self, request: Request) -> Mapping[str, Any] | Response:
        """The form of an action, or the response refusing it (read-only, CSRF, origin)."""
        if self.read_only:
            return self.problem(request, 403, "this dashboard is read-only (--read-only)")
        form = await request.form()
        if not security.same_origin(request) or not security.csrf_ok(
            request, str(form.get(security.CSRF_FIELD, ""))
        ):
            return self.problem(
                request,
                403,
                "the form's CSRF check failed (it came from another site, or it expired): "
                "reload the page and try again",
            )
        return {key: form.get(key) for key in form}

    def back(self, request: Request, path: str, **notice: str) -> RedirectResponse:
        root = request.scope.get("root_path", "")
        query = f"?{urlencode(notice)}" if notice else ""
        return RedirectResponse(f"{root}{path}{query}", status_code=303)

    # -- runs -------------------------------------------------------------------------------------

    async def runs(self, request: Request) -> Response:
        filters = pages.RunFilters.parse(request.query_params)
        view = await pages.fetch_runs(self.engine, filters)
        template = "runs_rows.html" if request.url.path.endswith("/rows") else "runs.html"
        return self.render(
            request,
            template,
            view=view,
            filters=view.filters,
            notice=str(request.query_params.get("notice", ""))[:300],
        )

    async def _run_info(self, request: Request) -> Any:
        text = request.path_params["run_id"]
        try:
            run_id = UUID(text)
        except ValueError:
            return self.problem(request, 404, "not a run id (a UUID)")
        try:
            return await self.engine.get(run_id)
        except RunNotFoundError as exc:
            return self.problem(request, 404, str(exc))

    async def run(self, request: Request) -> Response:
        info = await self._run_info(request)
        if isinstance(info, Response):
            return info
        children = await self.engine.list(parent=info.run_id, limit=100)
        try:
            heads = await self.engine.stream_heads([info.run_id])
        except UsageError:  # a backend that stores no streams
            heads = {}
        streams = heads.get(info.run_id, {})
        facts = [v for v in info.timeline if v.kind == "fact"]
        template = "run_live.html" if request.url.path.endswith("/live") else "run.html"
        return self.render(
            request,
            template,
            info=info,
            keys=pages.run_keys(info, self.registered(info.task_name, info.task_version)),
            timeline=pages.build_timeline(info, datetime.now(UTC)),
            children=children,
            streams=streams,
            facts=facts,
            trace_url=self.trace_url(info.trace_id),
            notice=str(request.query_params.get("notice", ""))[:300],
            stream_json=lambda item: pages.cell(json.dumps(item.value), 300),
        )

    async def cancel_run(self, request: Request) -> Response:
        form = await self.action_form(request)
        if isinstance(form, Response):
            return form
        info = await self._run_info(request)
        if isinstance(info, Response):
            return info
        reason = str(form.get("reason") or "canceled from the dashboard")[:500]
        try:
            outcome = await self.engine.cancel(info.run_id, reason=reason)
        except UmtError as exc:
            return self.problem(request, 400, str(exc))
        text = {
            "canceled": "canceled",
            "requested": "cancel requested: the run stops at its next step",
            "already_finished": "the run had already finished: nothing to cancel",
        }[outcome]
        return self.back(request, f"/runs/{info.run_id}", notice=text)

    async def signal_run(self, request: Request) -> Response:
        form = await self.action_form(request)
        if isinstance(form, Response):
            return form
        info = await self._run_info(request)
        if isinstance(info, Response):
            return info
        name = str(form.get("name") or "").strip()
        payload_text = str(form.get("payload") or "null")
        errors: dict[str, str] = {}
        payload: Any = None
        try:
            payload = _serde.parse_json(payload_text, what="payload")
        except UmtError as exc:
            errors["payload"] = str(exc)
        if not name:
            errors["name"] = "the fact's name is needed"
        if not errors:
            try:
                stored = await self.engine.signal(info.run_id, name, payload)
            except UsageError as exc:
                errors["name"] = str(exc)
            except UmtError as exc:
                errors["payload"] = str(exc)
            else:
                text = (
                    f"fact {name!r} stored"
                    if stored
                    else f"the run already had a fact {name!r}: the first one stays"
                )
                return self.back(request, f"/runs/{info.run_id}", notice=text)
        return self.render(
            request,
            "signal.html",
            status_code=400,
            info=info,
            errors=errors,
            name=name,
            payload=payload_text,
        )

    async def settle_run(self, request: Request) -> Response:
        """Settle the step of a run in needs_attention, as `umt runs settle` does: done with
        the step's output (JSON of its output type, checked here against that type) or not
        done (the step runs again), by whom the form says (kept in the run's history)."""
        form = await self.action_form(request)
        if isinstance(form, Response):
            return form
        info = await self._run_info(request)
        if isinstance(info, Response):
            return info
        values = {
            "step": str(form.get("step") or "").strip(),
            "as": str(form.get("as") or ""),
            "output": str(form.get("output") or ""),
            "by": str(form.get("by") or "").strip(),
        }
        errors: dict[str, str] = {}
        output: Any = None
        if values["as"] not in ("done", "not-done"):
            errors["as"] = "choose done (the step's work happened) or not done (it runs again)"
        if values["output"].strip():
            try:
                output = _serde.parse_json(values["output"], what="output")
            except UmtError as exc:
                errors["output"] = str(exc)
        elif values["as"] == "done":
            errors["output"] = "done needs the step's output, as JSON of its type (null for None)"
        if not values["by"]:
            errors["by"] = "who settles it is kept in the run's history: give your name"
        if not errors:
            done = values["as"] == "done"
            try:
                settlement = await self.engine.settle(
                    info.run_id, step=values["step"], done=done, output=output, by=values["by"]
                )
            except UsageError as exc:
                field = exc.argument if exc.argument in ("output", "by") else "form"
                errors[field] = str(exc)
            except UmtError as exc:
                errors["form"] = str(exc)
            else:
                what = "done: the run goes on" if done else "not done: the step runs again"
                text = f"settled step {settlement.step_name!r} as {what} (by {settlement.by})"
                return self.back(request, f"/runs/{info.run_id}", notice=text)
        return self.render(
            request, "settle.html", status_code=400, info=info, errors=errors, values=values
        )

    async def rerun_run(self, request: Request) -> Response:
        form = await self.action_form(request)
        if isinstance(form, Response):
            return form
        info = await self._run_info(request)
        if isinstance(info, Response):
            return info
        try:
            handle = await self.engine.rerun(info.run_id)
        except UmtError as exc:
            return self.problem(request, 400, str(exc))
        return self.back(
            request, f"/runs/{handle.run_id}", notice=f"started again as a new run of {info.run_id}"
        )

    async def cancel_matching(self, request: Request) -> Response:
        """GET: how many unfinished runs match the filter, and a form to confirm; POST: cancel
        them (at most the count confirmed)."""
        if request.method == "GET":
            filters = pages.RunFilters.parse(request.query_params)
            found = await pages.matching_unfinished(self.engine, filters)
            return self.render(request, "cancel_matching.html", filters=filters, found=found)
        form = await self.action_form(request)
        if isinstance(form, Response):
            return form
        filters = pages.RunFilters.parse({k: str(v) for k, v in form.items() if v is not None})
        try:
            confirmed = int(str(form.get("count", "0")))
        except ValueError:
            confirmed = 0
        found = await pages.matching_unfinished(self.engine, filters, limit=confirmed)
        if found.error:
            return self.problem(request, 400, found.error)
        outcomes = await pages.cancel_all(self.engine, found.run_ids, reason="canceled in bulk")
        text = ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items())) or "nothing"
        return self.back(request, "/runs", notice=f"cancel of the matching runs: {text}")

    # -- tasks, workers, schedules, keys, pauses ----------------------------------------------

    async def tasks(self, request: Request) -> Response:
        error = ""
        stats: list[TaskStats] = []
        try:
            stats = await self.engine.task_stats()
        except UsageError as exc:
            error = str(exc)
        try:
            paused = {str(p) for p in await self.engine.paused()}
        except UsageError:
            paused = set()
        return self.render(
            request,
            "tasks.html",
            stats=stats,
            error=error,
            paused=paused,
            charts={
                s.pair: pages.spark(s.finished_per_bucket, s.failed_per_bucket, s.bucket_starts)
                for s in stats
            },
            enqueueable={(d.name, d.version) for d in self.engine.registry},
            duration=pages.duration,
            notice=str(request.query_params.get("notice", ""))[:300],
        )

    async def workers(self, request: Request) -> Response:
        error = ""
        found: list[WorkerInfo] = []
        try:
            found = await self.engine.workers()
        except UsageError as exc:
            error = str(exc)
        order = {"live": 0, "silent": 1, "stopped": 2}
        found.sort(key=lambda w: (order[w.health], w.worker_id))
        return self.render(
            request, "workers.html", workers=found, error=error, duration=pages.duration
        )

    async def schedules(self, request: Request) -> Response:
        found: list[ScheduleInfo] = []
        error = ""
        if self.engine.schedules.supported:
            found = await self.engine.schedules.list()
        else:
            error = "this backend stores no schedules"
        return self.render(request, "schedules.html", schedules=found, error=error)

    async def concurrency(self, request: Request) -> Response:
        keys: list[Any] = []
        error = ""
        try:
            keys = await self.engine.key_usage()
        except UsageError as exc:
            error = str(exc)
        return self.render(request, "concurrency.html", keys=keys, error=error)

    async def paused(self, request: Request) -> Response:
        error = ""
        found: list[Any] = []
        try:
            found = await self.engine.paused()
        except UsageError as exc:
            error = str(exc)
        return self.render(
            request,
            "paused.html",
            paused=found,
            error=error,
            notice=str(request.query_params.get("notice", ""))[:300],
        )

    async def pause_or_resume(self, request: Request) -> Response:
        form = await self.action_form(request)
        if isinstance(form, Response):
            return form
        target = str(form.get("task") or "").strip()
        back = str(form.get("back") or "/paused")
        if back not in ("/paused", "/tasks"):
            back = "/paused"
        resume = request.url.path.endswith("/resume")
        try:
            changed = await (self.engine.resume(target) if resume else self.engine.pause(target))
        except UmtError as exc:
            return self.problem(request, 400, str(exc))
        if resume:
            text = f"resumed {target}" if changed else f"{target} was not paused"
        else:
            text = f"paused {target}" if changed else f"{target} was paused already"
        return self.back(request, back, notice=text)

    async def rate_limits(self, request: Request) -> Response:
        error = ""
        found: list[Any] = []
        try:
            found = await self.engine.rate_limits.list()
        except UsageError as exc:
            error = str(exc)
        return self.render(
            request,
            "rate_limits.html",
            limits=found,
            error=error,
            duration=pages.duration,
            notice=str(request.query_params.get("notice", ""))[:300],
        )

    async def pause_or_resume_limit(self, request: Request) -> Response:
        form = await self.action_form(request)
        if isinstance(form, Response):
            return form
        name = str(form.get("name") or "").strip()
        resume = request.url.path.endswith("/resume")
        limits = self.engine.rate_limits
        try:
            changed = await (limits.resume(name) if resume else limits.pause(name))
        except UmtError as exc:
            return self.problem(request, 400, str(exc))
        if resume:
            text = f"resumed rate limit {name}" if changed else f"{name} was not paused"
        else:
            text = f"paused rate limit {name}" if changed else f"{name} was paused already"
        return self.back(request, "/rate-limits", notice=text)

    # -- enqueue --------------------------------------------------------------------------------

    async def enqueue(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            version = int(request.path_params["version"])
        except ValueError:
            return self.problem(request, 404, "not a task version")
        definition = self.registered(name, version)
        if definition is None:
            return self.problem(
                request,
                404,
                f"task {name}@{version} is not in this dashboard's registry: start it with "
                "--registry MODULE:REGISTRY (or create_app with an engine whose registry has it)",
            )
        fields = forms.fields_of(definition.input_type)
        values: dict[str, str] = {}
        errors: dict[str, str] = {}
        extra = {"idempotency_key": "", "priority": "0"}
        if request.method == "POST":
            form = await self.action_form(request)
            if isinstance(form, Response):
                return form
            values = {k: str(v) for k, v in form.items() if v is not None}
            data, errors = forms.read_form(fields, form)
            extra = {
                "idempotency_key": str(form.get("idempotency_key") or "").strip(),
                "priority": str(form.get("priority") or "0").strip(),
            }
            priority = 0
            try:
                priority = int(extra["priority"])
            except ValueError:
                errors["priority"] = "expected a whole number"
            if not errors:
                try:
                    handle = await self.engine.enqueue(
                        definition,
                        data,
                        priority=priority,
                        idempotency_key=extra["idempotency_key"] or None,
                    )
                except PayloadError as exc:
                    field = forms.field_of_error(exc.field, [f.name for f in fields])
                    errors[field or "form"] = str(exc)
                except UsageError as exc:
                    errors[exc.argument if exc.argument in extra else "form"] = str(exc)
                except UmtError as exc:
                    errors["form"] = str(exc)
                else:
                    text = "enqueued" if handle.created else "the idempotency key names this run"
                    return self.back(request, f"/runs/{handle.run_id}", notice=text)
        return self.render(
            request,
            "enqueue.html",
            status_code=400 if errors else 200,
            definition=definition,
            fields=fields,
            values=values,
            errors=errors,
            extra=extra,
        )

    # -- events ---------------------------------------------------------------------------------

    async def events(self, request: Request) -> Response:
        view = await pages.fetch_events(self.engine, request.query_params)
        return self.render(request, "events.html", **view)

    # -- callbacks ------------------------------------------------------------------------------

    async def complete_callback(self, request: Request) -> Response:
        return await callbacks.complete(self.engine, request, self.callback_secrets)

    # -- metrics --------------------------------------------------------------------------------

    async def metrics(self, request: Request) -> Response:
        return Response(await self.store_metrics.render(), media_type=CONTENT_TYPE)


def create_app(
    engine: Engine,
    *,
    read_only: bool = False,
    token: str | None = None,
    trace_url_template: str | None = None,
    title: str = "umt",
    callback_secret: str | Sequence[str] | None = None,
) -> Starlette:
    """The dashboard as an ASGI app, to serve with uvicorn or mount in your own app.

    Mount it under a prefix in Starlette (`Mount("/umt", app=create_app(engine))`) or FastAPI
    (`app.mount("/umt", create_app(engine))`); every link it draws is relative to that prefix.

    Args:
        engine: the engine whose runs it shows (`await umt_sdk.connect(...)`); its registry
            gives the enqueue forms their fields and the tasks page its tasks.
        read_only: show, never act: no cancel, fact, settle, rerun, enqueue or pause (each
            refused with 403).
        token: an access token every request must carry (typed once on `/login`, kept in a
            cookie, or sent as `Authorization: Bearer TOKEN`); None: no token.
        trace_url_template: a URL of your tracing UI with `{trace_id}` in it (such as
            `http://localhost:16686/trace/{trace_id}` for Jaeger): a run's trace id becomes
            a link to it.
        title: the name in the page titles and the header.
        callback_secret: serve `POST /callbacks/complete`, the signed endpoint that
            completes callback tokens (see docs/dashboard.md), with this secret (at least
            32 characters), or a list of secrets during a rotation (a request signed by any
            one is accepted). None: no such endpoint. Refused with `read_only`.
    """
    check.optional(token, str, "token", "a string (the access token) or None", where="create_app()")
    if token is not None and len(token) < 8:
        raise UsageError(
            "create_app(token=...): an access token needs at least 8 characters "
            "(such as the output of `python -c 'import secrets; print(secrets.token_urlsafe())'`)",
            argument="token",
        )
    if trace_url_template is not None and "{trace_id}" not in str(trace_url_template):
        raise UsageError(
            "create_app(trace_url_template=...) needs {trace_id} in it, such as "
            "'http://localhost:16686/trace/{trace_id}'",
            argument="trace_url_template",
        )
    if not isinstance(engine, Engine):
        check.refuse("engine", "an Engine (await umt_sdk.connect(url, ...))", engine)
    callback_secrets = callbacks.check_secrets(callback_secret)
    if callback_secrets and read_only:
        raise UsageError(
            "create_app(read_only=True, callback_secret=...): a read-only dashboard changes "
            "nothing, and the callback endpoint completes callbacks: give one or the other",
            argument="callback_secret",
        )
    board = _Dashboard(
        engine,
        read_only=bool(read_only),
        token=token,
        trace_url_template=trace_url_template,
        title=str(title),
        callback_secrets=callback_secrets,
    )

    async def home(request: Request) -> Response:
        return board.back(request, "/runs")

    routes = [
        Route("/", home),
        Route("/login", board.login, methods=["GET", "POST"]),
        Route("/runs", board.runs),
        Route("/runs/rows", board.runs),
        Route("/runs/cancel", board.cancel_matching, methods=["GET", "POST"]),
        Route("/runs/{run_id}", board.run),
        Route("/runs/{run_id}/live", board.run),
        Route("/runs/{run_id}/cancel", board.cancel_run, methods=["POST"]),
        Route("/runs/{run_id}/signal", board.signal_run, methods=["POST"]),
        Route("/runs/{run_id}/rerun", board.rerun_run, methods=["POST"]),
        Route("/runs/{run_id}/settle", board.settle_run, methods=["POST"]),
        Route("/tasks", board.tasks),
        Route("/tasks/pause", board.pause_or_resume, methods=["POST"]),
        Route("/tasks/resume", board.pause_or_resume, methods=["POST"]),
        Route("/tasks/{name}/{version}/enqueue", board.enqueue, methods=["GET", "POST"]),
        Route("/workers", board.workers),
        Route("/schedules", board.schedules),
        Route("/concurrency", board.concurrency),
        Route("/paused", board.paused),
        Route("/rate-limits", board.rate_limits),
        Route("/rate-limits/pause", board.pause_or_resume_limit, methods=["POST"]),
        Route("/rate-limits/resume", board.pause_or_resume_limit, methods=["POST"]),
        Route("/events", board.events),
        Route("/metrics", board.metrics),
        *(
            [Route("/callbacks/complete", board.complete_callback, methods=["POST"])]
            if callback_secrets
            else []
        ),
        Mount(
            "/static", app=StaticFiles(packages=[("umt_sdk.dashboard", "static")]), name="static"
        ),
    ]
    middleware = [
        Middleware(BaseHTTPMiddleware, dispatch=security.security_headers),
        Middleware(BaseHTTPMiddleware, dispatch=board.guard),
    ]
    return Starlette(routes=routes, middleware=middleware)
