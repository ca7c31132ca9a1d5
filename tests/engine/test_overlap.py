"""An engine step as launch() + finish(), and the node's I/O between the two (what overlaps a GPU's work).

On the CPU a launch computes the step before it returns; the node runs the same path, and with the
engine marked `overlapped` (as on a GPU) it also holds each step's tokens back until the next launch.
The tokens must be transformers' either way, and a request aborted while its step is in flight must
get nothing from that step and keep its KV blocks until the step is done.
"""

from __future__ import annotations

import signal

import pytest
import torch
import zmq

from pdserve.config import EngineConfig, NodeConfig
from pdserve.engine.engine import DeviceLost, device_lost
from pdserve.nodes.colocated import ColocatedNode
from pdserve.nodes.parts import build_engine
from pdserve.wire import transport
from pdserve.wire.messages import PROTOCOL_VERSION, Abort, Generate, Hello, TokenEvent, TokenEvents
from pdserve.wire.params import SamplingParams
from tests.engine.test_engine import greedy_requests
from tests.helpers import hf_greedy, mixed_workload

WAIT_MS = 10_000


def test_abort_between_launch_and_finish(tiny_models):
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=64))
    prompts, outs = mixed_workload(4, 512, seed=6, max_prompt=40, max_out=8)
    reqs = greedy_requests(prompts, outs)
    for r in reqs:
        engine.add(r)
    got = {r.request_id: [o.token_id] for o in engine.step() for r in [o.request]}  # the prompts, first tokens
    victim = reqs[0]  # asks for 8 tokens
    step = engine.launch()
    assert victim in step.members
    with pytest.raises(RuntimeError, match="in flight"):
        engine.launch()
    used, held = engine.pool.allocator.num_used, len(victim.block_ids)
    engine.abort(victim.request_id)
    assert engine.pool.allocator.num_used == used  # the step may still write its KV
    outputs = engine.finish(step)
    assert victim.request_id not in [o.request.request_id for o in outputs]
    assert engine.pool.allocator.num_used == used - held  # back once the step is done
    for o in outputs:
        got[o.request.request_id].append(o.token_id)
    while engine.has_work():
        for o in engine.step():
            got[o.request.request_id].append(o.token_id)
    ref = hf_greedy(tiny_models["qwen3"], prompts, outs)
    assert [got[str(i)] for i in range(1, 4)] == ref[1:]
    assert got["0"] == ref[0][:1] and engine.pool.allocator.num_free == 64


@pytest.mark.parametrize("works", [False, True], ids=["context-lost", "device-works"])
def test_an_error_when_a_step_is_waited_for_fails_its_requests(tiny_models, monkeypatch, works):
    """A device error surfaces at finish(), where the copy back is waited for: that step's requests fail, their
    blocks come back, and where the device no longer runs work (`device_works`: a sticky CUDA error) the engine marks
    it lost (the node exits, below); a CUDA error that left it working (a launch refused) does not. The engine
    itself still runs a step."""
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=64))

    class Broken:
        def wait(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.sampler, "launch", lambda *args: Broken())
    monkeypatch.setattr(engine.runner, "device_works", lambda: works)
    prompts, outs = mixed_workload(3, 512, seed=8, max_prompt=20, max_out=6)
    for r in greedy_requests(prompts, outs):
        engine.add(r)
    outputs = engine.step()
    assert len(outputs) == 3 and all(o.finish_reason == "error" and "illegal memory" in o.error for o in outputs)
    assert engine.pool.allocator.num_free == 64 and not engine.requests and not engine.in_flight
    assert engine.lost == (None if works else "RuntimeError: CUDA error: an illegal memory access was encountered")
    monkeypatch.undo()
    for r in greedy_requests(prompts[:1], outs[:1]):
        engine.add(r)
    assert [o.token_id for o in engine.step()] == hf_greedy(tiny_models["qwen3"], prompts[:1], [1])[0]


@pytest.mark.parametrize(
    "error, lost",
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("Triton Error [CUDA]: unspecified launch failure"), True),
        (type("AcceleratorError", (RuntimeError,), {})("device-side assert triggered"), True),
        (type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("CUDA error: out of memory"), False),
        (ValueError("a logits processor raised"), False),
    ],
)
def test_a_cuda_error_but_running_out_of_memory_loses_the_device(error, lost):
    assert device_lost(error) is lost


def test_a_node_whose_device_is_lost_sends_the_steps_errors_then_exits(tiny_models, monkeypatch):
    """After a CUDA error that lost the device every step would fail: the node sends the errors of the steps in
    flight (scheduling ahead, the one launched after the failing one too), says why in one line and exits with code 1
    (the router sees it go, and `pdserve up` names it), rather than take requests it cannot run."""
    cfg = NodeConfig(
        "colocated", EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=64, async_scheduling=True)
    )
    node = ColocatedNode(cfg)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # run()'s handlers: not in pytest's process
    try:
        router = Router(node)
        router.send(Hello(PROTOCOL_VERSION, "router"))
        node.loop_once()
        real_run, runs = node.engine.runner.run, []

        def broken(*args):  # a's prompt runs; its first decode step, launched before the prompt's finished, fails
            runs.append(len(node.engine.in_flight))
            if len(runs) > 1:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return real_run(*args)

        monkeypatch.setattr(node.engine.runner, "run", broken)
        monkeypatch.setattr(node.engine.runner, "device_works", lambda: False)
        router.send(Generate("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0)))
        with pytest.raises(DeviceLost, match="colocated node: its device can run no more steps"):
            for _ in range(4):
                node.loop_once()
        assert runs == [0, 1], "the failing step was not launched with the prompt's still in flight"
        router.collect(2)
        first, failed = router.events["a"]
        assert first.token_ids and not first.finish_reason
        assert failed.finish_reason == "error" and "illegal memory access" in failed.error and not node.engine.in_flight
        closed = []
        monkeypatch.setattr(node, "close", lambda: closed.append(True))
        with pytest.raises(SystemExit) as exited:
            node.run()  # its next loop raises DeviceLost again
        assert exited.value.code == 1 and closed == [True]
    finally:
        monkeypatch.undo()
        node.close()


class Router:
    """The router's side of a node's front socket, driven by hand."""

    def __init__(self, node: ColocatedNode) -> None:
        self.node = node
        self.sock = node.ctx.socket(zmq.DEALER)  # closed with the node's context
        self.sock.connect(node.front_addr)
        self.events: dict[str, list[TokenEvent]] = {}

    def send(self, msg) -> None:
        """Send; returns once the node's socket has it (the node's next loop reads it)."""
        transport.send(self.sock, msg)
        assert self.node.front.poll(WAIT_MS), "the node got nothing"

    def collect(self, published: int) -> None:
        """Read until the `published` events the node has sent so far are all in."""
        while sum(map(len, self.events.values())) < published or self.sock.poll(0):
            assert self.sock.poll(WAIT_MS), "the node's events did not come"
            msg = transport.recv(self.sock)[1]
            for e in msg.all() if isinstance(msg, TokenEvents) else []:
                self.events.setdefault(e.request_id, []).append(e)

    def tokens(self, rid: str) -> list[int]:
        return [t for e in self.events.get(rid, []) for t in e.token_ids]

    def finished(self, rid: str) -> bool:
        return any(e.finish_reason for e in self.events.get(rid, []))


def traced(node: ColocatedNode, trace: list) -> None:
    """Record the node's engine calls, message handling and publishing, in order."""
    engine = node.engine
    launch, finish, drain, on_outputs = engine.launch, engine.finish, node.drain, node.on_outputs

    def traced_launch():
        step = launch()
        trace.append(("launch", step))
        return step

    def traced_finish(step):
        outputs = finish(step)
        trace.append(("finish", outputs))
        return outputs

    def traced_drain(sock):
        trace.append(("drain", None))
        drain(sock)

    def traced_outputs(outputs):
        trace.append(("publish", outputs))
        on_outputs(outputs)

    engine.launch, engine.finish = traced_launch, traced_finish
    node.drain, node.on_outputs = traced_drain, traced_outputs


def start_greedy_workload(node, overlapped: bool) -> tuple[Router, list, list[list[int]], list[int]]:
    """Trace `node`'s steps, greet it as a router, and send it five greedy requests of a mixed workload: the
    router, the trace, and the requests' prompts and output lengths."""
    node.engine.overlapped = overlapped
    trace: list = []
    traced(node, trace)
    router = Router(node)
    router.send(Hello(PROTOCOL_VERSION, "router"))
    node.loop_once()
    prompts, outs = mixed_workload(5, 512, seed=9, max_prompt=40, max_out=10)
    for r in greedy_requests(prompts, outs):
        router.send(Generate(r.request_id, r.prompt_token_ids, r.params))
    return router, trace, prompts, outs


@pytest.mark.parametrize("overlapped", [False, True], ids=["cpu-order", "gpu-order"])
def test_node_io_between_launch_and_finish(tiny_models, overlapped):
    """A colocated node in-process: its messages are handled between launch and finish; with the GPU's order a
    step's tokens go out after the next launch. Tokens equal transformers'; an abort handled while the
    request's step is in flight stops it at once, and every block comes back."""
    cfg = NodeConfig("colocated", EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=64))
    node = ColocatedNode(cfg)
    try:
        router, trace, prompts, outs = start_greedy_workload(node, overlapped)
        victim, aborted_in_flight = "0", []  # asks for 10 tokens
        for _ in range(200):
            node.loop_once()
            router.collect(published(trace))
            if len(router.tokens(victim)) == 2 and not aborted_in_flight:
                router.send(Abort(victim))
                node.loop_once()  # its launch runs the victim's step, its drain handles the abort
                step = next(s for what, s in reversed(trace) if what == "launch")
                aborted_in_flight.append(
                    step is not None
                    and node.engine.requests.get(victim) is None
                    and any(r.request_id == victim for r in step.members)
                )
                router.collect(published(trace))
            if all(router.finished(str(i)) for i in range(1, 5)) and not node.held:
                break
        ref = hf_greedy(tiny_models["qwen3"], prompts, outs)
        assert [router.tokens(str(i)) for i in range(1, 5)] == ref[1:]
        assert aborted_in_flight == [True]
        assert router.tokens(victim) == ref[0][: len(router.tokens(victim))] and not router.finished(victim)
        assert len(router.tokens(victim)) == (3 if overlapped else 2)  # the GPU order held one back at the abort
        assert node.engine.pool.allocator.num_free == 64 and not node.engine.requests
        check_order(trace, overlapped)
    finally:
        node.close()


def published(trace: list) -> int:
    return sum(len(outputs) for what, outputs in trace if what == "publish")


def check_order(trace: list, overlapped: bool) -> None:
    """Messages are handled between a launch and its finish; a step's tokens go out (each once) right after the
    next launch when overlapped, else right after their own step's finish."""
    for k, (what, _) in enumerate(trace):
        if what == "drain":
            assert next(w for w, _ in reversed(trace[:k]) if w in ("launch", "finish")) == "launch"
        if what == "publish":
            assert trace[k - 1][0] == ("launch" if overlapped else "finish")
    sent = [id(o) for what, outputs in trace if what == "publish" for o in outputs]
    assert sent == [id(o) for what, outputs in trace if what == "finish" for o in outputs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launch_never_waits_for_the_device(tiny_models):
    """On a GPU, launch() queues the whole step without one synchronizing call (torch raises on any in this
    mode): prompt chunks beside decodes and pure decodes (replayed graphs), a prompt echoed with more rows than a
    bucket computes (eager), greedy, sampled and penalised rows, log-probabilities of samples and of prompts."""
    import dataclasses

    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cuda:0", max_num_seqs=8))
    prompts, outs = mixed_workload(8, 512, seed=12, max_prompt=60, max_out=12)
    reqs = greedy_requests(prompts, outs)
    reqs[5].params = dataclasses.replace(
        reqs[5].params, temperature=0.8, top_k=20, top_p=0.9, seed=3, repetition_penalty=1.1, logprobs=2
    )
    reqs[6].params = dataclasses.replace(reqs[6].params, prompt_logprobs=1)
    for r in reqs[:4]:
        engine.add(r)
    engine.step()  # the first steps compile Triton's kernels and fill the caching allocators
    engine.step()
    for r in reqs[4:]:  # their prompts run beside the first four's decodes
        engine.add(r)
    before = engine.run_counters()
    launched = 0
    while engine.has_work():
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = engine.launch()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not step.error, step.error
        launched += 1
        assert not any(o.finish_reason == "error" for o in engine.finish(step))
    assert launched > 5 and engine.pool.allocator.num_free == engine.pool.num_blocks
    after = engine.run_counters()  # both paths were launched unsynchronized: replayed graphs and eager forwards
    assert after["graph_steps"] > before["graph_steps"] and after["eager_steps"] > before["eager_steps"], after
