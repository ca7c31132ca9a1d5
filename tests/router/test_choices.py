"""Fan-out helpers of the router, without a server: seeds per choice, all-or-nothing gather."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.choices import derive_seed, gather_all


def test_derive_seed():
    assert derive_seed(None, 3) is None and derive_seed(5, 0) == 5
    seeds = [derive_seed(5, j) for j in range(1, 17)] + [derive_seed(-5, 1), derive_seed(2**63 - 1, 1)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(5, 1) == derive_seed(5, 1) != derive_seed(6, 1)


def test_gather_all_cancels_the_others_on_a_failure():
    async def main():
        done = asyncio.Event()

        async def slow():
            try:
                await asyncio.Event().wait()
            finally:
                done.set()

        async def boom():
            await asyncio.sleep(0)
            raise KeyError("x")

        with pytest.raises(KeyError):
            await gather_all([slow(), boom()])
        return done.is_set()

    assert asyncio.run(main())
    assert asyncio.run(gather_all_values()) == [1, 2]


async def gather_all_values():
    async def value(v):
        return v

    return await gather_all([value(1), value(2)])
