"""An async load generator for any OpenAI-compatible server (pdserve's router, `vllm serve`, ...).

Each request is a streaming `/v1/completions` call with the prompt as a token-id list, `max_tokens`
set to its output length, `ignore_eos`, greedy, and `return_token_ids` so every SSE chunk names the
tokens it carries (`choices[0].token_ids`); a server that leaves those out gets one token counted per
chunk with text. Requests are sent at their arrival offsets from one shared t=0; the time each chunk
arrives is the time of each of its tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from bench.metrics import RequestRecord
from bench.workloads import BenchRequest, Workload

CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class HttpTarget:
    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str | None = None  # served model name; None: the first one /v1/models lists
    timeout_s: float = 1800.0  # per request, first byte to last


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


def _take_chunk(payload: str, rec: RequestRecord) -> None:
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


async def _stream(client: httpx.AsyncClient, url: str, body: dict, rec: RequestRecord) -> None:
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            rec.error = f"HTTP {resp.status_code}: {text[:300]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            _take_chunk(payload, rec)


async def _send_at(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, t0: float) -> RequestRecord:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    rec = RequestRecord(time.perf_counter(), req.output_len, len(req.prompt_token_ids))
    try:
        await _stream(client, url, completion_body(model, req), rec)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.check_length()
    return rec


async def run_async(target: HttpTarget, workload: Workload, desc: str = "", progress: bool = True):
    """Send `workload` to `target`; return (t0, records in workload order)."""
    n = len(workload.requests)
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
    timeout = httpx.Timeout(target.timeout_s, connect=CONNECT_TIMEOUT_S)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = target.model or await served_model(client, target.base_url)
        url = f"{target.base_url}/v1/completions"
        with tqdm(total=n, desc=desc or workload.label, unit="req", disable=not progress) as bar:
            t0 = time.perf_counter()
            tasks = [asyncio.create_task(_send_at(client, url, model, r, t0)) for r in workload.requests]
            for task in tasks:
                task.add_done_callback(lambda _: bar.update(1))
            records = await asyncio.gather(*tasks)
    return t0, list(records)


def run_http(
    target: HttpTarget, workload: Workload, desc: str = "", progress: bool = True
) -> tuple[float, list[RequestRecord]]:
    """Blocking wrapper of `run_async`."""
    return asyncio.run(run_async(target, workload, desc, progress))
