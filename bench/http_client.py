"""An async load generator for any OpenAI-compatible server (pdserve's router, `vllm serve`, ...).

Each request is a streaming `/v1/completions` call with the prompt as a token-id list, `max_tokens`
set to its output length, `ignore_eos`, greedy, and `return_token_ids` so every SSE chunk names the
tokens it carries (`choices[0].token_ids`); a server that leaves those out gets one token counted per
chunk with text. Requests are sent at their arrival offsets from one shared t=0; the time each chunk
arrives is the time of each of its tokens. With `max_concurrency`, at most that many requests are in
flight: a request that arrives while they are waits for one to finish, and is sent (and its TTFT
counted) from then, as vLLM's `--max-concurrency` does.

The streams are read by a minimal HTTP/1.1 client on asyncio streams rather than httpx: the load
generator shares this machine's two cores with the server under test, so its CPU is taken from the
server's threads. On `short_long_mix` (1280 tokens) httpx used 0.31 s of CPU, this client 0.14 s. By default
each request opens a connection of its own (`Connection: close`); with `keep_alive`, connections are reused between
requests, as the OpenAI SDK's client does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from tqdm import tqdm

from bench.metrics import RequestRecord
from bench.workloads import BenchRequest, Workload

if TYPE_CHECKING:
    import httpx

CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class HttpTarget:
    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str | None = None  # served model name; None: the first one /v1/models lists
    timeout_s: float = 1800.0  # per request, first byte to last
    max_concurrency: int | None = None  # requests in flight at most; None: no limit
    run_timeout_s: float | None = None  # the whole run, from its t=0: what is not done by then fails
    keep_alive: bool = False  # reuse connections between requests (as the OpenAI SDK does); False: one a request


def completion_body(model: str, req: BenchRequest) -> dict:
    return {
        "model": model,
        "prompt": list(req.prompt_token_ids),
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    r = await client.get(f"{base_url}/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _take_chunk(payload: bytes, rec: RequestRecord) -> None:
    """Record the tokens of one SSE data payload, arrived now."""
    now = time.perf_counter()
    obj = json.loads(payload)
    if "error" in obj:
        err = obj["error"]
        rec.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return
    for choice in obj.get("choices") or []:
        ids = choice.get("token_ids")
        n = len(ids) if ids is not None else int(bool(choice.get("text")))
        rec.token_times.extend([now] * n)
        rec.output_token_ids.extend(ids or [])


class HttpError(Exception):
    pass


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives: chunked transfer encoding, a Content-Length, or until close."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers, then the body's last CRLF
                    pass
                return
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            yield data[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


class Connections:
    """Open connections to one server, reused between requests when `keep_alive` (one at a time each: a closed load
    of C streams holds C of them); otherwise every request opens its own and closes it (`Connection: close`)."""

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.opened = 0

    async def take(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self.idle:
            reader, writer = self.idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        self.opened += 1
        return await asyncio.open_connection(host, port)

    def give_back(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], whole: bool, headers: dict) -> None:
        """Keep a connection whose response was read to its end and that the server keeps open; close any other."""
        if self.keep_alive and whole and headers.get("connection", "").lower() != "close":
            self.idle.append(conn)
        else:
            conn[1].close()

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def _post_events(url: str, body: dict, conns: Connections | None = None) -> AsyncIterator[bytes]:
    """POST `body` as JSON and yield each server-sent event's payload (the bytes after `data:`)."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise HttpError(f"only http:// targets are supported, not {url}")
    conns = conns or Connections(keep_alive=False)
    reader, writer = await conns.take(parts.hostname, parts.port or 80)
    whole, headers = False, {}
    try:
        payload = json.dumps(body).encode()
        close = "" if conns.keep_alive else "Connection: close\r\n"
        writer.write(
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n{close}\r\n".encode()
            + payload
        )
        status = int((await reader.readline()).split()[1])
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        if status != 200:
            text = b"".join([chunk async for chunk in _read_body(reader, headers)]).decode(errors="replace")
            raise HttpError(f"HTTP {status}: {text[:300]}")
        pending = b""
        async for data in _read_body(reader, headers):
            pending += data.replace(b"\r\n", b"\n")
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[5:].strip()
        whole = "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers
    finally:
        conns.give_back((reader, writer), whole, headers)


async def _stream(url: str, body: dict, rec: RequestRecord, conns: Connections | None = None) -> None:
    done = False
    async for payload in _post_events(url, body, conns):  # read to the body's end, so that its connection is reusable
        if payload == b"[DONE]":
            done = True
        elif not done:
            _take_chunk(payload, rec)


async def _send_at(
    url: str,
    model: str,
    req: BenchRequest,
    t0: float,
    target: HttpTarget,
    slots: asyncio.Semaphore | None,
    conns: Connections,
) -> RequestRecord:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    async with slots or contextlib.nullcontext():
        return await send(url, model, req, target, t0, conns)


async def send(
    url: str,
    model: str,
    req: BenchRequest,
    target: HttpTarget,
    t0: float | None = None,
    conns: Connections | None = None,
) -> RequestRecord:
    """Send one request now and stream its answer (on one of `conns`, or a connection of its own); the run that
    started at `t0` bounds it too."""
    rec = RequestRecord(time.perf_counter(), req.output_len, len(req.prompt_token_ids))
    timeout_s = target.timeout_s
    if target.run_timeout_s is not None and t0 is not None:
        timeout_s = min(timeout_s, t0 + target.run_timeout_s - rec.send_time)
    try:
        await asyncio.wait_for(_stream(url, completion_body(model, req), rec, conns), max(0.0, timeout_s))
    except asyncio.TimeoutError:
        rec.error = f"TimeoutError: not done within {max(0.0, timeout_s):.1f} s (the request's or the run's limit)"
    except (HttpError, OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.check_length()
    return rec


async def run_async(target: HttpTarget, workload: Workload, desc: str = "", progress: bool = True):
    """Send `workload` to `target`; return (t0, records in workload order)."""
    import httpx  # the bench extra: imported where used, so that a run without it can say so in one line

    n = len(workload.requests)
    async with httpx.AsyncClient(timeout=httpx.Timeout(CONNECT_TIMEOUT_S)) as client:
        model = target.model or await served_model(client, target.base_url)
    url = f"{target.base_url}/v1/completions"
    slots = asyncio.Semaphore(target.max_concurrency) if target.max_concurrency else None
    conns = Connections(target.keep_alive)
    with tqdm(total=n, desc=desc or workload.label, unit="req", disable=not progress) as bar:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_send_at(url, model, r, t0, target, slots, conns)) for r in workload.requests]
        for task in tasks:
            task.add_done_callback(lambda _: bar.update(1))
        try:
            records = await asyncio.gather(*tasks)
        finally:
            conns.close()
    return t0, list(records)


def run_http(
    target: HttpTarget, workload: Workload, desc: str = "", progress: bool = True
) -> tuple[float, list[RequestRecord]]:
    """Blocking wrapper of `run_async`."""
    return asyncio.run(run_async(target, workload, desc, progress))
