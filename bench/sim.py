"""A discrete-event simulator of a disaggregated pdserve deployment: router, P prefill and D decode nodes, KV links.

    python -m bench.sim --costs bench/results/costs-small.json --prefill 1 --decode 1 --workload sharegpt_like

It plays what pdserve does, step by step, with each step's duration from a cost model measured on the real
engine (bench/costs.py), and hands back bench's own `RequestRecord`s, so every metric (TTFT, TPOT, throughput,
goodput) comes from bench/metrics.py. Pure Python, deterministic: the same workload gives the same result.

What it models (pdserve/engine/scheduler.py, pdserve/nodes/, router/core.py):
1. Router: a request is sent at its arrival to the least loaded prefill node and decode node (fewest requests
   assigned; ties to the one listed first, as the router's are; its second key, KV blocks used, is not
   modelled). A request counts on its prefill node until the decode node's first token reaches the router, on
   its decode node until it ends. A node sends one message a step with a token for each request that made one;
   the router's one event loop serves them FIFO, each taking `router_s_per_message` + `router_s_per_token` a
   token of its CPU; on one host (5.), the load generator's `client_s_per_token` a token too. With
   `router_workers` W > 1, requests go to the workers in turn, each worker an event loop (a process) of its own;
   a node's step sends one message to each worker with a token in it, each paying the cost per message. The
   pick stays the global least-loaded one (the workers share the nodes' load through their heartbeats).
2. A node's loop: drain the messages that came in, run one step, then its chores; while it has no work it
   waits for a message. Messages that arrive during a step wait for the step's end.
3. Prefill step: running requests first, then waiting ones FCFS, each as many prompt tokens as the token budget
   (`max_num_batched_tokens`) leaves, at most `max_num_seqs` running. A request whose prompt completes samples
   its first token (streamed to the router at the step's end) and offers its KV to its decode node.
4. Decode node: an offer is drained before a step, its blocks are reserved in the chores after that step, and
   the pull goes to the prefill node, which sends the KV when it next drains; the KV takes `transfer_s` over the
   pair's link (one transfer at a time per link), and is landed when the decode node next drains, joining the
   batch in that iteration (at most `max_num_seqs` running, FCFS). Each decode step makes one token per request.

5. Cores (`Topology.cores`, for a run on one CPU host; empty: every node has a device to itself): a step is
   work in seconds of a core to itself. It progresses at 1/k of a core while k nodes pinned to its core step,
   and `corun_slowdown_<role>` times slower while a node on another core steps too (bench/costs.py measures
   that slowdown: the cores of one host share caches and memory bandwidth). How k nodes on one core share it
   (`Topology.core_sharing`): "fair", processor sharing, each 1/k; or "wakeup", the fluid form of Linux CFS
   (before 6.6): each node's virtual runtime grows with the CPU it gets, the core goes to the stepping nodes
   with the least (ties share it), and a node that starts a step after waiting is placed at most
   `sleeper_credit_s` behind the least virtual runtime on its core, so it runs alone until it catches up.
   The router and the load generator are not pinned: their CPU for a token event runs on an idle core if there
   is one, else split evenly over the cores with the fewest nodes stepping, sharing them as a node would.

6. A node's loop outside its steps (`decode_iteration_s`: messages, emitting tokens, chores;
   `prefill_iteration_s`: first tokens, KV offers and their checksums, chores) runs after each step, before the
   next iteration, as work on the node's core that is shared like a step's (a calibration run on a core of its
   own measures it: the nodes report busy_time_s - step_time_s). A KV pull that reaches a prefill node meanwhile
   is served before its next step. (The real prefill node sends its offers during that time, each after its
   checksum, and reads pulls at its end; the model sends them all at the step's end.)

Not modelled: KV pool capacity and preemption (pools are assumed large enough), the nodes' CPU for packing and
unpacking KV (the link time stands for it), the router's HTTP work per request apart from its CPU per token (its
whole CPU is counted per token), the order in which a burst's requests reach the prefill node (all at once here;
the real first step may start with the first request alone), and other processes on the host.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.costs import Costs, _least_squares
from bench.metrics import SLO, RequestRecord, distribution, summarize
from bench.workloads import WORKLOADS, BenchRequest, Workload, make_workload

CORE_SHARING = ("fair", "wakeup")
# CFS's GENTLE_FAIR_SLEEPERS: half of sched_latency, 6 ms x (1 + log2 of the CPUs, here 2)
CFS_SLEEPER_CREDIT_S = 0.006
TIE_S = 1e-12  # virtual runtimes this close count as equal


@dataclass(frozen=True)
class Topology:
    num_prefill: int = 1
    num_decode: int = 1
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    cores: tuple[int, ...] = ()  # the core of each node, prefill nodes first; (): each node has its own device
    core_sharing: str = "fair"  # one of CORE_SHARING (see 5. above)
    sleeper_credit_s: float = CFS_SLEEPER_CREDIT_S  # core_sharing "wakeup": a waking node's most head start
    host_cores: int = 0  # with cores: how many the host has (0: as many as the nodes are pinned to)
    router_workers: int = 1  # router processes (see 1. above)

    def __post_init__(self) -> None:
        if (
            min(self.num_prefill, self.num_decode, self.max_num_seqs, self.max_num_batched_tokens, self.router_workers)
            < 1
        ):
            raise ValueError(
                "node counts, router workers, --max-num-seqs and --max-num-batched-tokens must be at least 1"
            )
        if self.cores and len(self.cores) != self.num_prefill + self.num_decode:
            raise ValueError("give one core per node, prefill nodes first, or none")
        if self.core_sharing not in CORE_SHARING:
            raise ValueError(f"core sharing must be one of {', '.join(CORE_SHARING)}")
        if not self.sleeper_credit_s >= 0:
            raise ValueError("the sleeper credit must be at least 0 s")


@dataclass(eq=False)
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    computed: int = 0  # tokens whose KV is computed (prompt, then outputs)
    outputs: int = 0  # tokens sampled
    prefill: PrefillNode | None = None
    decode: DecodeNode | None = None
    worker: int = 0  # the router worker that dispatched it, which its tokens go to
    token_times: list[float] = field(default_factory=list)  # at the client, after the router

    @property
    def context(self) -> int:
        return self.prompt_len + self.outputs


class Clock:
    """The event queue: (time, order, action), run in time order; ties in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._order), action))

    def run(self) -> None:
        while self._heap:
            self.now, _, action = heapq.heappop(self._heap)
            action()


@dataclass(eq=False)
class _Unpinned:
    """A share of an unpinned process's work, on `core` (see Cores.run_unpinned)."""

    core: int


@dataclass(eq=False)
class _Work:
    remaining: float  # seconds of a core to itself
    done: Callable[[], None]
    rate: float = 1.0  # of work done per second
    share: float = 1.0  # of its core's CPU
    version: int = 0  # of its last scheduled end: an end scheduled before is stale


class Cores:
    """Where the nodes' steps and loops, the router and the load generator run (see 5. above): with no cores
    given, each node has a device of its own and its work takes its cost."""

    def __init__(self, clock: Clock, costs: Costs, topo: Topology) -> None:
        self.clock, self.costs, self.topo = clock, costs, topo
        self.shared, self.wakeup = bool(topo.cores), topo.core_sharing == "wakeup"
        self.host = range(max(topo.host_cores, max(topo.cores, default=-1) + 1))  # the host's cores
        self.running: dict[Node | _Unpinned, _Work] = {}
        self.vruntime: dict[Node | _Unpinned, float] = {}  # CPU seconds each node got (core_sharing "wakeup")
        self.floor: dict[int, float] = {}  # each core's least virtual runtime so far (CFS's min_vruntime)
        self.updated, self.epoch = 0.0, 0

    def run(self, node: Node | _Unpinned, work: float, done: Callable[[], None]) -> None:
        if not self.shared:
            self.clock.at(self.clock.now + work, done)
            return
        self._advance()
        if self.wakeup:
            floor = self.floor.get(node.core, 0.0) - self.topo.sleeper_credit_s
            self.vruntime[node] = max(self.vruntime.get(node, 0.0), floor)
        self.running[node] = _Work(work, done)
        self._reschedule()

    def run_unpinned(self, work: float, done: Callable[[], None]) -> None:
        """`work` of a process no core is pinned for (the router, the load generator): on an idle core if there is
        one, else split evenly over the cores running the fewest tasks (the kernel moves it between them)."""
        busy = {c: sum(n.core == c for n in self.running) for c in self.host}
        least = [c for c, k in busy.items() if k == min(busy.values())]
        least = least[:1] if not busy[least[0]] else least
        left = [len(least)]

        def part_done() -> None:
            left[0] -= 1
            if not left[0]:
                done()

        for core in least:
            self.run(_Unpinned(core), work / len(least), part_done)

    def _advance(self) -> None:
        """Each running step's remaining work and virtual runtime, as of now, at the pace it had since the last
        change; each core's floor moves up to the least virtual runtime stepping on it."""
        elapsed = self.clock.now - self.updated
        for node, w in self.running.items():
            w.remaining -= elapsed * w.rate
            self.vruntime[node] = self.vruntime.get(node, 0.0) + elapsed * w.share
        for core, least in self._least().items():
            self.floor[core] = max(self.floor.get(core, 0.0), least)
        self.updated = self.clock.now

    def _least(self) -> dict[int, float]:
        """Each busy core's least virtual runtime among the nodes stepping on it."""
        least: dict[int, float] = {}
        for node in self.running:
            v = self.vruntime.get(node, 0.0)
            least[node.core] = min(least.get(node.core, v), v)
        return least

    def _shares(self) -> dict[Node | _Unpinned, float]:
        """Each stepping node's share of its core: 1/k of the k on it ("fair"), or 1/k of the k with the least
        virtual runtime and none for the rest ("wakeup")."""
        least = self._least()
        waits = {n: self.wakeup and self.vruntime.get(n, 0.0) > least[n.core] + TIE_S for n in self.running}
        counts = {c: sum(n.core == c and not waits[n] for n in self.running) for c in least}
        return {n: 0.0 if waits[n] else 1.0 / counts[n.core] for n in self.running}

    def _rate(self, node: Node | _Unpinned, share: float) -> float:
        beside = any(isinstance(n, Node) and n.core != node.core for n in self.running)  # (as bench.costs measures)
        costs = self.costs
        slowdown = {PrefillNode: costs.corun_slowdown_prefill, DecodeNode: costs.corun_slowdown_decode}
        return share / (slowdown.get(type(node), 1.0) if beside else 1.0)

    def _reschedule(self) -> None:
        self.epoch += 1
        for node, share in self._shares().items():
            w = self.running[node]
            w.share, w.rate, w.version = share, self._rate(node, share), w.version + 1
            if w.rate > 0:
                end = self.clock.now + max(0.0, w.remaining) / w.rate
                self.clock.at(end, lambda node=node, w=w, version=w.version: self._finish(node, w, version))
        if self.wakeup:
            self._schedule_catch_up()

    def _schedule_catch_up(self) -> None:
        """When the nodes sharing a core catch up with the next node waiting on it, which then joins them."""
        shares, least = self._shares(), self._least()
        for core in least:
            waiting = [self.vruntime[n] for n, sh in shares.items() if n.core == core and sh == 0.0]
            leaders = sum(n.core == core and sh > 0 for n, sh in shares.items())
            if waiting:
                at = self.clock.now + (min(waiting) - least[core]) * leaders
                self.clock.at(at, lambda epoch=self.epoch: self._catch_up(epoch))

    def _catch_up(self, epoch: int) -> None:
        if epoch == self.epoch:
            self._advance()
            self._reschedule()

    def _finish(self, node: Node | _Unpinned, w: _Work, version: int) -> None:
        if self.running.get(node) is not w or w.version != version:
            return  # rescheduled since, or a step before
        self._advance()
        del self.running[node]
        if isinstance(node, _Unpinned):
            self.vruntime.pop(node, None)
        self._reschedule()
        w.done()


class Router:
    """The router's event loops, one per worker, each a FIFO server of token events (see 1. and 5. above)."""

    def __init__(self, clock: Clock, costs: Costs, cores: Cores, workers: int = 1) -> None:
        self.clock, self.costs, self.cores = clock, costs, cores
        self.loops = [RouterLoop() for _ in range(workers)]
        self.prefill: list[PrefillNode] = []
        self.decode: list[DecodeNode] = []
        self._turn = itertools.count()

    @property
    def busy_s(self) -> float:
        """The CPU of every worker (their own, not the client's)."""
        return sum(loop.busy_s for loop in self.loops)

    def submit(self, req: SimRequest) -> None:
        req.worker = next(self._turn) % len(self.loops)
        req.prefill = min(self.prefill, key=lambda n: len(n.assigned))
        req.decode = min(self.decode, key=lambda n: len(n.assigned))
        req.prefill.assigned.add(req)
        req.decode.assigned.add(req)
        req.prefill.deliver(("generate", req))

    def tokens(self, reqs: list[SimRequest], from_decode: bool) -> None:
        """A node's step made one token for each of `reqs`: one message to each worker with a token in it reaches
        it now. A worker's loop takes the message, then hands its tokens out one by one: the client sees each once
        its share is served."""
        first = {}
        for req in reqs:
            first.setdefault(req.worker, req)
            if from_decode:
                req.prefill.assigned.discard(req)
            if req.outputs == req.output_len:
                req.prefill.assigned.discard(req)
                req.decode.assigned.discard(req)
            work = self.costs.router_s_per_token + (self.costs.router_s_per_message if first[req.worker] is req else 0)
            self.loops[req.worker].take(self, req, work)
        for w in first:
            if self.cores.shared and not self.loops[w].serving:
                self._serve(self.loops[w])

    def _serve(self, loop: RouterLoop) -> None:
        """A worker's next token: its CPU for it and the client's, on the host's cores."""
        loop.serving = bool(loop.queue)
        if loop.serving:
            req, work = loop.queue.popleft()
            self.cores.run_unpinned(work, lambda: self._served(loop, req))

    def _served(self, loop: RouterLoop, req: SimRequest) -> None:
        req.token_times.append(self.clock.now)
        self._serve(loop)


@dataclass(eq=False)
class RouterLoop:
    """One router worker's event loop."""

    free_at: float = 0.0  # its next free moment (no cores: each worker has a CPU of its own)
    queue: deque[tuple[SimRequest, float]] = field(default_factory=deque)  # on the host's cores: tokens not served
    busy_s: float = 0.0
    serving: bool = False

    def take(self, router: Router, req: SimRequest, work: float) -> None:
        self.busy_s += work
        if not router.cores.shared:
            self.free_at = max(router.clock.now, self.free_at) + work
            req.token_times.append(self.free_at)
        else:
            self.queue.append((req, work + router.costs.client_s_per_token))


class Node:
    """A node's loop: drain, step, chores. `step` returns the step's duration and what to do at its end."""

    def __init__(self, clock: Clock, costs: Costs, topo: Topology, router: Router, cores: Cores, core: int) -> None:
        self.clock, self.costs, self.topo, self.router = clock, costs, topo, router
        self.cores, self.core = cores, core
        self.inbox: deque[tuple[str, SimRequest]] = deque()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.assigned: set[SimRequest] = set()  # the router's view: requests it sent here, not yet gone
        self.asleep = True
        self.steps, self.step_time_s, self.busy_time_s = 0, 0.0, 0.0  # as the nodes count them

    def deliver(self, msg: tuple[str, SimRequest]) -> None:
        self.inbox.append(msg)
        if self.asleep:
            self.asleep = False
            self.clock.at(self.clock.now, self.iterate)

    def iterate(self) -> None:
        while self.inbox:
            self.handle(*self.inbox.popleft())
        duration, done = self.step()
        if duration is None:
            self.chores()
            self.asleep = not self.inbox
            if not self.asleep:
                self.clock.at(self.clock.now, self.iterate)
            return
        started = self.clock.now
        self.cores.run(self, duration, lambda: self._end_step(done, started))

    def _end_step(self, done: Callable[[], None], started: float) -> None:
        self.steps += 1
        self.step_time_s += self.clock.now - started  # wall time, as the nodes count it
        self.busy_time_s += self.clock.now - started
        loop_s = self.iteration_s()
        if loop_s:  # the loop's work after a step, on the node's core like the step's, from the step's end on
            begun = self.clock.now
            self.cores.run(self, loop_s, lambda: self._end_loop(begun))
        done()
        self.chores()
        if not loop_s:
            self.iterate()

    def _end_loop(self, started: float) -> None:
        self.busy_time_s += self.clock.now - started
        self.iterate()

    def iteration_s(self) -> float:
        """The loop's time per iteration outside the step: seconds of its core, shared as a step's are."""
        return 0.0

    def handle(self, kind: str, req: SimRequest) -> None:
        raise NotImplementedError

    def step(self) -> tuple[float | None, Callable[[], None]]:
        raise NotImplementedError

    def chores(self) -> None:
        pass


class PrefillNode(Node):
    def iteration_s(self) -> float:
        return self.costs.prefill_iteration_s

    def handle(self, kind: str, req: SimRequest) -> None:
        if kind == "generate":
            self.waiting.append(req)
        else:  # "pull": send the KV over the pair's link
            req.decode.receive_kv(req)

    def _schedule(self) -> list[tuple[SimRequest, int]]:
        """(request, new tokens) of one iteration: running first, then waiting FCFS, within the budgets."""
        chunks, budget = [], self.topo.max_num_batched_tokens
        for req in self.running:
            n = min(req.prompt_len - req.computed, budget)
            if n:
                chunks.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.topo.max_num_seqs:
            req = self.waiting.popleft()
            self.running.append(req)
            n = min(req.prompt_len, budget)
            chunks.append((req, n))
            budget -= n
        return chunks

    def step(self) -> tuple[float | None, Callable[[], None]]:
        chunks = self._schedule()
        if not chunks:
            return None, lambda: None
        cost = self.costs.prefill_step_s([(n, req.computed) for req, n in chunks])
        return cost, lambda: self._advance(chunks)

    def _advance(self, chunks: list[tuple[SimRequest, int]]) -> None:
        first = []
        for req, n in chunks:
            req.computed += n
            if req.computed == req.prompt_len:
                self.running.remove(req)
                req.outputs = 1
                first.append(req)
                if req.output_len > 1:
                    req.decode.deliver(("offer", req))
        self.router.tokens(first, from_decode=False)


class DecodeNode(Node):
    def __init__(self, clock: Clock, costs: Costs, topo: Topology, router: Router, cores: Cores, core: int) -> None:
        super().__init__(clock, costs, topo, router, cores, core)
        self.offers: deque[SimRequest] = deque()
        self.links: dict[PrefillNode, float] = {}  # each prefill peer's link: free from this time on

    def handle(self, kind: str, req: SimRequest) -> None:
        if kind == "offer":
            self.offers.append(req)
        else:  # "kv": landed, joins the queue with its prompt computed
            req.computed = req.prompt_len
            self.waiting.append(req)

    def chores(self) -> None:
        while self.offers:  # blocks reserved (room assumed), pulls sent
            req = self.offers.popleft()
            req.prefill.deliver(("pull", req))

    def iteration_s(self) -> float:
        return self.costs.decode_iteration_s

    def receive_kv(self, req: SimRequest) -> None:
        """The prefill node sends `req`'s KV now; it reaches this node after the link's queue and its time."""
        start = max(self.clock.now, self.links.get(req.prefill, 0.0))
        self.links[req.prefill] = end = start + self.costs.transfer_s(req.prompt_len)
        self.clock.at(end, lambda: self.deliver(("kv", req)))

    def step(self) -> tuple[float | None, Callable[[], None]]:
        while self.waiting and len(self.running) < self.topo.max_num_seqs:
            self.running.append(self.waiting.popleft())
        if not self.running:
            return None, lambda: None
        batch = list(self.running)
        cost = self.costs.decode_step_s(len(batch), sum(r.context for r in batch))
        return cost, lambda: self._advance(batch)

    def _advance(self, batch: list[SimRequest]) -> None:
        for req in batch:
            req.computed += 1
            req.outputs += 1
            if req.outputs == req.output_len:
                self.running.remove(req)
        self.router.tokens(batch, from_decode=True)


# ---- running a workload ----------------------------------------------------------------------------


def simulate(workload: Workload, costs: Costs, topo: Topology, counters: dict | None = None) -> list[RequestRecord]:
    """Every request of `workload` through the simulated deployment; times in seconds from its start. `counters`,
    if given, gets each role's steps and step time summed over its nodes (as bench records the real nodes')."""
    clock = Clock()
    cores = Cores(clock, costs, topo)
    router = Router(clock, costs, cores, topo.router_workers)
    core = list(topo.cores) or list(range(topo.num_prefill + topo.num_decode))
    router.prefill = [PrefillNode(clock, costs, topo, router, cores, core.pop(0)) for _ in range(topo.num_prefill)]
    router.decode = [DecodeNode(clock, costs, topo, router, cores, core.pop(0)) for _ in range(topo.num_decode)]
    reqs = [SimRequest(i, r.arrival_s, len(r.prompt_token_ids), r.output_len) for i, r in enumerate(workload.requests)]
    for req in reqs:
        clock.at(req.arrival, lambda req=req: router.submit(req))
    clock.run()
    if counters is not None:
        for role, nodes in (("prefill", router.prefill), ("decode", router.decode)):
            counters[role] = {
                "steps": sum(n.steps for n in nodes),
                "step_time_s": sum(n.step_time_s for n in nodes),
                "busy_time_s": sum(n.busy_time_s for n in nodes),
            }
        counters["router"] = {"busy_s": router.busy_s, "worker_busy_s": [loop.busy_s for loop in router.loops]}
    return [RequestRecord(r.arrival, r.output_len, r.prompt_len, r.token_times) for r in reqs]


def predict(workload: Workload, costs: Costs, topo: Topology, slo: SLO) -> dict:
    """bench's summary (bench/metrics.py) of the simulated run, plus the router's busy share."""
    counters: dict = {}
    summary = summarize(simulate(workload, costs, topo, counters), 0.0, slo)
    summary["router_busy_share"] = counters["router"]["busy_s"] / summary["wall_s"] if summary["wall_s"] else 0.0
    return summary


# ---- validation against a bench run ----------------------------------------------------------------

COMPARED = (
    ("output tok/s", "output_throughput", None),
    ("TTFT p50", "ttft_s", "p50"),
    ("TTFT p99", "ttft_s", "p99"),
    ("TPOT p50", "tpot_s", "p50"),
    ("TPOT p99", "tpot_s", "p99"),
    ("hand-off p50", "handoff_s", "p50"),
    ("decode ITL p50", "decode_itl_s", "p50"),
    ("prefill mean step", "prefill_step", None),
    ("decode mean step", "decode_step", None),
    ("prefill outside steps", "prefill_outside", None),
    ("decode outside steps", "decode_outside", None),
)


CALIBRATION_ROUNDS = 3
ROLES = ("prefill", "decode")


def stages(token_times: list[list[float]]) -> dict:
    """A request's timeline in two stages after its first token: the hand-off (first token, from the prefill node,
    to the second, from the decode node: KV pull, transfer, admission, one step) and its decode inter-token
    latency (the mean interval after the second token); each's distribution over the requests."""
    handoff = [t[1] - t[0] for t in token_times if len(t) > 1]
    itl = [(t[-1] - t[1]) / (len(t) - 2) for t in token_times if len(t) > 2]
    return {"handoff_s": distribution(handoff), "decode_itl_s": distribution(itl)}


def _flag(args: list[str], name: str, default: int) -> int:
    return int(args[args.index(name) + 1]) if name in args else default


def bench_topology(config: dict, cpu_count: int) -> Topology:
    """The deployment of a run_bench JSON's disagg stack (its --engine-arg flags), its nodes on the cores
    `pdserve up` pins them to: node i (prefill nodes first) on core i mod the host's cores."""
    args = list(config.get("engine_args", ()))
    p, d = _flag(args, "--num-prefill", 1), _flag(args, "--num-decode", 1)
    cores = () if "--no-pin" in args else tuple(i % cpu_count for i in range(p + d))
    return Topology(p, d, config["max_batch"], config["max_num_batched_tokens"], cores, host_cores=cpu_count)


def _mean_step(counters: dict, role: str) -> float | None:
    c = counters.get(role, {})
    return c["step_time_s"] / c["steps"] if c.get("steps") else None


def _outside_steps(counters: dict, role: str) -> float | None:
    """A `role` node's mean time per iteration outside its step, from its counters (None if not reported)."""
    c = counters.get(role, {})
    return (c["busy_time_s"] - c["step_time_s"]) / c["steps"] if c.get("steps") and "busy_time_s" in c else None


def _ratio(measured: float | None, simulated: float | None) -> float:
    return measured / simulated if measured and simulated else 1.0


def _stat(summary: dict, key: str, stat: str | None) -> float | None:
    value = summary.get(key)
    return value if stat is None or value is None else value[stat]


def scaled(costs: Costs, prefill: float, decode: float) -> Costs:
    """`costs` with every prefill term times `prefill` and every decode term times `decode`."""
    return replace(
        costs,
        prefill_base_s=costs.prefill_base_s * prefill,
        prefill_per_token_s=costs.prefill_per_token_s * prefill,
        prefill_per_token_ctx_s=costs.prefill_per_token_ctx_s * prefill,
        decode_base_s=costs.decode_base_s * decode,
        decode_per_seq_s=costs.decode_per_seq_s * decode,
        decode_per_ctx_token_s=costs.decode_per_ctx_token_s * decode,
    )


def _simulated(res: dict, costs: Costs, topo: Topology, slo: SLO) -> dict:
    """bench's summary of `res`'s very requests (send times, lengths) simulated, with mean steps per role."""
    reqs = tuple(
        BenchRequest(tuple(range(r["prompt_len"])), r["expected_output_len"], r["send_s"]) for r in res["records"]
    )
    counts: dict = {}
    records = simulate(Workload(res["workload"], reqs), costs, topo, counts)
    summary = {**summarize(records, 0.0, slo), **stages([r.token_times for r in records])}
    return {**summary, **_per_role(counts)}


def _per_role(counters: dict) -> dict:
    """Each role's mean step and mean time outside its steps, from (summed) node counters."""
    steps = {f"{role}_step": _mean_step(counters, role) for role in ROLES}
    return {**steps, **{f"{role}_outside": _outside_steps(counters, role) for role in ROLES}}


def _fitted(res: dict, base: Costs, topo: Topology, slo: SLO, measured: dict, steps: bool = True) -> tuple[Costs, dict]:
    """`base` with each role's step costs (if `steps`) and its loop time outside the steps (where the nodes reported
    it) scaled until `res` simulated gives the means `measured`: nodes beside each other slow each other, so the
    scales are refined CALIBRATION_ROUNDS times. The costs, and the scales."""
    # the scales start from the costs' own loop time, else the one measured
    outside = {
        r: getattr(base, f"{r}_iteration_s") or measured[f"{r}_outside"]
        for r in ROLES
        if measured[f"{r}_outside"] is not None
    }
    factor = {f"{r}_{what}": 1.0 for r in ROLES for what in ("step", "outside")}

    def costs() -> Costs:
        c = scaled(base, factor["prefill_step"], factor["decode_step"])
        return replace(c, **{f"{r}_iteration_s": max(0.0, s) * factor[f"{r}_outside"] for r, s in outside.items()})

    for _ in range(CALIBRATION_ROUNDS):
        cal = _simulated(res, costs(), topo, slo)
        factor = {
            k: f * _ratio(measured[k], cal[k]) if steps or k.endswith("outside") else f for k, f in factor.items()
        }
    return costs(), factor


def _measured(res: dict) -> dict:
    """A run_bench result's summary, stages and per-role means, as `_simulated` gives them."""
    counters = res.get("node_counters") or {}
    return {**res["summary"], **stages([r["token_s"] for r in res["records"]]), **_per_role(counters)}


def calibrated_costs(
    costs: Costs,
    run: dict,
    on_cores: bool = True,
    steps: bool = True,
    core_sharing: str = "fair",
    sleeper_credit_s: float = CFS_SLEEPER_CREDIT_S,
) -> Costs:
    """`costs` completed from a calibration run (a run_bench JSON with a disagg result, not one of the runs
    validated; run it with each node on a core of its own, 1P1D on 2 cores) with what an in-process measurement
    cannot see: the router's and the load generator's CPU per token, each role's loop time outside its steps, and
    (if `steps`) each role's step cost level in the stack, all fitted so that the run simulated (on the host's cores
    unless not `on_cores`, shared as `core_sharing` says) gives the means its nodes reported."""
    res = next(iter(_disagg_results(run)), None)
    if res is None:
        raise ValueError("the calibration run has no successful disagg result")
    measured = _measured(res)
    if any(measured[f"{r}_outside"] is None for r in ROLES):
        raise ValueError("the calibration run's nodes did not report busy_time_s")
    topo = _run_topology(run, on_cores, core_sharing, sleeper_credit_s)
    slo = SLO(run["config"]["slo_ttft_s"], run["config"]["slo_tpot_s"])
    base = replace(costs, **_host_cpu(res), decode_iteration_s=0.0, prefill_iteration_s=0.0)
    return _fitted(res, base, topo, slo, measured, steps)[0]


def _disagg_results(run: dict) -> list[dict]:
    """A run_bench JSON's successful disagg results."""
    return [r for r in run["results"] if r["system"] == "disagg" and r["ok"]]


def _run_topology(run: dict, on_cores: bool, core_sharing: str, sleeper_credit_s: float) -> Topology:
    """A run_bench JSON's deployment, its nodes on the host's cores unless not `on_cores` (then each on a device
    of its own), shared as `core_sharing` says."""
    topo = replace(
        bench_topology(run["config"], run["environment"]["cpu_count"]),
        core_sharing=core_sharing,
        sleeper_credit_s=sleeper_credit_s,
    )
    return topo if on_cores else replace(topo, cores=())


def _host_cpu(res: dict) -> dict:
    """The router's and the load generator's CPU per token measured in a run_bench result, as `Costs` fields."""
    return {f"{who}_s_per_token": (res.get(f"{who}_cpu_us_per_token") or 0.0) / 1e6 for who in ("router", "client")}


def validate(
    run: dict,
    costs: Costs,
    on_cores: bool = True,
    predict_with: Costs | None = None,
    core_sharing: str = "fair",
    sleeper_credit_s: float = CFS_SLEEPER_CREDIT_S,
) -> list[dict]:
    """Each disagg result of a run_bench JSON beside the simulation of its very requests: (metric, predicted,
    measured, error) rows. The prediction takes `predict_with` (`calibrated_costs` from a separate run) if given,
    else `costs` with the router's and load generator's CPU per token measured in the run. The `calibrated` column
    reruns the simulation with the run's CPU per token and each role's step costs and time outside its steps
    scaled so that their means equal the ones the nodes reported in the stack (the CPU they really got on shared
    cores): it checks the model's queueing and hand-offs apart from the cost level.
    `core_sharing`, `sleeper_credit_s`: how nodes on one core share it (see 5. above)."""
    rows, topo = [], _run_topology(run, on_cores, core_sharing, sleeper_credit_s)
    slo = SLO(run["config"]["slo_ttft_s"], run["config"]["slo_tpot_s"])
    for res in _disagg_results(run):
        host = _host_cpu(res)
        base = replace(costs, **host)
        measured = _measured(res)
        sim = _simulated(res, predict_with or base, topo, slo)
        fitted, factor = _fitted(res, base, topo, slo, measured)
        cal = _simulated(res, fitted, topo, slo)
        for label, key, stat in COMPARED:
            pred, meas, calib = _stat(sim, key, stat), _stat(measured, key, stat), _stat(cal, key, stat)
            if pred is None or not meas or calib is None:
                continue
            rows.append(
                {
                    "workload": res["label"],
                    "metric": label,
                    "predicted": pred,
                    "measured": meas,
                    "error": pred / meas - 1,
                    "calibrated": calib,
                    "calibrated_error": calib / meas - 1,
                    "router_us_per_token": host["router_s_per_token"] * 1e6,
                    "cost_factors": factor,
                }
            )
    return rows


def router_costs(runs: list[dict]) -> tuple[float, float, list[dict]]:
    """The router's CPU split into a cost per message from a node and one per token, fitted (least squares, not
    negative) over the disagg results of run_bench JSONs: CPU = a * messages + b * tokens, a message being a node
    step (bench records the nodes' steps per role). (a, b, each result's CPU measured and fitted)."""
    res = [r for run in runs for r in _disagg_results(run) if r.get("router_cpu_s")]
    steps = [sum(c.get("steps", 0.0) for c in (r.get("node_counters") or {}).values()) for r in res]
    tokens = [r["summary"]["total_output_tokens"] for r in res]
    if len(res) < 2 or not all(steps):
        raise ValueError("fitting the router's costs needs two or more disagg results with node counters")
    a, b = _least_squares([[m, t] for m, t in zip(steps, tokens, strict=True)], [r["router_cpu_s"] for r in res])
    fits = [
        {"label": r["label"], "messages": m, "tokens": t, "cpu_s": r["router_cpu_s"], "fitted_s": a * m + b * t}
        for r, m, t in zip(res, steps, tokens, strict=True)
    ]
    return a, b, fits


def _fmt(metric: str, value: float) -> str:
    return f"{value:.1f}" if metric.startswith("output") else f"{value * 1e3:.0f} ms"


def validation_markdown(runs: list[tuple[str, dict, list[dict]]]) -> str:
    """One table: per run (name, run_bench JSON, `validate` rows) and metric, predicted vs measured."""
    lines = [
        "| run | load 1-min (start→end) | metric | predicted | measured | error | calibrated | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run, rows in runs:
        env = run["environment"]
        load = f"{env['loadavg_at_start'][0]:.1f}→{env['loadavg_at_end'][0]:.1f}"
        for r in rows:
            m, err, cal_err = r["metric"], r["error"], r["calibrated_error"]
            lines.append(
                f"| {name} | {load} | {m} | {_fmt(m, r['predicted'])} | {_fmt(m, r['measured'])} | "
                f"{err:+.0%} | {_fmt(m, r['calibrated'])} | {cal_err:+.0%} |"
            )
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", type=Path, default=Path(__file__).parent / "results" / "costs-small.json")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--workload", default="sharegpt_like", choices=WORKLOADS)
    p.add_argument("--rate", type=float, default=None, help="Poisson requests/s (default: closed, all at t=0)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=8192, help="the model's (small: 8192)")
    p.add_argument("--max-model-len", type=int, default=2048, help="the model's (small: 2048)")
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.2)
    p.add_argument("--validate", type=Path, nargs="*", default=[], help="run_bench JSONs: disagg runs vs simulation")
    p.add_argument("--json", action="store_true", help="with --validate: JSON rows instead of a Markdown table")
    p.add_argument(
        "--costs-beside",
        action="store_true",
        help="with --validate: each run X.json with the costs measured right before it, costs-X.json beside it",
    )
    p.add_argument(
        "--own-devices",
        action="store_true",
        help="with --validate: ignore the host's cores (each node "
        "on a device of its own, as the model was before it had cores)",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="with --validate: a separate run_bench JSON "
        "(1P1D) that completes the costs: router and load generator CPU per token, the nodes' time "
        "outside their steps, and the step cost level in the stack",
    )
    p.add_argument(
        "--no-step-calibration",
        action="store_true",
        help="with --calibration: keep the step costs as measured in-process",
    )
    p.add_argument(
        "--core-sharing",
        default="fair",
        choices=CORE_SHARING,
        help="how nodes pinned to one core share "
        "it: fair (each 1/k) or wakeup (CFS: a node that waited runs first, within a credit)",
    )
    p.add_argument(
        "--sleeper-credit-ms",
        type=float,
        default=CFS_SLEEPER_CREDIT_S * 1e3,
        help="with --core-sharing wakeup: the most head start a node that waited gets (CFS on 2 CPUs: 6)",
    )
    p.add_argument(
        "--fit-router",
        type=Path,
        nargs="*",
        default=[],
        help="run_bench JSONs: fit the router's CPU per message and per token over their disagg results",
    )
    p.add_argument(
        "--write-calibrated",
        type=Path,
        default=None,
        help="with --calibration: write --costs as that run completes them (a costs JSON for bench.sim_study) and stop",
    )
    a = p.parse_args(argv)
    if not a.sleeper_credit_ms >= 0:
        p.error("--sleeper-credit-ms must be at least 0")
    if a.write_calibrated and not a.calibration:
        p.error("--write-calibrated needs --calibration")
    if a.write_calibrated or a.fit_router or a.validate:
        try:
            return _offline(a)
        except ValueError as e:  # a run without what a fit needs (node counters, a disagg result), too few runs
            p.error(str(e))
    try:
        topo = Topology(
            a.prefill,
            a.decode,
            a.max_num_seqs,
            a.max_num_batched_tokens,
            core_sharing=a.core_sharing,
            sleeper_credit_s=a.sleeper_credit_ms / 1e3,
        )
        w = make_workload(a.workload, a.vocab_size, a.max_model_len, a.seed, a.rate, a.num_requests)
    except ValueError as e:
        print(f"bench.sim: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(predict(w, Costs.load(a.costs), topo, SLO(a.slo_ttft_s, a.slo_tpot_s)), indent=1))
    return 0


def _offline(a: argparse.Namespace) -> int:
    """--write-calibrated, --fit-router or --validate, from run_bench JSONs."""
    credit, on_cores, steps = a.sleeper_credit_ms / 1e3, not a.own_devices, not a.no_step_calibration
    cal_run = json.loads(a.calibration.read_text()) if a.calibration else None
    if a.write_calibrated:
        fitted = calibrated_costs(Costs.load(a.costs), cal_run, on_cores, steps, a.core_sharing, credit)
        a.write_calibrated.write_text(
            json.dumps({"costs": asdict(fitted), "from": [str(a.costs), str(a.calibration)]}, indent=1) + "\n"
        )
        return 0
    if a.fit_router:
        per_message, per_token, fits = router_costs([json.loads(f.read_text()) for f in a.fit_router])
        print(
            json.dumps(
                {"router_us_per_message": per_message * 1e6, "router_us_per_token": per_token * 1e6, "runs": fits},
                indent=1,
            )
        )
        return 0
    costs = {f: Costs.load(f.with_name(f"costs-{f.name}") if a.costs_beside else a.costs) for f in a.validate}
    distinct = set(costs.values()) if cal_run else set()  # one fit per costs file, not per run
    fitted = {c: calibrated_costs(c, cal_run, on_cores, steps, a.core_sharing, credit) for c in distinct}
    runs = []
    for f in a.validate:
        pred = fitted.get(costs[f])
        run = json.loads(f.read_text())
        runs.append((f.stem, run, validate(run, costs[f], on_cores, pred, a.core_sharing, credit)))
    print(json.dumps([r for *_, rows in runs for r in rows], indent=1) if a.json else validation_markdown(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
