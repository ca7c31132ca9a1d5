"""A prefill node killed with SIGKILL: its requests go to another prefill node (exact output), or fail
with 503 when none is left; requests whose KV reached the decode node carry on; a restarted node rejoins."""

from __future__ import annotations

import asyncio
import signal
import subprocess

import httpx
import pytest

from bench.systems import node_counters_per_node
from pdserve.checkpoint import resolve_model
from tests.helpers import Stream, hf_greedy, mixed_workload, tiny_greedy, wait_until
from tests.stack import NO_LOCAL_PREFILL, Stack

ENGINE_ARGS = ("--max-num-batched-tokens", "32")  # slow prompts, so that the prefill nodes hold a queue
NUM_REQUESTS = 16


@pytest.fixture(scope="module")
def workload():
    prompts, outs = mixed_workload(NUM_REQUESTS, 512, seed=5, max_prompt=400, max_out=12)
    prompts = [p if len(p) > 100 else p * (100 // len(p) + 1) for p in prompts]  # every prompt takes a while
    return prompts, outs, hf_greedy(resolve_model("tiny"), prompts, outs)


async def _complete(url: str, prompts, outs) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        bodies = [
            {
                "model": "tiny",
                "prompt": p,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "n": 2 if i % 4 == 0 else 1,
            }
            for i, (p, n) in enumerate(zip(prompts, outs, strict=True))
        ]  # every 4th: two choices, two requests

        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


def _in_flight(stack: Stack, addr: str) -> int:
    nodes = httpx.get(stack.url + "/health", timeout=10).json()["nodes"]
    return next(n["in_flight"] for n in nodes if n["addr"] == addr)


def _wait_for(cond, what: str, timeout: float = 60) -> None:
    assert wait_until(cond, timeout, 0.02), f"timed out waiting until {what}"


def _metric(stack: Stack, name: str) -> float:
    for line in httpx.get(stack.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _token_ids(responses: list[httpx.Response]) -> list[list[int]]:
    assert [r.status_code for r in responses] == [200] * len(responses), [r.text for r in responses][:3]
    choices = [r.json()["choices"] for r in responses]
    assert [len(c) for c in choices] == [2 if i % 4 == 0 else 1 for i in range(len(responses))]
    for c in choices:  # greedy: each choice (its own engine request, moved on its own) gives the same tokens
        assert all(x["token_ids"] == c[0]["token_ids"] for x in c), [x["token_ids"] for x in c]
    return [c[0]["token_ids"] for c in choices]


@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_prefill_node_loss(tmp_path, transport, workload):
    prompts, outs, ref = workload
    stack = Stack(
        tmp_path,
        "tiny",
        mode="disagg",
        transport=transport,
        num_prefill=2,
        engine_args=ENGINE_ARGS,
        router_args=NO_LOCAL_PREFILL,
    ).start()
    try:
        _requests_move_to_the_other_prefill_node(stack, prompts, outs, ref)
        _a_restarted_prefill_node_rejoins(stack, prompts[:6], ref[:6])
        _with_none_left_queued_requests_fail_and_decoding_ones_finish(stack)
    finally:
        stack.close()


def _requests_move_to_the_other_prefill_node(stack: Stack, prompts, outs, ref) -> None:
    victim = stack.infos["prefill0"]["listen"]
    results = asyncio.run(_kill_while_running(stack, ["prefill0"], prompts, outs, 4))
    assert _token_ids(results) == ref
    assert _metric(stack, "pdserve:requests_redispatched_total") >= 1, "no request was moved: proves nothing"
    stack.wait_kv_free(dead=(victim,))


async def _kill_while_running(
    stack: Stack, victims: list[str], prompts, outs, held: int, stopped: subprocess.Popen | None = None
) -> list[httpx.Response]:
    """Send the requests; once the first victim holds `held` of them, SIGKILL every victim, then let the `stopped`
    process (SIGSTOP) run again."""
    task = asyncio.create_task(_complete(stack.url, prompts, outs))
    await asyncio.to_thread(_stop_holding, stack, victims, held)
    for v in victims:
        stack.kill(v)
    if stopped is not None:
        stopped.send_signal(signal.SIGCONT)
    return await task


def _stop_holding(stack: Stack, victims: list[str], held: int) -> None:
    """Stop (SIGSTOP) the victims once the router counts `held` requests on the first, as it still does with them
    stopped: however fast the host, they are held there at the kill."""
    addr = stack.infos[victims[0]]["listen"]
    while True:
        _wait_for(lambda: _in_flight(stack, addr) >= held, f"{victims[0]} holds requests")
        for v in victims:
            stack.procs[v].send_signal(signal.SIGSTOP)
        if _in_flight(stack, addr) >= held:
            return
        for v in victims:
            stack.procs[v].send_signal(signal.SIGCONT)


def _a_restarted_prefill_node_rejoins(stack: Stack, prompts, ref) -> None:
    victim = stack.infos["prefill0"]["listen"]
    stack.restart_node("prefill0", "prefill")
    _wait_for(
        lambda: all(n["up"] for n in httpx.get(stack.url + "/health", timeout=10).json()["nodes"]),
        "the restarted prefill node is up",
    )
    assert _token_ids(asyncio.run(_complete(stack.url, prompts, [len(r) for r in ref]))) == ref
    # node counters reach the router with the node's stats, every 0.5 s: wait for them
    _wait_for(lambda: _node_requests(stack, victim) > 0, "the restarted prefill node took a request")


def _node_requests(stack: Stack, addr: str) -> int:
    counters = node_counters_per_node(httpx.get(stack.url + "/metrics", timeout=10).text, "prefill")
    return int(counters.get("requests", {}).get(addr, 0))


def _with_none_left_queued_requests_fail_and_decoding_ones_finish(stack: Stack) -> None:
    decoding = Stream(stack.url, tiny_greedy(600))
    decoding.start()
    _wait_for(lambda: len(decoding.times) >= 2, "a request is decoding")
    decode = stack.procs["decode0"]
    decode.send_signal(signal.SIGSTOP)  # however fast the host, the decoding request is still there at the kill
    try:
        assert not decoding.done, "the decoding request ended before the kill: the test proves nothing"
        prompts = [[1 + i % 500 for i in range(1200)]] * 6
        queued = asyncio.run(_kill_while_running(stack, ["prefill0", "prefill1"], prompts, [4] * 6, 3, decode))
    finally:
        decode.send_signal(signal.SIGCONT)
    failed = [r for r in queued if r.status_code == 503]
    assert failed, "every request was prefilled before the kill: the test proves nothing"
    assert all("no prefill node is up" in r.json()["error"]["message"] for r in failed)
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in queued if r.status_code == 200)
    assert {r.status_code for r in queued} <= {200, 503}
    decoding.join(timeout=600)  # a hang guard
    assert decoding.complete, (len(decoding.token_ids), decoding.error)
