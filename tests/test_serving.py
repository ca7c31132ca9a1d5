"""Served end to end over HTTP: every mode and transport equals transformers token for token."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers import hf_greedy, mixed_workload
from stack import Stack

from pdserve.engine.checkpoint import resolve_model

ENGINE_ARGS = ("--max-num-batched-tokens", "128", "--num-kv-blocks", "200")  # chunked prompts, a tight pool
MODES = {
    "colocated": dict(mode="colocated"),
    "disagg-zmq": dict(mode="disagg", transport="zmq"),
    "disagg-shm": dict(mode="disagg", transport="shm"),
    "disagg-2p2d": dict(mode="disagg", transport="zmq", num_prefill=2, num_decode=2),
}
NUM_REQUESTS = 32


@pytest.fixture(scope="module")
def workload():
    prompts, outs = mixed_workload(NUM_REQUESTS, 512, seed=21)
    return prompts, outs, hf_greedy(resolve_model("tiny"), prompts, outs)


@pytest.fixture(scope="module", params=list(MODES))
def stack(request, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp(request.param), "tiny", engine_args=ENGINE_ARGS, **MODES[request.param])
    yield s.start()
    s.close()


async def _complete_all(url: str, prompts, outs) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(p, n):
            body = {"model": "tiny", "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}  # fmt: skip
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert r.json()["usage"]["completion_tokens"] == n
            return choice["token_ids"]

        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, outs, strict=True)))


def test_concurrent_mixed_requests_equal_transformers(stack, workload):
    prompts, outs, ref = workload
    got = asyncio.run(_complete_all(stack.url, prompts, outs))
    mismatched = [i for i in range(NUM_REQUESTS) if got[i] != ref[i]]
    assert not mismatched, f"requests {mismatched} differ from transformers"
    stack.wait_kv_free()


def test_streamed_tokens_equal_the_whole_answer(stack, workload):
    prompts, outs, ref = workload
    body = {"model": "tiny", "prompt": prompts[0], "max_tokens": outs[0], "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    ids, usage = [], None
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = httpx.Response(200, content=line[6:]).json()
                for c in chunk["choices"]:
                    ids += c.get("token_ids", [])
                usage = chunk.get("usage") or usage
    assert ids == ref[0]
    assert usage == {"prompt_tokens": len(prompts[0]), "completion_tokens": outs[0],
                     "total_tokens": len(prompts[0]) + outs[0]}  # fmt: skip
