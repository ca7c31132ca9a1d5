"""The router's per-token path in process: CPU per token from a node message's bytes to the chunks held for the
clients' sockets, with no socket, no syscall and no other process.

    python -m bench.router_path --streams 16 --steps 1000 --rounds 5 [--cold-mb 32]

A RouterCore with fake node sockets (1 prefill, 1 decode node), `--streams` streamed completions of the `tiny`
model, each attached to a recorder as the direct path attaches its connection; every request's first token and "KV
landed" notice are delivered, then `--steps` decode-node messages (one token for every stream, as a node's step
sends them, encoded as nodes encode them) are read by the core, each followed by the event loop's pass that flushes
the streams' writes. Reported: the least CPU per token over `--rounds` rounds (`time.process_time`, the messages'
handling only).

In a served router the same path runs several times slower: the router sleeps between node messages while the nodes
and clients run, so each message finds the CPU's caches holding their data, not its own. `--cold-mb N` walks N MB of
memory before each message (not counted) to show that: what the path costs then depends on how much code and data it
touches, not only on how many operations it does. bench.router measures the served router as a whole.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from types import SimpleNamespace

from pdserve.config import RouterConfig
from pdserve.router import api
from pdserve.router.core import RouterCore
from pdserve.router.nodes import NodeConn
from pdserve.router.stream import Outbox, SseStream
from pdserve.router.text import load_model_info
from pdserve.wire.codec import encode
from pdserve.wire.messages import TokenEvent, TokenEvents
from pdserve.wire.params import Role

MAX_STEPS = 2000  # each stream's answer is --steps + 2 tokens, within the tiny model's context of 2048


class _NodeSock:
    """A node's socket that holds the messages queued for the core to read; what the core sends it is dropped."""

    closed = False

    def __init__(self) -> None:
        self.queue: list[bytes] = []

    def send(self, data: bytes, flags: int = 0) -> None:
        pass

    def get(self, option: int) -> int:
        return 1 if self.queue else 0  # ZMQ_EVENTS: POLLIN while a message waits

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        return [self.queue.pop(0)]


def _core() -> RouterCore:
    core = RouterCore(RouterConfig(model="tiny", prefill=("tcp://p0",), decode=("tcp://d0",), decode_kv=("tcp://k0",)))
    for m in core.links.membership._members:
        core.nodes.append(NodeConn(m.role, m.addr, m.kv_addr, sock=_NodeSock(), up=True))
    return core


def _node(core: RouterCore, role: Role) -> NodeConn:
    return next(n for n in core.nodes if n.role is role)


async def one_round(core: RouterCore, info, streams: int, steps: int, cold: list) -> float:
    """CPU µs per token of `steps` messages of one token for each of `streams` streams."""
    prefill, decode = _node(core, Role.PREFILL), _node(core, Role.DECODE)
    outbox, written = Outbox(), []
    flights = []
    for _ in range(streams):
        body = api.CompletionBody(model="tiny", prompt=[1, 2, 3], max_tokens=steps + 2, stream=True, ignore_eos=True)
        job = api.make_job(body, [1, 2, 3], info)
        flight = core.submit(job.prompt_ids, job.params)
        stream = SseStream(core, info, [job], False, [flight], SimpleNamespace(usage=None), "stream", outbox)
        stream.attach(written.append)
        core.links._on_message(decode, [encode(TokenEvents.of([TokenEvent(flight.request_id, [])]))])
        core.links._on_message(prefill, [encode(TokenEvents.of([TokenEvent(flight.request_id, [300])]))])
        flights.append(flight)
    messages = [
        encode(TokenEvents.of([TokenEvent(f.request_id, [256 + (k * 7 + i) % 250]) for i, f in enumerate(flights)]))
        for k in range(steps)
    ]
    await asyncio.sleep(0)
    spent = 0.0
    for message in messages:
        if cold:
            cold.reverse()  # every element's reference count written: the caches hold this list, not the router
        decode.sock.queue.append(message)
        t0 = time.process_time()
        core.links._read_batch(decode)
        await asyncio.sleep(0)  # the loop's next pass: the outbox flushes
        spent += time.process_time() - t0
    for f in flights:
        core.abort(f.request_id)
    await asyncio.sleep(0)
    assert len(written) >= streams * steps, "a stream wrote less than a chunk a token"
    return spent / (streams * steps) * 1e6


async def measure(streams: int, steps: int, rounds: int, cold_mb: int) -> dict:
    info, core = load_model_info("tiny"), _core()
    cold = list(range(cold_mb * 1024 * 1024 // 8))  # 8 bytes a reference
    try:
        runs = [await one_round(core, info, streams, steps, cold) for _ in range(rounds)]
    finally:
        core.links.ctx.destroy(linger=0)
    return {
        "streams": streams,
        "steps": steps,
        "cold_mb": cold_mb,
        "us_per_token": min(runs),
        "rounds": runs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.router_path", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16, help="streams; each message carries a token for each")
    ap.add_argument("--steps", type=int, default=1000, help="node messages a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold-mb", type=int, default=0, help="memory walked before each message (0: none)")
    a = ap.parse_args(argv)
    if not 1 <= a.steps <= MAX_STEPS or a.streams < 1 or a.rounds < 1:
        ap.error(
            f"--streams and --rounds must be at least 1, --steps between 1 and {MAX_STEPS} (a request's tokens "
            "within tiny's context)"
        )
    result = asyncio.run(measure(a.streams, a.steps, a.rounds, a.cold_mb))
    print(json.dumps(result))
    print(
        f"{result['us_per_token']:.2f} µs of CPU a token (least of {a.rounds} rounds; {a.streams} streams, "
        f"{a.cold_mb} MB walked before each message)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
