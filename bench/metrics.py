"""Serving metrics from per-request records: TTFT, TPOT, ITL, E2E, throughput, SLO attainment, goodput.

Every load generator hands back one `RequestRecord` per request: when it was sent, and when each of
its output tokens arrived (all times `time.perf_counter()` seconds of the benchmark process). From
these:

- TTFT: first token - send. E2E: last token - send.
- TPOT: (last token - first token) / (tokens - 1), per request, for requests with >= 2 tokens.
- ITL: every gap between consecutive tokens, pooled over requests.
- throughput: finished requests and their output tokens over the run's wall time (run start to last token).
- router CPU per token: the router process's CPU time during the run over the tokens it streamed.
- SLO attainment: the share of all requests (failed ones count as misses) within both the TTFT and TPOT
  SLOs; goodput: those requests per second of wall time.

A system that does not stream (static batching) delivers every token at once: its TTFT is its E2E,
and it has no TPOT or ITL (reported as null); for the SLO only its TTFT counts, since after the first
token it makes the client wait for nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    send_time: float
    expected_output_len: int
    num_prompt_tokens: int
    token_times: list[float] = field(default_factory=list)  # arrival time of each output token
    output_token_ids: list[int] = field(default_factory=list)
    streamed: bool = True
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and len(self.token_times) == self.expected_output_len

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send_time

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.send_time

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        if not self.streamed or n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def itls(self) -> list[float]:
        return np.diff(self.token_times).tolist() if self.streamed else []

    def check_length(self) -> None:
        """Turn a short or long answer into an error: a benchmark must do exactly the work it claims."""
        if not self.error and len(self.token_times) != self.expected_output_len:
            self.error = f"got {len(self.token_times)} output tokens, expected {self.expected_output_len}"


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        return tpot is None or tpot <= self.tpot_s


def distribution(values: list[float]) -> dict[str, float] | None:
    """mean, p50, p90, p99 of `values` (None when there are none)."""
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _wall_time(records: list[RequestRecord], start: float) -> float:
    ends = [r.token_times[-1] for r in records if r.token_times]
    return max(ends) - start if ends else float("nan")


def summarize(records: list[RequestRecord], start: float, slo: SLO) -> dict:
    """Every metric of one (system, workload) run; `start` is the run's t=0 (the first arrival)."""
    ok = [r for r in records if r.ok]
    wall = _wall_time(ok, start)
    met = sum(slo.met_by(r) for r in records)
    out_tokens = sum(len(r.token_times) for r in ok)
    return {
        "num_requests": len(records),
        "num_failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall,
        "request_throughput": len(ok) / wall if ok else 0.0,
        "output_throughput": out_tokens / wall if ok else 0.0,
        "total_output_tokens": out_tokens,
        "ttft_s": distribution([r.ttft for r in ok]),
        "tpot_s": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": distribution([g for r in ok for g in r.itls]),
        "e2e_s": distribution([r.e2e for r in ok]),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "slo_attainment": met / len(records) if records else 0.0,
        "goodput_rps": met / wall if ok else 0.0,
        "streamed": all(r.streamed for r in records),
    }


def cpu_per_token_us(cpu_s: float | None, records: list[RequestRecord]) -> float | None:
    """A process's CPU microseconds per output token streamed in a run (every record's tokens)."""
    tokens = sum(len(r.token_times) for r in records)
    return None if cpu_s is None or not tokens else cpu_s / tokens * 1e6


def max_rate_within_slo(attainment_by_rate: dict[float, float], target: float = 0.9) -> float | None:
    """DistServe's goodput: the highest swept rate whose SLO attainment is at least `target`."""
    good = [rate for rate, att in attainment_by_rate.items() if att >= target]
    return max(good) if good else None
