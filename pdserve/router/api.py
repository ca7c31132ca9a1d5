"""OpenAI-compatible HTTP API. The router tokenizes, dispatches and streams; it runs no model."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.common import protocol as P
from pdserve.common.config import RouterConfig
from pdserve.router.core import NoNodeAvailable, Overloaded, RouterCore
from pdserve.router.limits import Offload, RequestLimits, content_chars, stop_problem
from pdserve.router.text import Detokenizer, ModelInfo, load_model_info


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


# ---- request bodies ------------------------------------------------------------------------------


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False
    n: int = 1
    return_token_ids: bool = False


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list | None = None


class ChatBody(_Common):
    messages: list[ChatMessage]


@dataclass
class Job:
    """A validated request: what the router dispatches and how the answer is shaped."""

    prompt_ids: list[int]
    params: P.SamplingParams
    stops: list[str]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


# ---- validation ----------------------------------------------------------------------------------


def _prompt(body: CompletionBody, info: ModelInfo) -> str | list[int]:
    """The one prompt of `body`: a string (checked to be short enough to fit) or token ids (checked)."""
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        raise ApiError(400, "batched prompts are not supported: send one prompt per request", "prompt")
    if isinstance(prompt, str):
        _check_chars(len(prompt), info, "prompt")
        return prompt
    if len(prompt) >= info.max_model_len:
        raise ApiError(400, f"the prompt has {len(prompt)} tokens; this model's context is "
                       f"{info.max_model_len} tokens", "prompt")  # fmt: skip
    bad = [t for t in prompt if not 0 <= t < info.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})", "prompt")
    return list(prompt)


def _check_chars(n: int, info: ModelInfo, param: str) -> None:
    """Refuse, before tokenizing, text too long to fit the context whatever its tokens."""
    if n > info.max_prompt_chars:
        raise ApiError(400, f"the {param} has {n} characters, more than this model's context of "
                       f"{info.max_model_len} tokens can hold (at most {info.max_prompt_chars})", param)  # fmt: skip


async def _prompt_ids(body: CompletionBody, info: ModelInfo, offload: Offload) -> list[int]:
    prompt = _prompt(body, info)
    if isinstance(prompt, list):
        return prompt
    return await offload.run(len(prompt), _encode, info.tokenizer, prompt)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


async def _chat_ids(body: ChatBody, info: ModelInfo, offload: Offload) -> list[int]:
    if not body.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    chars = sum(content_chars(m.content) for m in body.messages)
    _check_chars(chars, info, "messages")
    return await offload.run(chars, _apply_template, body, info)


def _apply_template(body: ChatBody, info: ModelInfo) -> list[int]:
    messages = [m.model_dump() for m in body.messages]
    try:
        ids = info.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # the template raises whatever jinja raises
        raise ApiError(400, f"cannot apply the chat template: {e}", "messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def make_job(
    body: _Common,
    prompt_ids: list[int],
    info: ModelInfo,
    chat_default: bool = False,
    kv_capacity: int | None = None,
) -> Job:
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    if body.n != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:  # OpenAI: 16 for completions; chat goes on until EOS or the context's end
        room = min(info.max_model_len, kv_capacity or info.max_model_len) - len(prompt_ids)
        max_tokens = max(1, room if chat_default else min(16, room))
    for name, value in (("seed", body.seed), ("top_k", body.top_k), ("max_tokens", max_tokens)):
        if value is not None and not -(2**63) <= value < 2**63:
            raise ApiError(400, f"{name} is out of range", name)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    problem = stop_problem(stops, body.stop_token_ids)
    if problem:
        raise ApiError(400, *problem)
    if getattr(body, "logit_bias", None):
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    bad = [t for t in body.stop_token_ids or () if not 0 <= t < info.vocab_size]
    if bad:
        raise ApiError(
            400, f"stop token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})", "stop_token_ids"
        )
    if len(prompt_ids) >= info.max_model_len:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                       f"{info.max_model_len} tokens", "prompt")  # fmt: skip
    if max_tokens >= 1 and len(prompt_ids) + max_tokens > info.max_model_len:
        raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                       f"model's context of {info.max_model_len} tokens", "max_tokens")  # fmt: skip
    try:
        params = P.SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            seed=body.seed, stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            eos_token_ids=info.eos_token_ids,
        )  # fmt: skip
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    opts = body.stream_options or {}
    return Job(prompt_ids, params, [s for s in stops if s], body.stream, bool(opts.get("include_usage")),
               body.return_token_ids, body.model)  # fmt: skip


# ---- running a job -------------------------------------------------------------------------------


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None


def check_capacity(core: RouterCore, job: Job) -> None:
    """Refuse a request no node's KV pool could ever hold (the pools are smaller than the context)."""
    need = {"colocated": len(job.prompt_ids) + job.params.max_tokens, "decode": len(job.prompt_ids) +
            job.params.max_tokens, "prefill": len(job.prompt_ids) + 1}  # fmt: skip
    for role, tokens in need.items():
        capacity = core.kv_capacity_tokens(role)
        if capacity is not None and tokens > capacity:
            raise ApiError(400, f"prompt ({len(job.prompt_ids)} tokens) + max_tokens ({job.params.max_tokens}) "
                           f"needs {tokens} tokens of KV on a {role} node, whose pool holds {capacity} "
                           "(--num-kv-blocks, --kv-cache-gb)", "max_tokens")  # fmt: skip


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


async def run_job(core: RouterCore, info: ModelInfo, job: Job, flight=None) -> AsyncIterator[Delta]:
    """Dispatch `job` (unless `flight` is given) and yield text deltas; aborts it everywhere if the consumer leaves."""
    flight = flight or submit(core, job)
    detok = Detokenizer(info.tokenizer, job.stops)
    finished = False
    try:
        while not finished:
            ev: P.TokenEvent = await flight.queue.get()
            if ev.finish_reason == "error":
                status = flight.error_status or (503 if "failed" in ev.error else 500)
                raise ApiError(status, f"request failed: {ev.error}")
            text, stopped = detok.add(ev.token_ids)
            reason = "stop" if stopped else ev.finish_reason
            if reason is not None:
                text += "" if stopped else detok.flush()
                finished = True
            yield Delta(text, list(ev.token_ids), reason)
    finally:
        if not finished or flight.request_id in core.flights:
            core.abort(flight.request_id)


def _usage(job: Job, n: int) -> dict:
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n, "total_tokens": len(job.prompt_ids) + n}


def _choice(job: Job, chat: bool, text: str, token_ids: list[int] | None, reason, stream: bool) -> dict:
    if chat:
        key = "delta" if stream else "message"
        choice = {"index": 0, key: {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    if job.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def _envelope(job: Job, chat: bool, stream: bool) -> dict:
    obj = ("chat.completion" if chat else "text_completion") + (".chunk" if stream and chat else "")
    return {"id": ("chatcmpl-" if chat else "cmpl-") + job.id, "object": obj, "created": job.created,
            "model": job.model}  # fmt: skip


async def _complete(core, info, job: Job, chat: bool, request: Request) -> dict:
    texts, ids, reason = [], [], None

    async def collect():
        nonlocal reason
        async for d in run_job(core, info, job):
            texts.append(d.text)
            ids.extend(d.token_ids)
            reason = d.finish_reason

    task = asyncio.create_task(collect())
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # run_job's finally aborts the request on its nodes
    await asyncio.gather(task, return_exceptions=True)
    task.result()
    body = _envelope(job, chat, stream=False)
    body["choices"] = [_choice(job, chat, "".join(texts), ids, reason, stream=False)]
    body["usage"] = _usage(job, len(ids))
    return body


async def _stream(core, info, job: Job, chat: bool, flight) -> AsyncIterator[str]:
    n = 0
    try:
        async for d in run_job(core, info, job, flight):
            n += len(d.token_ids)
            chunk = _envelope(job, chat, stream=True)
            chunk["choices"] = [_choice(job, chat, d.text, d.token_ids, d.finish_reason, stream=True)]
            yield f"data: {json.dumps(chunk)}\n\n"
    except ApiError as e:
        yield f"data: {json.dumps(error_body(e.status, e.message, e.param, e.code))}\n\n"
        return
    if job.include_usage:
        chunk = _envelope(job, chat, stream=True)
        chunk["choices"], chunk["usage"] = [], _usage(job, n)
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


# ---- the app -------------------------------------------------------------------------------------


def _parse(raw: bytes, model: type[_Common]) -> _Common:
    try:
        data = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise ApiError(400, f"invalid request: malformed JSON ({e})") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, *_invalid_message(e.errors())) from None


def _invalid_message(errors: list) -> tuple[str, str | None]:
    first = errors[0] if errors else {}
    where = ".".join(str(x) for x in first.get("loc", ()))
    return f"invalid request: {where + ': ' if where else ''}{first.get('msg', 'malformed body')}", where or None


async def _read(request: Request, model: type[_Common]) -> _Common:
    """The body, parsed and validated (off the event loop when it is large); the model name checked."""
    with admission_errors():  # refuse early, before spending anything on the body
        request.app.state.core.check_admission()
    raw = await request.body()  # at most --max-request-bytes: RequestLimits saw it first
    body = await request.app.state.offload.run(len(raw), _parse, raw, model)
    served = request.app.state.served
    if body.model not in served:
        raise ApiError(404, f"model {body.model!r} does not exist; this server serves {sorted(served)[0]!r}",
                       "model", "model_not_found")  # fmt: skip
    return body


def create_app(cfg: RouterConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.info = load_model_info(cfg.model)
        app.state.served = {cfg.served_model_name or cfg.model, cfg.model}
        app.state.offload = Offload()
        app.state.core = RouterCore(cfg)
        await app.state.core.start()
        try:
            yield
        finally:
            await app.state.core.stop()
            app.state.offload.close()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.add_middleware(RequestLimits, limit=cfg.max_request_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        body = error_body(e.status, e.message, e.param, e.code)
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        msg, where = _invalid_message([{**x, "loc": tuple(x.get("loc", ()))[1:]} for x in e.errors()])
        return JSONResponse(error_body(400, msg, where), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    async def serve(request: Request, body: _Common, prompt_ids: list[int], chat: bool):
        st = request.app.state
        caps = [c for c in (st.core.kv_capacity_tokens(r) for r in ("colocated", "decode")) if c]
        job = make_job(body, prompt_ids, st.info, chat_default=chat, kv_capacity=min(caps, default=None))
        check_capacity(st.core, job)
        if job.stream:  # dispatch first, so that a refusal is still an HTTP error, not a 200 stream
            flight = submit(st.core, job)
            return StreamingResponse(_stream(st.core, st.info, job, chat, flight), media_type="text/event-stream")
        return await _complete(st.core, st.info, job, chat, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        st = request.app.state
        body = await _read(request, CompletionBody)
        return await serve(request, body, await _prompt_ids(body, st.info, st.offload), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        st = request.app.state
        body = await _read(request, ChatBody)
        return await serve(request, body, await _chat_ids(body, st.info, st.offload), chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        name = cfg.served_model_name or cfg.model
        card = {"id": name, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": request.app.state.info.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health(request: Request):
        h = request.app.state.core.health()
        return JSONResponse(h, status_code=200 if h["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        return PlainTextResponse(render_metrics(request.app.state.core))

    return app


def render_metrics(core: RouterCore) -> str:
    m = core.metrics
    lines = [
        "# TYPE pdserve_requests_total counter", f"pdserve_requests_total {m['requests_total']}",
        "# TYPE pdserve_requests_failed_total counter", f"pdserve_requests_failed_total {m['requests_failed']}",
        "# TYPE pdserve_requests_in_flight gauge", f"pdserve_requests_in_flight {len(core.flights)}",
        "# TYPE pdserve_requests_waiting gauge", f"pdserve_requests_waiting {len(core.waiting)}",
        "# TYPE pdserve_requests_rejected_total counter", f"pdserve_requests_rejected_total {m['requests_rejected']}",
        "# TYPE pdserve_requests_timed_out_total counter",
        f"pdserve_requests_timed_out_total {m['requests_timed_out']}",
        "# TYPE pdserve_requests_redispatched_total counter",
        f"pdserve_requests_redispatched_total {m['requests_redispatched']}",
        "# TYPE pdserve_time_to_first_token_seconds summary",
        f"pdserve_time_to_first_token_seconds_sum {m['ttft_sum']:.6f}",
        f"pdserve_time_to_first_token_seconds_count {m['ttft_count']}",
        "# TYPE pdserve_time_per_output_token_seconds summary",
        f"pdserve_time_per_output_token_seconds_sum {m['tpot_sum']:.6f}",
        f"pdserve_time_per_output_token_seconds_count {m['tpot_count']}",
    ]  # fmt: skip
    gauges = {"num_running": "pdserve_num_running", "num_waiting": "pdserve_num_waiting",
              "kv_blocks_used": "pdserve_kv_blocks_used", "kv_blocks_free": "pdserve_kv_blocks_free"}  # fmt: skip
    for field_name, metric in gauges.items():
        lines.append(f"# TYPE {metric} gauge")
        for n in core.nodes:
            if n.stats is not None:
                lines.append(f'{metric}{{role="{n.role}",node="{n.addr}"}} {getattr(n.stats, field_name)}')
    counters = sorted({k for n in core.nodes if n.stats for k in n.stats.counters})
    for key in counters:
        lines.append(f"# TYPE pdserve_node_{key} counter")
        for n in core.nodes:
            if n.stats is not None and key in n.stats.counters:
                lines.append(f'pdserve_node_{key}{{role="{n.role}",node="{n.addr}"}} {n.stats.counters[key]}')
    lines.append(f"pdserve_node_up_total {sum(n.up for n in core.nodes)}")
    return "\n".join(lines) + "\n"
