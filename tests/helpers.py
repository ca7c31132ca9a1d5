"""Shared helpers: reference outputs from transformers, a mixed workload, and a stranger probing node sockets."""

from __future__ import annotations

import functools
import importlib
import json
import os
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import transformers
import zmq

from pdserve.wire.codec import decode


def wait_until(cond, timeout: float, interval: float = 0.05) -> bool:
    """Poll `cond` until it holds (True) or `timeout` seconds have passed (False); the caller asserts with its own
    message. For what only shows in periodic reports (stats, /metrics, /health), where no event can be awaited."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def each_worker_health(url: str, timeout: float, workers: int = 2) -> dict[int, dict]:
    """Each router worker's /health by its number, asked over new connections until every worker has answered (the
    kernel spreads connections over the workers by a hash of their ports; a worker that is starting answers none)."""
    seen: dict[int, dict] = {}

    def all_seen() -> bool:
        h = httpx.get(url + "/health", timeout=10).json()
        seen[h["worker"]] = h
        return len(seen) == workers

    assert wait_until(all_seen, timeout, interval=0.01), f"only workers {sorted(seen)} answered"
    return seen


def optional(name: str):
    """Import an optional package (ray, llguidance, jsonschema, triton): a test that needs it is skipped where it is
    not installed, but fails under CI (CI=true), where the [test] extra installs them all and a missing one is a
    broken install, not a reason to skip."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        return importlib.import_module(name)
    return pytest.importorskip(name)


def hf_greedy(model_path, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """transformers `generate`, greedy, one request at a time (no padding), EOS ignored. Each answer is computed once
    a session: the tests ask for the same ones again and again (a checkpoint folder is never rewritten)."""
    path = str(Path(model_path).resolve())
    return [list(_hf_greedy_one(path, tuple(ids), n)) for ids, n in zip(prompts, max_new, strict=True)]


@functools.cache
def _hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def _hf_greedy_one(path: str, ids: tuple[int, ...], n: int) -> tuple[int, ...]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        y = _hf_model(path).generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return tuple(y[0, len(ids) :].tolist())


def mixed_workload(n: int, vocab: int, seed: int = 0, max_prompt: int = 300, max_out: int = 24):
    """n prompts of 1..max_prompt random token ids and output lengths 1..max_out (always some extremes)."""
    rng = random.Random(seed)
    lens = [1, max_prompt] + [rng.randint(1, max_prompt) for _ in range(n - 2)]
    outs = [max_out, 1] + [rng.randint(1, max_out) for _ in range(n - 2)]
    prompts = [[rng.randrange(vocab - 3) for _ in range(L)] for L in lens]
    return prompts, outs


def probe_answers(
    addrs: list[str], curve: tuple[bytes, bytes, bytes] | None, messages: list[list[bytes]], wait_ms: int
) -> list[str]:
    """Connect a stranger DEALER (CURVE keys (public, secret, server's public), or none) to each address, send
    `messages`, and return the addresses that answered within `wait_ms` (a negative result needs some wait)."""
    ctx = zmq.Context()
    socks = {}
    try:
        for addr in addrs:
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            if curve is not None:
                s.curve_publickey, s.curve_secretkey, s.curve_serverkey = curve
            s.connect(addr)
            for m in messages:
                s.send_multipart(m, flags=zmq.NOBLOCK)
            socks[addr] = s
        poller = zmq.Poller()
        for s in socks.values():
            poller.register(s, zmq.POLLIN)
        answered = dict(poller.poll(wait_ms))
        return [a for a, s in socks.items() if s in answered]
    finally:
        ctx.destroy(linger=0)


def export_tokens(pool, block_ids: list[int], num_tokens: int):
    """One request's first `num_tokens` tokens of KV in `pool` as a contiguous [L, 2, nkv, n, d] tensor."""
    idx = pool.slots(block_ids, 0, num_tokens).to(pool.data.device)
    return pool.data.index_select(3, idx)


def import_tokens(pool, block_ids: list[int], kv) -> None:
    """Write a [L, 2, nkv, n, d] tensor into the blocks `block_ids` of `pool`."""
    idx = pool.slots(block_ids, 0, kv.shape[3]).to(pool.data.device)
    pool.data.index_copy_(3, idx, kv.to(pool.data.device))


def tiny_greedy(max_tokens: int, prompt: list[int] | None = None) -> dict:
    """A greedy completion body for `tiny` that runs `max_tokens` tokens (EOS ignored)."""
    return {
        "model": "tiny",
        "prompt": prompt or [3, 4, 5],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }


class Stream(threading.Thread):
    """One streamed completion read in a thread: its token ids, texts and arrival times chunk by chunk, and how it
    ended ([DONE], an error, its finish reason).

    `first` is set at its first token chunk (or when it ends without one: check `error`), so a test can act while
    streams run; `hang_up()` disconnects at the next line it reads (the router then aborts the request).
    """

    def __init__(self, url: str, body: dict, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True, "return_token_ids": True}
        self.headers = headers or {}
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.times: list[float] = []
        self.finish: str | None = None
        self.status = 0
        self.done, self.error = False, ""
        self.first, self._hang_up = threading.Event(), threading.Event()

    def hang_up(self) -> None:
        """Disconnect at the next line (the router then aborts the request)."""
        self._hang_up.set()

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url + "/v1/completions", json=self.body, headers=self.headers, timeout=120
            ) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}"
                    return
                for line in r.iter_lines():
                    if self._hang_up.is_set():
                        return  # leaving the block closes the connection
                    self._line(line)
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.first.set()  # never left waiting

    def _line(self, line: str) -> None:
        if line == "data: [DONE]":
            self.done = True
        elif line.startswith("data: "):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                self.error = chunk["error"]["message"]
                return
            self.times.append(time.monotonic())
            for c in chunk["choices"]:
                self.token_ids += c.get("token_ids") or []
                self.texts.append(c.get("text", ""))
                self.finish = c.get("finish_reason") or self.finish
            self.first.set()

    @property
    def complete(self) -> bool:
        """Ended with [DONE], no error, and every token it asked for."""
        return self.done and not self.error and len(self.token_ids) == self.body["max_tokens"]

    def max_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0.0)


def start_streams(url: str, bodies: list[dict], timeout: float = 120) -> list[Stream]:
    """Start a stream of each body and wait until every one has its first token chunk (an error fails here)."""
    streams = [Stream(url, body) for body in bodies]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(timeout), f"no token within {timeout} s"
    assert not any(s.error for s in streams), [s.error for s in streams]
    return streams


class FakeNodeSock:
    """A node's socket as the router's core sees it in-process: what it was sent, decoded; nothing ever waits to be
    read (the tests hand the core each node message themselves)."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, data: bytes, flags: int = 0) -> None:
        self.sent.append(decode(data))

    def get(self, option: int) -> int:
        return 0  # ZMQ_EVENTS: no message waiting


def take_tokens(s, reqs: list, tokens: list[int]) -> None:
    """A step's sampled tokens taken in as the engine takes them: each appended to its request and, for one still
    running, told its row (`BatchRows.take_tokens`: what the scheduler's steady path counts from). `s`: a Scheduler."""
    import numpy as np

    for r, t in zip(reqs, tokens, strict=True):
        r.output_token_ids.append(t)
    held = [(s.rows.row_of[r], t) for r, t in zip(reqs, tokens, strict=True) if r in s.rows]
    if held:
        rows = np.array([row for row, _ in held], dtype=np.int64)
        s.rows.take_tokens(rows, s.rows.owner[rows], np.array([t for _, t in held], dtype=np.int64))
