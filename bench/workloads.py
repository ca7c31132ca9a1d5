"""The benchmark workloads (bench/README.md) as exact token-id requests from a fixed seed.

A request is (prompt token ids, output length, arrival offset). Prompt ids are uniform below
`vocab_size - 3` (the last three ids are the special tokens); the load generators enforce each
output length with `ignore_eos`. Arrival is closed (every request at t=0, as tinyorca measured) or
open (Poisson at a given rate, as DistServe measured). The same seed gives every system the same
requests, token for token.

- `equal_size`: 16 x (128 prompt, 128 output).
- `short_long_mix`: (32, 32) and (512, 128) alternating, 16 requests.
- `sharegpt_like`: lognormal prompt and output lengths (ShareGPT-shaped), 32 requests; its medians
  and sigmas are parameters (`shape_args`), e.g. the GPU benchmark's 256 requests of ~60k prompt and
  ~20.8k output tokens (bench/gpu.py).
- `long_prefill`: every 4th request a long prompt (1-2k tokens) with a short output, the rest chatty
  (short prompt, longer output), 24 requests; meant to be run open, as a steady stream.

`quick` shrinks every length by 8 and keeps 4 requests: a smoke test, not a measurement.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

NUM_SPECIAL_TOKENS = 3  # <|endoftext|>, <|im_start|>, <|im_end|> sit at the top of the vocabulary
QUICK_SCALE = 8
QUICK_NUM_REQUESTS = 4

Lengths = list[tuple[int, int]]  # (prompt_len, output_len) per request


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_s: float = 0.0  # offset from the start of the run


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]
    rate: float | None = None  # requests/s of a Poisson arrival; None: closed (all at t=0)

    @property
    def label(self) -> str:
        return self.name if self.rate is None else f"{self.name}@{self.rate:g}/s"

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)


# ---- lengths ---------------------------------------------------------------------------------------


def _equal_size(rng: np.random.Generator, n: int, max_len: int) -> Lengths:
    return [(128, 128)] * n


def _short_long_mix(rng: np.random.Generator, n: int, max_len: int) -> Lengths:
    return [(32, 32) if i % 2 == 0 else (512, 128) for i in range(n)]


def _sharegpt_like(
    rng: np.random.Generator,
    n: int,
    max_len: int,
    prompt_median: float = 128,
    prompt_sigma: float = 1.0,
    output_median: float = 96,
    output_sigma: float = 0.8,
) -> Lengths:
    """ShareGPT-shaped: lognormal prompt and output lengths, each capped to half the model."""
    if min(prompt_median, output_median) <= 0 or min(prompt_sigma, output_sigma) < 0:
        raise ValueError("sharegpt_like: the medians must be positive and the sigmas not negative")
    prompts = np.exp(rng.normal(np.log(prompt_median), prompt_sigma, n))
    outputs = np.exp(rng.normal(np.log(output_median), output_sigma, n))
    cap = max_len // 2
    return [(int(np.clip(p, 4, cap)), int(np.clip(o, 4, cap))) for p, o in zip(prompts, outputs, strict=True)]


def _long_prefill(rng: np.random.Generator, n: int, max_len: int) -> Lengths:
    """Every 4th request: a 1-2k prompt with 8-16 output tokens; the others: 32-128 prompt, 64-128 output."""
    lengths = []
    for i in range(n):
        if i % 4 == 3:
            out = int(rng.integers(8, 17))
            lengths.append((int(rng.integers(1024, min(2048, max_len - out) + 1)), out))
        else:
            lengths.append((int(rng.integers(32, 129)), int(rng.integers(64, 129))))
    return lengths


_SHAPES: dict[str, tuple[Callable[[np.random.Generator, int, int], Lengths], int]] = {
    "equal_size": (_equal_size, 16),
    "short_long_mix": (_short_long_mix, 16),
    "sharegpt_like": (_sharegpt_like, 32),
    "long_prefill": (_long_prefill, 24),
}
WORKLOADS = tuple(_SHAPES)


# ---- requests --------------------------------------------------------------------------------------


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Arrival offsets of a Poisson process at `rate` requests/s; the first request arrives at 0."""
    gaps = rng.exponential(1.0 / rate, max(0, n - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def _fit(lengths: Lengths, max_len: int, scale: int) -> Lengths:
    """Shrink by `scale` and keep prompt + output within the model length."""
    fitted = []
    for p, o in lengths:
        p, o = max(1, p // scale), max(1, o // scale)
        fitted.append((min(p, max_len - o), o))
    return fitted


def make_workload(
    name: str,
    vocab_size: int,
    max_model_len: int,
    seed: int = 0,
    rate: float | None = None,
    num_requests: int | None = None,
    quick: bool = False,
    shape_args: dict[str, float] | None = None,
) -> Workload:
    """The workload `name` for a model of `vocab_size` ids and `max_model_len` positions; `shape_args`
    go to its length generator (only `sharegpt_like` takes any)."""
    if name not in _SHAPES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if shape_args and name != "sharegpt_like":
        raise ValueError(f"workload {name!r} takes no shape arguments")
    if rate is not None and rate <= 0:
        raise ValueError("the arrival rate must be positive")
    shape, default_n = _SHAPES[name]
    n = num_requests or (QUICK_NUM_REQUESTS if quick else default_n)
    key = zlib.crc32(name.encode())
    rng = np.random.default_rng([seed, key, 0])
    lengths = _fit(shape(rng, n, max_model_len, **(shape_args or {})), max_model_len, QUICK_SCALE if quick else 1)
    high = vocab_size - NUM_SPECIAL_TOKENS
    arrivals = [0.0] * n if rate is None else poisson_arrivals(n, rate, np.random.default_rng([seed, key, 1]))
    requests = tuple(
        BenchRequest(tuple(rng.integers(0, high, p).tolist()), o, t)
        for (p, o), t in zip(lengths, arrivals, strict=True)
    )
    return Workload(name, requests, rate)


def fixed_lengths(name: str, vocab_size: int, n: int, prompt_len: int, output_len: int, seed: int = 0) -> Workload:
    """n requests of `prompt_len` prompt ids (uniform, as every workload's) and `output_len` output tokens, all sent
    at t=0."""
    if min(n, prompt_len, output_len) < 1:
        raise ValueError("a fixed-length workload needs at least one request, prompt token and output token")
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), 0])
    high = vocab_size - NUM_SPECIAL_TOKENS
    return Workload(
        name, tuple(BenchRequest(tuple(rng.integers(0, high, prompt_len).tolist()), output_len) for _ in range(n))
    )
