"""Batches of prompts and `n`: one request becomes several engine requests, one per choice.

Choice `index` is numbered as OpenAI does: prompt `i`'s sample `j` is choice `i * n + j`. Each
choice is sampled independently: with a seed, sample 0 keeps the request's seed (so `n` = 1 and
choice 0 of `n` > 1 agree) and sample `j` draws from a seed mixed from (seed, j), so the choices
differ and a repeated request gives the same ones. Without a seed every choice is its own unseeded
request, random as usual.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")
_M64 = 0xFFFFFFFFFFFFFFFF


def derive_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample `sample` of a request seeded with `seed`: a SplitMix64 step, in [0, 2**63)."""
    if seed is None or sample == 0:
        return seed
    x = (seed + sample * 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return (x ^ (x >> 31)) >> 1


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Like asyncio.gather, but the first failure (or a cancellation) cancels the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
