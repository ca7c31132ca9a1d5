"""The simulator's cost model: a step's time from its shape, a KV hand-off's time from its tokens.

Fitted (least squares, coefficients not negative) by `python -m bench.costs` from steps of the real engine:

- prefill step: `t = a + b * tokens + c * tokens * (past + tokens / 2)` (the last term: attention over the chunk's
  context), over the step's chunks of (new tokens, past tokens);
- decode step of B requests whose lengths sum to C: `t = a + b * B + c * C`;
- a mixed step (a colocated node's: prompt chunks and decodes in one forward): the prefill terms of its chunks, the
  decode terms of its decodes, and the larger of the two fixed costs once;
- KV hand-off of n tokens: `t = latency + n * kv_bytes_per_token / link_bytes_per_s`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Costs:
    """The simulator's cost model, in seconds and bytes."""

    prefill_base_s: float
    prefill_per_token_s: float
    prefill_per_token_ctx_s: float  # x tokens x (past + tokens / 2)
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float  # x the batch's total context
    kv_bytes_per_token: int
    link_bytes_per_s: float
    link_latency_s: float = 0.0
    router_s_per_token: float = 0.0  # the router's CPU per streamed token (bench's router_cpu_us_per_token)
    corun_slowdown_prefill: float = 1.0  # a prefill step's time while another core computes, over its time alone
    corun_slowdown_decode: float = 1.0  # the same for a decode step
    decode_iteration_s: float = 0.0  # a decode node's time per iteration outside its step (its loop; a run's
    # nodes report it, busy_time_s - step_time_s)
    prefill_iteration_s: float = 0.0  # the same for a prefill node (offers and their checksums, chores); KV pulls
    # that arrive meanwhile are served before its next step
    client_s_per_token: float = 0.0  # the load generator's CPU per streamed token (bench's client_cpu_us_per_token):
    # on one host it takes a share of the nodes' cores, as the router does
    router_s_per_message: float = 0.0  # the router's CPU per message from a node (one a step), beside its CPU per
    # token (0: all of it counted per token, as bench measures it)

    def __post_init__(self) -> None:
        if self.link_bytes_per_s <= 0 or self.kv_bytes_per_token < 0:
            raise ValueError("the link bandwidth must be positive and the KV bytes per token not negative")
        if min(self.corun_slowdown_prefill, self.corun_slowdown_decode) < 1.0:
            raise ValueError("a co-run slowdown is a ratio of at least 1")

    def prefill_step_s(self, chunks: list[tuple[int, int]]) -> float:
        """One prefill iteration over `chunks` of (new tokens, past tokens), flattened into one forward."""
        return self.prefill_base_s + self._prefill_terms(chunks)

    def _prefill_terms(self, chunks: list[tuple[int, int]]) -> float:
        tokens = sum(n for n, _ in chunks)
        attention = sum(n * (past + n / 2) for n, past in chunks)
        return self.prefill_per_token_s * tokens + self.prefill_per_token_ctx_s * attention

    def decode_step_s(self, batch: int, context: int) -> float:
        """One decode iteration of `batch` requests whose lengths sum to `context`."""
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_ctx_token_s * context

    def mixed_step_s(self, chunks: list[tuple[int, int]], batch: int, context: int) -> float:
        """One colocated iteration: prompt `chunks` and `batch` decodes of total `context` in one forward."""
        if not chunks:
            return self.decode_step_s(batch, context)
        if not batch:
            return self.prefill_step_s(chunks)
        decode = self.decode_per_seq_s * batch + self.decode_per_ctx_token_s * context
        return max(self.prefill_base_s, self.decode_base_s) + self._prefill_terms(chunks) + decode

    def transfer_s(self, num_tokens: int) -> float:
        """One request's KV of `num_tokens` tokens over the link."""
        return self.link_latency_s + num_tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    @classmethod
    def load(cls, path: Path | str) -> Costs:
        """The costs of a cost JSON (`python -m bench.costs`): ValueError if it is not one."""
        try:
            return cls(**json.loads(Path(path).read_text())["costs"])
        except OSError as e:
            raise ValueError(f"cannot read the cost file {path}: {e.strerror}") from None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a cost file of python -m bench.costs ({type(e).__name__}: {e})") from None


def least_squares(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative where it can: a negative coefficient is dropped (set to 0) and the rest refitted."""
    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0] * a.shape[1]
            for i, c in zip(keep, coef, strict=True):
                out[i] = max(0.0, float(c))
            return out
        keep.pop(int(np.argmin(coef)))


def fit_link(handoff: list[dict], kv_bytes_per_token: int) -> tuple[float, float]:
    """(bytes/s, latency s) of a KV hand-off from samples of (tokens, seconds): `t = latency + tokens * bytes / bw`."""
    latency, per_token = least_squares([[1, s["tokens"]] for s in handoff], [s["s"] for s in handoff])
    span = max(x["tokens"] for x in handoff) * per_token  # what the tokens add at most, against the noise of a fit
    if not span > 1e-6 * max(x["s"] for x in handoff):
        raise ValueError("the hand-off samples do not grow with their tokens: no bandwidth to fit")
    return kv_bytes_per_token / per_token, latency


def fit(
    prefill: list[dict],
    decode: list[dict],
    kv_bytes_per_token: int,
    link_bytes_per_s: float,
    link_latency_s: float = 0.0,
    router_s_per_token: float = 0.0,
    corun: dict | None = None,
) -> Costs:
    """The costs of step samples: prefill (tokens, past, s), decode (batch, context, s)."""
    p = least_squares(
        [[1, s["tokens"], s["tokens"] * (s["past"] + s["tokens"] / 2)] for s in prefill], [s["s"] for s in prefill]
    )
    d = least_squares([[1, s["batch"], s["context"]] for s in decode], [s["s"] for s in decode])
    slow = {role: (corun or {}).get(role, {}).get("slowdown", 1.0) for role in ("prefill", "decode")}
    return Costs(
        *p,
        *d,
        kv_bytes_per_token,
        link_bytes_per_s,
        link_latency_s,
        router_s_per_token,
        slow["prefill"],
        slow["decode"],
    )
