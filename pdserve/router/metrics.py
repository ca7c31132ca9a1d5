"""The router's Prometheus metrics: per-request histograms it observes itself, and the nodes' gauges and counters.

Names follow vLLM's `vllm:` families with a `pdserve:` prefix, so a dashboard ports with a rename. Every
time is measured on the router's clock, from the moment it dispatched the request:
- time to first token: dispatch -> first token event; end-to-end: dispatch -> last event;
- inter-token latency: between two token events of one request; time per output token: a request's
  (last token - first token) / (tokens - 1); decode time: first token -> last event;
- handoff (disaggregated only): the prefill node's first token -> the decode node's first token, i.e.
  KV transfer + admission into the decode batch + one decode step.
Queue and prefill times inside a node are not reported per request by the nodes yet, so they are absent.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

FAST = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
SLOW = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
NODE_GAUGES = {
    "num_running": "pdserve:num_requests_running",
    "num_waiting": "pdserve:num_requests_waiting",
    "kv_blocks_used": "pdserve:kv_blocks_used",
    "kv_blocks_free": "pdserve:kv_blocks_free",
    "num_held": "pdserve:node_requests_held",
}


class RouterMetrics:
    """One registry per router (no process-wide default registry), filled by RouterCore as events arrive."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token.", registry=r, buckets=FAST)
        self.itl = LoopHistogram(
            "pdserve:inter_token_latency_seconds",
            "Time between two token events of a request.",
            buckets=FAST,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve:request_time_per_output_token_seconds",
            "A request's mean time per output token after the first.",
            registry=r,
            buckets=FAST,
        )
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Dispatch to last token.", registry=r, buckets=SLOW)
        self.decode = Histogram(
            "pdserve:request_decode_time_seconds", "First token to last token.", registry=r, buckets=SLOW
        )
        self.handoff = Histogram(
            "pdserve:request_handoff_time_seconds",
            "Disaggregated: the prefill node's first token to the decode node's first token "
            "(KV transfer, admission, one decode step).",
            registry=r,
            buckets=FAST,
        )
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens dispatched.", registry=r)
        self.generation_tokens = LoopCounter("pdserve:generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter(
            "pdserve:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.requests = Counter("pdserve:requests", "Requests dispatched to the nodes.", registry=r)
        self.in_flight = Gauge("pdserve:num_requests_in_flight", "Requests the router has in flight.", registry=r)
        self.direct_http = LoopCounter(
            "pdserve:router_direct_http_requests",
            "Completion requests answered on the router's direct HTTP path (the others went through the ASGI app).",
            registry=r,
        )
        self._admission(r)

    def _admission(self, r: CollectorRegistry) -> None:
        """Admission control and node loss, as the router sees them."""
        self.waiting = Gauge(
            "pdserve:router_requests_waiting", "Requests admitted that have no first token yet.", registry=r
        )
        self.rejected = Counter(
            "pdserve:requests_rejected", "Requests refused (429) while too many waited.", registry=r
        )
        self.timed_out = Counter(
            "pdserve:requests_timed_out",
            "Requests failed (503) for no first token within --queue-timeout-s.",
            registry=r,
        )
        self.redispatched = Counter(
            "pdserve:requests_redispatched", "Requests dispatched again after losing a node.", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoopHistogram:
    """A histogram that only the event loop observes, so without prometheus_client's lock and checks per observation
    (the inter-token latency is observed once a token event); exposed as that client's Histogram is."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = [*buckets, math.inf]
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.created = time.time()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_all(self, values: list[float]) -> None:
        """observe(value) for each, in order (the same sum to the last bit), one call."""
        counts, bounds, total = self.counts, self.bounds, self.sum
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1
            total += value
        self.sum = total

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation)
        buckets = [(floatToGoString(b), n) for b, n in zip(self.bounds, itertools.accumulate(self.counts), strict=True)]
        family.add_metric([], buckets, self.sum)
        family.samples.append(Sample(f"{self.name}_created", {}, self.created))
        yield family


class LoopCounter:
    """A counter that only the event loop increments (tokens generated: once a token event), without a lock."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.value = 0
        self.created = time.time()
        registry.register(self)

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.value, created=self.created)


class NodeCollector:
    """The nodes' last Stats as gauges and counters labelled by role and address, read at scrape time."""

    def __init__(self, nodes: list) -> None:
        self.nodes = nodes  # RouterCore.nodes: role, addr, up, stats (a protocol.Stats or None), reports (a count)

    def collect(self) -> Iterator[Metric]:
        reporting = [n for n in self.nodes if n.stats is not None]
        for field_name, name in NODE_GAUGES.items():
            g = GaugeMetricFamily(name, f"{field_name} of each node", labels=["role", "node"])
            for n in reporting:
                g.add_metric([n.role, n.addr], getattr(n.stats, field_name))
            yield g
        for key in sorted({k for n in reporting for k in n.stats.counters}):
            name = "pdserve:num_preemptions" if key == "preemptions" else f"pdserve:node_{key}"
            c = CounterMetricFamily(name, f"{key} of each node since it started", labels=["role", "node"])
            for n in reporting:
                if key in n.stats.counters:
                    c.add_metric([n.role, n.addr], n.stats.counters[key])
            yield c
        yield from _histograms(reporting)
        yield _reports(reporting)
        yield GaugeMetricFamily("pdserve:nodes_up", "Nodes the router sees up.", value=sum(n.up for n in self.nodes))


def _histograms(nodes: list) -> Iterator[Metric]:
    """The nodes' histograms (Stats.histograms, e.g. the decode node's hand-off in parts) as Prometheus histograms,
    `pdserve:node_<name>_seconds` labelled by role and node."""
    for key in sorted({k for n in nodes for k in n.stats.histograms}):
        h = HistogramMetricFamily(f"pdserve:node_{key}_seconds", f"{key} on each node", labels=["role", "node"])
        for n in nodes:
            if key in n.stats.histograms:
                wire = n.stats.histograms[key]
                bounds = [*map(floatToGoString, wire["bounds"]), "+Inf"]
                cumulative = list(itertools.accumulate(wire["counts"]))
                h.add_metric([n.role, n.addr], list(zip(bounds, cumulative, strict=True)), wire["sum"])
        yield h


def _reports(nodes: list) -> Metric:
    """How many Stats each node sent the router: a reading taken after it grew is fresh."""
    c = CounterMetricFamily(
        "pdserve:stats_reports", "Stats reports (heartbeats) received from each node.", labels=["role", "node"]
    )
    for n in nodes:
        c.add_metric([n.role, n.addr], n.reports)
    return c


def merge_expositions(own: str, others: list[str]) -> str:
    """The Prometheus text of several router workers as one: each sample summed over the workers (requests, tokens,
    histogram buckets, requests in flight), except the nodes' own figures (labelled with the node, and nodes_up),
    which every worker hears alike and which are taken from `own`, and the times counters were created (the
    earliest). Families keep `own`'s order; a family or a sample only another worker has so far comes after."""
    heads: dict[str, list[str]] = {}  # family -> its # HELP and # TYPE lines
    samples: dict[str, dict[str, float]] = {}  # family -> sample (name and labels) -> value
    for text in (own, *others):
        family = ""
        for line in filter(None, text.splitlines()):
            if line.startswith("#"):
                family = line.split(" ", 3)[2]
                lines = heads.setdefault(family, [])
                samples.setdefault(family, {})
                lines += [] if line in lines else [line]
                continue
            key, _, value = line.rpartition(" ")
            values = samples.setdefault(family, {})
            if 'node="' in key or key.startswith("pdserve:nodes_up"):
                values.setdefault(key, float(value))
            elif family.endswith("_created"):  # when a counter started: the earliest worker's
                values[key] = min(values.get(key, math.inf), float(value))
            else:
                values[key] = values.get(key, 0.0) + float(value)
    out = [
        line
        for family in samples
        for line in (*heads.get(family, ()), *(f"{k} {v!r}" for k, v in samples[family].items()))
    ]
    return "\n".join(out) + "\n"


SHARE_INTERVAL_S = 1.0  # how often a router worker writes its metrics for the others


class SharedMetrics:
    """Writes a worker's metrics into the shared folder every SHARE_INTERVAL_S, for the other workers' /metrics."""

    def __init__(self, folder: str, index: int, metrics) -> None:
        self.path, self.metrics = Path(folder) / f"{index}.prom", metrics
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(self.metrics.render())
            os.replace(tmp, self.path)
            await asyncio.sleep(SHARE_INTERVAL_S)

    def close(self) -> None:
        self.task.cancel()


def read_others(folder: str, index: int) -> list[str]:
    """The metrics the other workers last wrote into the shared folder."""
    return [p.read_text() for p in sorted(Path(folder).glob("*.prom")) if p.stem != str(index)]
