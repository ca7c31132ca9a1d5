"""The router's access log: one line per request once its response has ended, streams included, with the
request's tokens where it ran any; none with --no-access-log."""

from __future__ import annotations

import asyncio
import logging

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from pdserve.router.access_log import AccessLog


async def _complete(request):
    request.state.usage = {"prompt_tokens": 3, "completion_tokens": 5}
    return JSONResponse({"ok": True})


async def _stream(request):
    async def events():
        try:
            for i in range(3):
                yield f"data: {i}\n\n"
        finally:
            request.state.usage = {"prompt_tokens": 2, "completion_tokens": 3}

    return StreamingResponse(events(), media_type="text/event-stream")


APP = AccessLog(
    Starlette(
        routes=[Route("/v1/completions", _complete, methods=["POST"]), Route("/v1/stream", _stream, methods=["POST"])]
    )
)


async def _requests() -> list[int]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=APP), base_url="http://test") as client:
        answers = [
            await client.post("/v1/completions", json={}),
            await client.post("/v1/stream", json={}),
            await client.get("/nowhere"),
            await client.get("/health"),
        ]
    return [r.status_code for r in answers]


def test_one_line_per_request_with_status_tokens_and_duration(caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.access"):
        assert asyncio.run(_requests()) == [200, 200, 404, 404]
    records = [r for r in caplog.records if r.name == "pdserve.access"]
    lines = [r.getMessage() for r in records]
    assert len(lines) == 3, lines  # /health, which probes poll, is not logged
    assert {(r.levelname, r.funcName, r.module) for r in records} == {("INFO", "log_request", "access_log")}
    assert lines[0].startswith("POST /v1/completions 200 3+5 tokens ") and lines[0].endswith(" s")
    assert lines[1].startswith("POST /v1/stream 200 2+3 tokens "), "a stream's tokens, counted once it ended"
    assert lines[2].startswith("GET /nowhere 404 ") and "tokens" not in lines[2]


def test_the_router_app_logs_only_when_asked():
    from pdserve.config import RouterConfig
    from pdserve.router.api import create_app

    def has_access_log(**kw) -> bool:
        app = create_app(RouterConfig(colocated=("tcp://127.0.0.1:1",), **kw))
        return any(m.cls is AccessLog for m in app.user_middleware)

    assert has_access_log() and not has_access_log(access_log=False)


def test_no_line_below_the_loggers_level():
    """The logger's level, not a handler's, keeps the line out: a handler that takes everything sees none."""
    log, seen = logging.getLogger("pdserve.access"), []
    handler = logging.Handler(logging.NOTSET)
    handler.emit = seen.append
    level = log.level
    log.addHandler(handler)
    try:
        log.setLevel(logging.WARNING)
        assert asyncio.run(_requests()) == [200, 200, 404, 404]
        assert seen == []
        log.setLevel(logging.INFO)
        assert asyncio.run(_requests()) == [200, 200, 404, 404]
        assert len(seen) == 3, "the handler sees the lines once the level lets them through"
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
