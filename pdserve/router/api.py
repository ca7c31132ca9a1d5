"""OpenAI-compatible HTTP API. The router tokenizes, dispatches and streams; it runs no model."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.config import RouterConfig
from pdserve.router import small_routes
from pdserve.router.access_log import AccessLog, log_request
from pdserve.router.auth import ApiKeyGuard, authorized, refusal
from pdserve.router.choices import gather_all
from pdserve.router.core import NoNodeAvailable, Overloaded, RouterCore, StartupError
from pdserve.router.errors import ApiError, api_error_body, logged_error
from pdserve.router.http import Exchange
from pdserve.router.jobs import (
    BodyFields,
    ChatBody,
    CompletionBody,
    Job,
    chat_ids,
    check_choices,
    expand,
    make_job,
    prompt_ids,
)
from pdserve.router.limits import Offload, RequestLimits
from pdserve.router.logprobs import merge_pieces
from pdserve.router.metrics import SharedMetrics, merge_expositions, read_others
from pdserve.router.openai_fields import UnsupportedField, check_fields
from pdserve.router.response_format import grammar_for, schema_size
from pdserve.router.stream import (
    SSE_HEADERS,
    ChoiceView,
    Outbox,
    SseResponse,
    SseStream,
    choice,
    envelope,
    usage,
)
from pdserve.router.text import ModelInfo, load_model_info
from pdserve.wire.params import FinishReason, Role, kv_tokens_needed

log = logging.getLogger("pdserve.router")


def check_capacity(core: RouterCore, job: Job) -> None:
    """Refuse a request no node's KV pool could ever hold (the pools are smaller than the context)."""
    for role in (Role.COLOCATED, Role.DECODE, Role.PREFILL):
        tokens = kv_tokens_needed(role, len(job.prompt_ids), job.params.max_tokens)
        capacity = core.kv_capacity_tokens(role)
        if capacity is not None and tokens > capacity:
            raise ApiError(
                400,
                f"prompt ({len(job.prompt_ids)} tokens) + max_tokens ({job.params.max_tokens}) "
                f"needs {tokens} tokens of KV on a {role} node, whose pool holds {capacity} "
                "(--num-kv-blocks, --kv-cache-gb)",
                "max_tokens",
            )


def submit(core: RouterCore, job: Job):
    with admission_errors():
        return core.submit(job.prompt_ids, job.params)


@contextmanager
def admission_errors():
    """The router's refusals as HTTP errors: overloaded 429 (with Retry-After), no node or shutting down 503."""
    try:
        yield
    except Overloaded as e:
        raise ApiError(429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after)}) from None
    except NoNodeAvailable as e:
        raise ApiError(503, str(e)) from None


async def collect(core: RouterCore, info: ModelInfo, job: Job) -> tuple[str, list[int], str | None, dict | None, Any]:
    """Dispatch `job` and gather its whole answer (text, token ids, finish reason, log-probabilities, stop reason):
    its events are pushed into its choice's view as they come, and the handler wakes once, at the end. Aborts it
    everywhere if the caller is cancelled (the client left)."""
    flight = submit(core, job)
    view = ChoiceView(info, job)
    ended = asyncio.get_running_loop().create_future()
    texts, ids, logprobs = [], [], []

    def on_event(ev) -> None:
        if ended.done():
            return
        deltas, error = view.deltas([ev])
        for d in deltas:
            texts.append(d.text)
            ids.extend(d.token_ids)
            logprobs.extend([d.logprobs] if d.logprobs is not None else [])
        if error is not None:
            ended.set_exception(error)
        elif view.reason is not None:
            ended.set_result(None)

    flight.inbox.attach(on_event)
    try:
        await ended
    finally:
        if view.reason is None or flight.request_id in core.flights:
            core.abort(flight.request_id, view.reason or FinishReason.ABORT)
    return "".join(texts), ids, view.reason, merge_pieces(logprobs), view.stop_reason


async def _complete(core, info, jobs: list[Job], chat: bool, call: Call) -> dict:
    task = asyncio.create_task(gather_all(collect(core, info, job) for job in jobs))
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await call.is_disconnected():
            task.cancel()  # collect's finally aborts each request on its nodes
    await asyncio.gather(task, return_exceptions=True)
    results = task.result()
    body = envelope(jobs[0], chat, stream=False)
    body["choices"] = [
        choice(job, chat, text, ids, reason, stream=False, logprobs=lps, stop_reason=stop)
        for job, (text, ids, reason, lps, stop) in zip(jobs, results, strict=True)
    ]
    body["usage"] = call.state.usage = usage(jobs, sum(len(ids) for _, ids, *_ in results))
    return body


def submit_all(core: RouterCore, jobs: list[Job]) -> list:
    """Dispatch every job, or none: a refusal aborts those already sent."""
    flights = []
    try:
        for job in jobs:
            flights.append(submit(core, job))
    except ApiError:
        for f in flights:
            core.abort(f.request_id)
        raise
    return flights


# ---- the app -------------------------------------------------------------------------------------


def _parse(raw: bytes, model: type[BodyFields]) -> BodyFields:
    try:
        data = json.loads(_json_text(raw))
    except ValueError as e:  # UnicodeDecodeError included
        raise ApiError(400, f"invalid request: malformed JSON ({e})") from None
    except RecursionError:  # arrays or objects nested past the parser's recursion limit
        raise ApiError(400, "invalid request: malformed JSON (nested too deeply)") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, *_invalid_message(e.errors())) from None


def _json_text(raw: bytes) -> bytes | str:
    """`raw` decoded as json.loads would decode it, where that is UTF-8 (an object's `{` then no NUL: json's detection
    of the encoding, a Python function, costs about what parsing a short body does); else as it came."""
    if raw[:1] == b"{" and raw[1:2] != b"\x00":
        return raw.decode("utf-8", "surrogatepass")
    return raw


def _where(request: Request) -> str:
    return f"{request.method} {request.scope['path']}"


def _invalid_message(errors: list) -> tuple[str, str | None]:
    first = errors[0] if errors else {}
    where = ".".join(str(x) for x in first.get("loc", ()))
    return f"invalid request: {where + ': ' if where else ''}{first.get('msg', 'malformed body')}", where or None


def _route_invalid_message(errors: list) -> tuple[str, str | None]:
    """The message and param of a body FastAPI refused for a route: malformed JSON names no field (its error's loc is
    a character offset), a field that fails its model is named without the leading "body"."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"invalid request: malformed JSON ({first.get('ctx', {}).get('error', first.get('msg'))})", None
    return _invalid_message([{**x, "loc": tuple(x.get("loc", ()))[1:]} for x in errors])


@dataclass
class Call:
    """What a completion handler needs of its HTTP request, which came through FastAPI or the direct path (http.py)."""

    where: str  # method and path, for error lines
    state: Any  # the request's state: the handler puts its usage there, for the access log
    is_disconnected: Callable[[], Awaitable[bool]]


async def answer(st, call: Call, raw: bytes, chat: bool) -> dict | SseStream:
    """A completion request's answer, from its body (at most --max-request-bytes; its admission checked before it was
    read): the response's body, or the stream to send. Raises ApiError or UnsupportedField for an error response."""
    body = await st.offload.run(len(raw), _parse, raw, ChatBody if chat else CompletionBody)  # large: off the loop
    small_routes.check_served(st.served, body.model)
    check_choices(body, st.cfg.max_n, st.cfg.max_queued_requests)
    prompts = [await chat_ids(body, st.info, st.offload)] if chat else await prompt_ids(body, st.info, st.offload)
    if body.model_extra:  # fields no request model declares: refused unless harmless
        check_fields(body.model_extra, body.model_dump())
    caps = [c for c in (st.core.kv_capacity_tokens(r) for r in (Role.COLOCATED, Role.DECODE)) if c]
    grammar = await st.offload.run(schema_size(body.response_format), grammar_for, body.response_format)
    jobs = [
        make_job(
            body,
            ids,
            st.info,
            chat_default=chat,
            kv_capacity=min(caps, default=None),
            grammar=grammar,
        )
        for ids in prompts
    ]
    for job in jobs:
        check_capacity(st.core, job)
    jobs = expand(jobs, body.n)
    if body.stream:  # dispatch first, so that a refusal is still an HTTP error, not a 200 stream
        flights = submit_all(st.core, jobs)
        return SseStream(st.core, st.info, jobs, chat, flights, call.state, f"stream of {call.where}", st.outbox)
    return await _complete(st.core, st.info, jobs, chat, call)


async def _asgi_answer(request: Request, chat: bool) -> dict | SseResponse:
    st = request.app.state
    with admission_errors():  # refuse early, before spending anything on the body
        st.core.check_admission()
    raw = await request.body()  # at most --max-request-bytes: RequestLimits saw it first
    out = await answer(st, Call(_where(request), request.state, request.is_disconnected), raw, chat)
    return SseResponse(out) if isinstance(out, SseStream) else out


class DirectApi:
    """The direct path's handler (http.py): a completion request answered as the app answers it through ASGI, doing
    for it what the middlewares and exception handlers do there (API key, access log line, error bodies)."""

    def __init__(self, st, cfg: RouterConfig) -> None:
        self.st, self.key, self.access_log = st, cfg.api_key.encode(), cfg.access_log

    async def __call__(self, ex: Exchange) -> None:
        started, state = time.perf_counter(), SimpleNamespace(usage=None)
        self.st.core.metrics.direct_http.inc()
        try:
            await self._answer(ex, state)
        finally:
            if self.access_log:
                log_request("POST", ex.head.path, ex.status, state.usage, started)

    async def _answer(self, ex: Exchange, state: SimpleNamespace) -> None:
        if self.key and not authorized(ex.head.headers.get(b"authorization", b""), self.key):
            return _respond(ex, refusal(ex.where))
        try:
            with admission_errors():
                self.st.core.check_admission()
            out = await answer(self.st, Call(ex.where, state, ex.is_disconnected), ex.body, ex.head.chat)
        except (ApiError, UnsupportedField) as e:
            return _respond(ex, error_response(ex.where, e))
        except Exception:
            log.exception("%s failed", ex.where)
            return _respond(ex, PlainTextResponse("Internal Server Error", status_code=500))
        if not isinstance(out, SseStream):
            return _respond(ex, JSONResponse(out))
        ex.start_stream(list(SSE_HEADERS))
        ex.on_lost = out.close
        out.attach(ex.write, ex.end_stream)
        try:
            await out.done
        finally:
            out.close()  # aborts whatever still runs: the server stops
        ex.end_stream()


def error_response(where: str, e: ApiError | UnsupportedField) -> JSONResponse:
    """The answer to a request refused with `e` (logged as it is made), on either path."""
    if isinstance(e, UnsupportedField):
        return JSONResponse(logged_error(where, 400, str(e), e.field), status_code=400)
    return JSONResponse(api_error_body(where, e), status_code=e.status, headers=e.headers)


def _respond(ex: Exchange, response: Response) -> None:
    ex.respond(response.status_code, response.raw_headers, response.body)


def _without_telemetry() -> dict:
    """FastAPI's own OpenTelemetry hooks off, where this FastAPI has them: pdserve exports Prometheus metrics, and the
    hooks would look up the global OpenTelemetry providers on every request."""
    if "telemetry" not in inspect.signature(FastAPI).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def create_app(cfg: RouterConfig, worker: int | None = None, metrics_dir: str = "") -> FastAPI:
    """The router's app; `worker`: its number among --router-workers processes (None: the only one), which share
    their metrics through files in `metrics_dir`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.info = load_model_info(cfg.model, tokenizer=not cfg.skip_tokenizer)
        app.state.served = {cfg.served_model_name or cfg.model, cfg.model}
        app.state.offload = Offload()
        app.state.outbox = Outbox()
        app.state.core = RouterCore(cfg)
        if getattr(app.state, "exit_requested", False):  # a SIGTERM came while the model info loaded
            app.state.core.start_cancelled.set()
        try:
            await app.state.core.start()
        except StartupError as e:  # the server exits before serving; serve() says why in one line
            app.state.start_error = e
            await app.state.core.stop()
            app.state.offload.close()
            yield
            return
        shared = SharedMetrics(metrics_dir, worker or 0, app.state.core.metrics) if metrics_dir else None
        try:
            yield
        finally:
            if shared is not None:
                shared.close()
            await app.state.core.stop()
            app.state.offload.close()

    app = FastAPI(title="pdserve", lifespan=lifespan, **_without_telemetry())
    app.state.cfg = cfg
    app.state.direct = DirectApi(app.state, cfg)  # the handler of the router's direct path (server.py)
    app.include_router(small_routes.router)
    app.add_middleware(RequestLimits, limit=cfg.max_request_bytes)
    if cfg.api_key:  # added last, so outermost: a stranger's body is not even read
        app.add_middleware(ApiKeyGuard, api_key=cfg.api_key)
    if cfg.access_log:  # outside even the key guard: a refused request is logged too
        app.add_middleware(AccessLog)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(_where(request), e)

    @app.exception_handler(UnsupportedField)
    async def _unsupported(request: Request, e: UnsupportedField):
        return error_response(_where(request), e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        msg, param = _route_invalid_message(e.errors())
        return JSONResponse(logged_error(_where(request), 400, msg, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        body = logged_error(_where(request), e.status_code, str(e.detail))
        return JSONResponse(body, status_code=e.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _asgi_answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _asgi_answer(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        name = cfg.served_model_name or cfg.model
        card = {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": request.app.state.info.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health(request: Request):
        core = request.app.state.core
        h = {
            **core.health(),
            "instance": cfg.instance_id,
            "router_workers": cfg.router_workers,
            "worker": worker or 0,
            "pid": os.getpid(),
            "in_flight": len(core.flights),
        }
        return JSONResponse(h, status_code=200 if h["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        own = request.app.state.core.metrics.render()
        body = merge_expositions(own.decode(), read_others(metrics_dir, worker or 0)).encode() if metrics_dir else own
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app
