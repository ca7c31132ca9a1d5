"""The router's HTTP server: uvicorn, bounded headers, and a SIGTERM that drains.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and waits for the open ones; meanwhile
`RouterCore.drain` refuses new requests, lets those in flight finish for --drain-timeout-s, then
fails the rest with a clear error (a 503 body, or an error event ending the stream). The process
then exits with status 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import Callable
from functools import partial
from types import FrameType

import uvicorn
from fastapi import FastAPI

from pdserve.config import RouterConfig
from pdserve.router.api import create_app
from pdserve.router.http import RouterHttp
from pdserve.router.limits import MAX_HEADER_BYTES

log = logging.getLogger("pdserve.router")


class DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, app: FastAPI, drain_s: float, ready: Callable[[str], str] | None = None
    ) -> None:
        super().__init__(config)
        self.app, self.drain_s, self.ready = app, drain_s, ready
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if getattr(self.app.state, "start_error", None) is not None:
            self.should_exit = True  # the nodes never answered, or a SIGTERM came first: serve nothing
            return
        if self.started:
            freeze_startup_heap()
        if self.started and self.ready:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            log.info("%s", self.ready(f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Unlike uvicorn's own, it does not re-raise the signal once shut down: a drained router exits 0."""
        if self.should_exit:
            self.force_exit = True
            return
        self.should_exit = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self.app.state.exit_requested = True
        core = getattr(self.app.state, "core", None)
        if core is not None and not self.started:
            core.start_cancelled.set()  # still waiting for the nodes: stop waiting
        elif core is not None:
            self.drain_task = asyncio.create_task(core.drain(self.drain_s))


def freeze_startup_heap() -> None:
    """Take what the router built to start (modules, the app, the tokenizer, its node connections: objects that live
    as long as it does) out of the cyclic garbage collector's view. A full collection walked all of it, tens of
    milliseconds each time a streamed answer's objects had piled up (docs/router-scaling.md); the objects of requests
    are collected as before."""
    gc.collect()
    gc.freeze()


def ready_line(cfg: RouterConfig, url: str) -> str:
    """The router's ready line (its log's prefix names the router or worker): its URL, the model it serves and the
    nodes it was given."""
    given = (("colocated", cfg.colocated), ("prefill", cfg.prefill), ("decode", cfg.decode))
    nodes = "; ".join(f"{role} {', '.join(addrs)}" for role, addrs in given if addrs)
    model = cfg.served_model_name or cfg.model
    return f"ready: serving {model} at {url}, over the nodes {nodes}"


def serve(
    cfg: RouterConfig, sock: socket.socket | None = None, worker: int | None = None, metrics_dir: str = ""
) -> None:
    """Serve on cfg.host:cfg.port, or on `sock` (a worker of several, router/workers.py, numbered `worker`, sharing
    metrics through `metrics_dir`)."""
    app = create_app(cfg, worker, metrics_dir)
    http = partial(RouterHttp, direct=app.state.direct, body_limit=cfg.max_request_bytes)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        http=http,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=cfg.drain_timeout_s + 5,
    )
    server = DrainingServer(config, app, cfg.drain_timeout_s, partial(ready_line, cfg))
    server.run(sockets=[sock] if sock is not None else None)
    error = getattr(app.state, "start_error", None)
    if error is not None and app.state.core.start_cancelled.is_set():
        log.info("stopping: the router was stopped before its nodes answered")
    elif error is not None:
        raise SystemExit(f"pdserve: error: {error}")
