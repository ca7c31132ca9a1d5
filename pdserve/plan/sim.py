"""A discrete-event simulator of a pdserve deployment: router, P prefill and D decode nodes and their KV links, or
N colocated nodes.

It plays what pdserve does, step by step, with each step's duration from a cost model measured on the real
engine (`python -m bench.costs`, pdserve/plan/costs.py), and hands back each request's token times (bench.sim
turns them into bench's `RequestRecord`s, so its metrics come from bench/metrics.py). Pure Python, deterministic:
the same requests give the same result.

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

7. Colocated node (`Topology.num_colocated` > 0: that many colocated nodes, no prefill or decode nodes): pdserve's
   scheduler in one step: running requests first, oldest first, each a decode token or its prompt's next chunk
   within the token budget, then waiting ones FCFS (at most `max_num_seqs` running). A step's time is
   `Costs.mixed_step_s` of its prompt chunks and decodes; the router sends each request to the colocated node with
   the fewest requests, where it stays until it ends. No hand-off, no link.

Not modelled: KV pool capacity and preemption (pools are assumed large enough), the nodes' CPU for packing and
unpacking KV (the link time stands for it), the router's HTTP work per request apart from its CPU per token (its
whole CPU is counted per token), the order in which a burst's requests reach the prefill node (all at once here;
the real first step may start with the first request alone), and other processes on the host.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.plan.costs import Costs

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
    num_colocated: int = 0  # > 0: that many colocated nodes instead of prefill and decode nodes (see 7. above)

    @property
    def num_nodes(self) -> int:
        return self.num_colocated or self.num_prefill + self.num_decode

    def __post_init__(self) -> None:
        if (
            min(self.num_prefill, self.num_decode, self.max_num_seqs, self.max_num_batched_tokens, self.router_workers)
            < 1
            or self.num_colocated < 0
        ):
            raise ValueError(
                "node counts, router workers, --max-num-seqs and --max-num-batched-tokens must be at least 1"
            )
        if self.cores and len(self.cores) != self.num_nodes:
            raise ValueError("give one core per node, prefill nodes first, or none")
        if self.core_sharing not in CORE_SHARING:
            raise ValueError(f"core sharing must be one of {', '.join(CORE_SHARING)}")
        if not self.sleeper_credit_s >= 0:
            raise ValueError("the sleeper credit must be at least 0 s")


class Arrival(NamedTuple):
    """A request of a workload: when it arrives (s from the start), its prompt's tokens, the tokens it asks for."""

    arrival: float
    prompt_len: int
    output_len: int


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
    colocated: ColocatedNode | None = None
    worker: int = 0  # the router worker that dispatched it, which its tokens go to
    token_times: list[float] = field(default_factory=list)  # at the client, after the router

    @property
    def context(self) -> int:
        return self.prompt_len + self.outputs

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float | None:
        """The mean time per output token after the first (None with one token)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


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
        slowdown[ColocatedNode] = max(costs.corun_slowdown_prefill, costs.corun_slowdown_decode)
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
        self.colocated: list[ColocatedNode] = []
        self._turn = itertools.count()

    @property
    def busy_s(self) -> float:
        """The CPU of every worker (their own, not the client's)."""
        return sum(loop.busy_s for loop in self.loops)

    def submit(self, req: SimRequest) -> None:
        req.worker = next(self._turn) % len(self.loops)
        if self.colocated:
            req.colocated = min(self.colocated, key=lambda n: len(n.assigned))
            req.colocated.assigned.add(req)
            req.colocated.deliver(("generate", req))
            return
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
            self._release(req, from_decode)
            work = self.costs.router_s_per_token + (self.costs.router_s_per_message if first[req.worker] is req else 0)
            self.loops[req.worker].take(self, req, work)
        for w in first:
            if self.cores.shared and not self.loops[w].serving:
                self._serve(self.loops[w])

    @staticmethod
    def _release(req: SimRequest, from_decode: bool) -> None:
        """A request stops counting on its prefill node at its decode node's first token, on every node at its end."""
        done = req.outputs == req.output_len
        if req.prefill and (from_decode or done):
            req.prefill.assigned.discard(req)
        for node in (req.decode, req.colocated):
            if node and done:
                node.assigned.discard(req)

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

    def _fcfs_chunks(self, wants: Callable[[SimRequest], int]) -> list[tuple[SimRequest, int]]:
        """(request, new tokens) of one iteration: each running request's `wants(req)` tokens first, then waiting
        requests' prompts FCFS, within the token budget and `max_num_seqs`."""
        chunks, budget = [], self.topo.max_num_batched_tokens
        for req in self.running:
            n = min(wants(req), budget)
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
        """(request, new tokens) of one iteration: running prompts' next chunks first, then waiting FCFS."""
        return self._fcfs_chunks(lambda req: req.prompt_len - req.computed)

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


class ColocatedNode(Node):
    """Prefill and decode in one step, as pdserve's colocated node runs them (see 7. above)."""

    def iteration_s(self) -> float:
        return self.costs.decode_iteration_s

    def handle(self, kind: str, req: SimRequest) -> None:
        self.waiting.append(req)  # "generate": the only message a colocated node gets here

    def _schedule(self) -> list[tuple[SimRequest, int]]:
        """(request, new tokens) of one iteration: running first (a decode token, or the prompt's next chunk), then
        waiting FCFS."""
        return self._fcfs_chunks(lambda req: max(1, req.prompt_len - req.computed))

    def step(self) -> tuple[float | None, Callable[[], None]]:
        chunks = self._schedule()
        if not chunks:
            return None, lambda: None
        prompts = [(n, req.computed) for req, n in chunks if req.computed < req.prompt_len]
        decodes = [req for req, _ in chunks if req.computed >= req.prompt_len]
        cost = self.costs.mixed_step_s(prompts, len(decodes), sum(r.context for r in decodes))
        return cost, lambda: self._advance(chunks)

    def _advance(self, chunks: list[tuple[SimRequest, int]]) -> None:
        made = []
        for req, n in chunks:
            req.computed += n
            if req.computed >= req.prompt_len:  # a prompt completed, or a decode: one token sampled
                req.outputs += 1
                made.append(req)
                if req.outputs == req.output_len:
                    self.running.remove(req)
        self.router.tokens(made, from_decode=True)


# ---- running a workload ----------------------------------------------------------------------------


def simulate(
    requests: Sequence[Arrival], costs: Costs, topo: Topology, counters: dict | None = None
) -> list[SimRequest]:
    """Every request through the simulated deployment; times in seconds from its start, in the order given.
    `counters`, if given, gets each role's steps and step time summed over its nodes (as bench records the real
    nodes')."""
    clock = Clock()
    cores = Cores(clock, costs, topo)
    router = Router(clock, costs, cores, topo.router_workers)
    core = list(topo.cores) or list(range(topo.num_nodes))

    def nodes(kind: type[Node], n: int) -> list:
        return [kind(clock, costs, topo, router, cores, core.pop(0)) for _ in range(n)]

    if topo.num_colocated:
        router.colocated = nodes(ColocatedNode, topo.num_colocated)
    else:
        router.prefill, router.decode = nodes(PrefillNode, topo.num_prefill), nodes(DecodeNode, topo.num_decode)
    reqs = [SimRequest(i, r.arrival, r.prompt_len, r.output_len) for i, r in enumerate(requests)]
    for req in reqs:
        clock.at(req.arrival, lambda req=req: router.submit(req))
    clock.run()
    if counters is not None:
        roles = (("prefill", router.prefill), ("decode", router.decode), ("colocated", router.colocated))
        for role, group in roles:
            if group:
                counters[role] = {
                    "steps": sum(n.steps for n in group),
                    "step_time_s": sum(n.step_time_s for n in group),
                    "busy_time_s": sum(n.busy_time_s for n in group),
                }
        counters["router"] = {"busy_s": router.busy_s, "worker_busy_s": [loop.busy_s for loop in router.loops]}
    return reqs
