"""Served end to end over HTTP: every mode and transport equals transformers token for token, cache hits forced
included (prefix caching, and a disaggregated decode node prefilling a prompt it nearly holds), the hits counted."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from bench.systems import counters_diff, node_counters
from pdserve.checkpoint import resolve_model
from tests.helpers import hf_greedy, mixed_workload
from tests.stack import Stack

ENGINE_ARGS = ("--max-num-batched-tokens", "128", "--num-kv-blocks", "200")  # chunked prompts, a tight pool
MODES = {
    "colocated": dict(mode="colocated"),
    "disagg-zmq": dict(mode="disagg", transport="zmq"),
    "disagg-shm": dict(mode="disagg", transport="shm"),
    "disagg-2p2d": dict(mode="disagg", transport="zmq", num_prefill=2, num_decode=2),
}
ONLY_WHERE_ASKED = {"disagg-queue": dict(mode="disagg", transport="zmq", router_args=("--max-prefill-queue", "1"))}
NUM_REQUESTS = 32
CHUNK = 128  # --max-num-batched-tokens: the tokens a decode node prefills itself at most (by default)
BLOCK = 16  # tokens per KV block (the default)


@pytest.fixture(scope="module")
def workload():
    prompts, outs = mixed_workload(NUM_REQUESTS, 512, seed=21)
    return prompts, outs, hf_greedy(resolve_model("tiny"), prompts, outs)


@pytest.fixture(scope="module", params=list(MODES))
def stack(request, tmp_path_factory):
    settings = {**MODES, **ONLY_WHERE_ASKED}[request.param]
    s = Stack(tmp_path_factory.mktemp(request.param), "tiny", engine_args=ENGINE_ARGS, **settings)
    yield s.start()
    s.close()


async def _complete_all(url: str, prompts, outs) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(p, n):
            body = {
                "model": "tiny",
                "prompt": p,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
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
    body = {
        "model": "tiny",
        "prompt": prompts[0],
        "max_tokens": outs[0],
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ids, usage = [], None
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = httpx.Response(200, content=line[6:]).json()
                for c in chunk["choices"]:
                    ids += c.get("token_ids", [])
                usage = chunk.get("usage") or usage
    assert ids == ref[0]
    assert usage == {
        "prompt_tokens": len(prompts[0]),
        "completion_tokens": outs[0],
        "total_tokens": len(prompts[0]) + outs[0],
    }


# ---- prefix caching, forced hits --------------------------------------------------------------------------
def _counters(stack: Stack) -> dict[str, dict[str, float]]:
    """The nodes' counters, summed per role, from reports sent after every request so far ended."""
    stack.wait_kv_free()
    return node_counters(httpx.get(stack.url + "/metrics", timeout=10).text)


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.mark.parametrize("stack", ["colocated", "disagg-zmq", "disagg-shm"], indirect=True)
def test_concurrent_requests_behind_a_cached_prefix_equal_transformers(stack):
    """A warm-up request caches a 96-token prefix (6 blocks) on the nodes it runs on; then six requests behind it,
    with suffixes of 10 to 200 tokens, run at once, each sharing the prefix's 6 blocks wherever its prompt is
    computed or its KV lands. Disaggregated, the three whose suffix is at most one chunk are prefilled on the decode
    node itself (the one at exactly a chunk included), the others on the prefill node, which ships their KV from the
    first block after the prefix. Every answer is transformers'."""
    rng = random.Random(7)
    prefix = _random_ids(rng, 6 * BLOCK)
    warm = prefix + [500] + _random_ids(rng, 4)
    suffixes = [10, 64, CHUNK, CHUNK + 1, 160, 200]
    prompts = [prefix + [501 + i] + _random_ids(rng, n - 1) for i, n in enumerate(suffixes)]
    ref = hf_greedy(resolve_model("tiny"), [warm, *prompts], [4] + [6] * len(prompts))
    start = _counters(stack)
    assert asyncio.run(_complete_all(stack.url, [warm], [4])) == ref[:1]
    warmed = _counters(stack)
    assert asyncio.run(_complete_all(stack.url, prompts, [6] * len(prompts))) == ref[1:]
    grew = counters_diff(_counters(stack), warmed)
    shared = 6 * BLOCK * len(prompts)
    if stack.mode == "colocated":
        assert grew["colocated"]["prefix_cache_hits"] == shared
        assert grew["colocated"]["prefix_cache_queries"] == sum(map(len, prompts))
        return
    per_token = counters_diff(warmed, start)["prefill"]["kv_transfer_bytes"] / len(warm)  # shipped whole
    remote = [p for p, n in zip(prompts, suffixes, strict=True) if n > CHUNK]
    decode, prefill = grew["decode"], grew["prefill"]
    assert decode["local_prefill_requests"] == len(prompts) - len(remote) == 3
    assert decode["prefix_cache_hits"] == shared  # at admission (prefilled there) or when reserving (pulled)
    assert prefill["requests"] == prefill["kv_transfers"] == len(remote)
    assert prefill["prefix_cache_hits"] == 6 * BLOCK * len(remote)
    assert prefill["kv_skipped_bytes"] == 6 * BLOCK * len(remote) * per_token
    assert prefill["kv_transfer_bytes"] == sum(len(p) - 6 * BLOCK for p in remote) * per_token


@pytest.mark.parametrize("stack", ["disagg-queue"], indirect=True)
def test_prompts_sent_together_are_prefilled_on_both_nodes_past_the_prefill_queue_limit(stack):
    """--max-prefill-queue 1: eight new 300-token prompts at once. The first goes through the prefill node; while
    it is there, the decode node takes prompts too (while fewer of its own wait for their first token than the
    prefill node holds), so both compute some, and every answer is transformers'."""
    rng = random.Random(11)
    prompts = [[300 + i] + _random_ids(rng, 299) for i in range(8)]
    before = _counters(stack)
    assert asyncio.run(_complete_all(stack.url, prompts, [6] * 8)) == hf_greedy(resolve_model("tiny"), prompts, [6] * 8)
    grew = counters_diff(_counters(stack), before)
    local, remote = grew["decode"]["local_prefill_requests"], grew["prefill"]["requests"]
    assert local >= 1 and remote >= 1 and local + remote == 8
    assert grew["prefill"]["kv_transfers"] == remote


@pytest.mark.parametrize("stack", ["disagg-zmq", "disagg-shm"], indirect=True)
def test_the_next_turn_is_prefilled_on_its_decode_node_up_to_one_chunk(stack):
    """Two conversations' first turns (40-token prompts, 8-token answers) go through the prefill node; the decode
    node caches each prompt's imported KV and its answer's, computed there: 2 full blocks each (every token but the
    last answer token has KV). Each second turn is the history and a new message. A's leaves exactly one chunk to
    compute (CHUNK tokens after the 2 blocks): the router sends it to the decode node alone, which prefills it; the
    prefill node sees no request and ships no KV. B's leaves one token more: it goes through the prefill node, which
    ships only the KV after the decode node's 2 cached blocks. Every answer is transformers'."""
    rng = random.Random(5)
    firsts = [[400 + c] + _random_ids(rng, 39) for c in range(2)]
    start = _counters(stack)
    answers = asyncio.run(_complete_all(stack.url, firsts, [8, 8]))
    turn1 = _counters(stack)
    cached = (40 + 8 - 1) // BLOCK * BLOCK
    more = [cached + CHUNK + extra - 48 for extra in (0, 1)]  # to compute: one chunk (A), one token more (B)
    seconds = [f + a + _random_ids(rng, n) for f, a, n in zip(firsts, answers, more, strict=True)]
    answers2 = asyncio.run(_complete_all(stack.url, seconds, [8, 8]))
    grew = counters_diff(_counters(stack), turn1)
    assert [*answers, *answers2] == hf_greedy(resolve_model("tiny"), firsts + seconds, [8] * 4)
    per_token = counters_diff(turn1, start)["prefill"]["kv_transfer_bytes"] / 80  # turn 1 shipped both prompts whole
    decode, prefill = grew["decode"], grew["prefill"]
    assert decode["local_prefill_requests"] == 1 and decode["prefix_cache_hits"] == 2 * cached
    assert prefill["requests"] == prefill["kv_transfers"] == 1  # B's only
    assert prefill["prefix_cache_hits"] == 40 // BLOCK * BLOCK  # B's first prompt blocks, computed there in turn 1
    assert prefill["kv_transfer_bytes"] == (len(seconds[1]) - cached) * per_token
    assert prefill["kv_skipped_bytes"] == cached * per_token


@pytest.mark.parametrize("stack", ["disagg-zmq"], indirect=True)
def test_a_restarted_decode_node_is_no_longer_taken_to_hold_its_old_cache(stack):
    """A prompt asked again is prefilled on the decode node that holds it. That node restarts (its cache is gone):
    the router forgets its view, so the prompt goes through the prefill node again; once the new node has cached
    it (its Stats say so), it is prefilled there again. (Last in this file: it restarts a node of the stack.)"""
    prompt = [450] + _random_ids(random.Random(9), 59)
    ref = hf_greedy(resolve_model("tiny"), [prompt], [4])

    def ask() -> dict[str, dict[str, float]]:
        assert asyncio.run(_complete_all(stack.url, [prompt], [4])) == ref
        return _counters(stack)

    before = _counters(stack)
    ask()
    seen = counters_diff(ask(), before)
    assert seen["prefill"]["requests"] == 1 and seen["decode"]["local_prefill_requests"] == 1
    stack.kill("decode0")
    stack.restart_node("decode0", "decode")
    stack.wait_healthy(timeout=60)
    restarted = _counters(stack)  # the new decode process counts from zero
    after = ask()
    assert after["prefill"]["requests"] == restarted["prefill"]["requests"] + 1
    assert after["decode"]["local_prefill_requests"] == 0
    assert ask()["decode"]["local_prefill_requests"] == 1
