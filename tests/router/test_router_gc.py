"""The router takes its startup heap out of the cyclic garbage collector's view once it serves (gc.freeze), so a full
collection walks only what requests left (docs/notes/router-scaling-log.md)."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import uvicorn

from pdserve.router import server


def test_freezing_moves_what_lives_now_out_of_the_collectors_view():
    kept = [[i] for i in range(1000)]  # containers alive now: they are frozen
    try:
        server.freeze_startup_heap()
        assert gc.get_freeze_count() >= len(kept)
        assert gc.get_count()[0] < 10, "what was young is frozen, not left for the next collection"
    finally:
        gc.unfreeze()


def _startup(monkeypatch, started: bool, start_error=None) -> list[str]:
    calls: list[str] = []

    async def uvicorn_startup(self, sockets=None) -> None:
        self.started = started

    monkeypatch.setattr(uvicorn.Server, "startup", uvicorn_startup)
    monkeypatch.setattr(server, "freeze_startup_heap", lambda: calls.append("freeze"))
    app = SimpleNamespace(state=SimpleNamespace(start_error=start_error))
    s = server.DrainingServer(uvicorn.Config(app), app, 1.0, ready=lambda url: calls.append("ready") or url)
    s.servers = [SimpleNamespace(sockets=[SimpleNamespace(getsockname=lambda: ("127.0.0.1", 8000))])]
    asyncio.run(s.startup())
    return calls


def test_the_router_freezes_its_heap_once_it_serves_before_its_ready_line(monkeypatch):
    assert _startup(monkeypatch, started=True) == ["freeze", "ready"]


def test_a_router_that_does_not_serve_freezes_nothing(monkeypatch):
    assert _startup(monkeypatch, started=False) == []
    assert _startup(monkeypatch, started=True, start_error=RuntimeError("no nodes")) == []
