"""One log line per HTTP request, once its response has ended (a stream's included): method, path, status, tokens
(prompt + completion, where the request ran any) and duration. Off with --no-access-log. /health and
/metrics, which probes poll, are not logged.

The completion handlers put the request's usage in `request.state.usage` (the ASGI scope's state), which this
middleware reads after the response's last byte; it reads no body. Requests on the router's direct path
(router/http.py), which no middleware sees, are logged by its handler with `log_request`, in the same form.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("pdserve.access")
QUIET_PATHS = frozenset({"/health", "/metrics"})  # polled by launchers, load balancers and scrapers: not logged


class AccessLog:
    """A pure ASGI middleware: streaming responses pass through untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in QUIET_PATHS:
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 0

        async def send_seen(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_seen)
        finally:
            log_request(scope["method"], scope["path"], status, scope.get("state", {}).get("usage"), started)


def log_request(method: str, path: str, status: int, usage: dict | None, started: float) -> None:
    """A request's line (`status` 0: no response started; `started`: its time.perf_counter() when it came).

    `log.info` would look up its caller's file and line by walking the stack, for every request; the record made
    here names this function instead, which is where every line comes from anyway."""
    if not log.isEnabledFor(logging.INFO):
        return
    args = (method, path, status or "-", _tokens(usage), time.perf_counter() - started)
    log.handle(log.makeRecord(log.name, logging.INFO, __file__, _LINE, "%s %s %s%s %.3f s", args, None, _FUNC))


_FUNC, _LINE = log_request.__name__, log_request.__code__.co_firstlineno


def _tokens(usage: dict | None) -> str:
    if not usage:
        return ""
    return f" {usage['prompt_tokens']}+{usage['completion_tokens']} tokens"
