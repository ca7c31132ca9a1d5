"""Prefix caching: the block names, the block manager's refcounts and LRU eviction, the scheduler's sharing, and
the engine's greedy tokens with forced cache hits (against transformers, the hits counted). Served end to end,
colocated and disaggregated (a decode node pulling only the KV it lacks, or prefilling the rest itself), it is
tested on the serving stacks of tests/stacks/test_serving.py."""

from __future__ import annotations

import random

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.request import Request, Status
from pdserve.engine.scheduler import Batch, Scheduler
from pdserve.kv.backend import InProcessBackend
from pdserve.kv.block_allocator import BlockAllocator
from pdserve.nodes.parts import build_engine
from pdserve.wire.params import SamplingParams, block_hashes, chain_seed
from tests.helpers import hf_greedy, take_tokens

SEED = chain_seed("test-model")


# ---- block names ------------------------------------------------------------------------------------
def test_block_names_chain_over_parent_and_tokens():
    tokens = list(range(100, 140))  # 2 full blocks of 16 and 8 tokens over
    names = block_hashes(tokens, 16, SEED)
    assert len(names) == 2 and names == block_hashes(tokens, 16, SEED)  # the partial block has no name
    assert block_hashes(tokens[16:32], 16, names[0]) == names[1:]  # extending a chain = hashing it whole
    changed = block_hashes([7, *tokens[1:]], 16, SEED)
    assert changed[0] != names[0] and changed[1] != names[1]  # an earlier token renames every later block
    assert block_hashes(tokens[16:32], 16, SEED) != names[1:]  # same tokens, another parent: another name
    assert block_hashes(tokens, 16, chain_seed("other-model")) != names  # another model: other names
    assert all(0 <= n < 2**64 for n in names)


# ---- the block manager ----------------------------------------------------------------------------
def cached_request(alloc: BlockAllocator, names: list[int]) -> list[int]:
    """Blocks for a request whose full blocks are computed and named `names`."""
    blocks: list[int] = []
    assert alloc.grow(blocks, len(names) * alloc.block_size)
    for b, h in zip(blocks, names, strict=True):
        assert alloc.commit(b, h)
    return blocks


def test_refcounts_share_a_block_until_its_last_holder_frees_it():
    alloc = BlockAllocator(8, 4)
    a = cached_request(alloc, [11, 12, 13])
    b = alloc.match([11, 12, 99])
    assert b == a[:2] and [alloc.refs(x) for x in a] == [2, 2, 1]
    assert alloc.num_used == 3
    alloc.free(list(a))
    assert [alloc.refs(x) for x in b] == [1, 1] and alloc.num_used == 2 and alloc.num_evictable == 1
    alloc.free(b)
    assert alloc.num_used == 0 and alloc.num_free == 8 and alloc.num_cached == 3 and alloc.num_evictable == 3
    assert not alloc.commit(5, 11)  # a name is cached once: the same KV in a second block stays private


def test_eviction_is_least_recently_released_first_and_a_requests_tail_first():
    alloc = BlockAllocator(6, 4)
    old = cached_request(alloc, [1, 2, 3])
    new = cached_request(alloc, [4, 5, 6])
    alloc.free(list(old))
    alloc.free(list(new))
    taken: list[int] = []
    assert alloc.grow(taken, 4)
    assert taken == [old[2]] and alloc.num_evicted == 1  # the older request's last block goes first
    assert alloc.cached_prefix([1, 2, 3]) == 2 and alloc.cached_prefix([4, 5, 6]) == 3
    assert alloc.match([4]) == [new[0]]  # touched: now the most recently used
    alloc.free([new[0]])
    assert alloc.grow(taken, 4 * 5)  # 4 more: every cached block but one
    assert alloc.cached_prefix([1, 2, 3]) == 0 and alloc.cached_prefix([4, 5, 6]) == 1  # the touched block is left
    assert alloc.num_cached == 1 and alloc.num_evicted == 5


def test_a_block_in_use_is_never_evicted():
    alloc = BlockAllocator(4, 4)
    held = cached_request(alloc, [1, 2])
    shared = alloc.match([1, 2])
    alloc.free(held)  # still held by the sharer
    other: list[int] = []
    assert alloc.grow(other, 8) and not set(other) & set(shared)
    assert not alloc.grow(other, 12)  # only blocks in use are left
    assert alloc.cached_prefix([1, 2]) == 2 and alloc.num_evicted == 0
    alloc.free(other)
    alloc.free(shared)
    assert alloc.num_free == 4 and alloc.num_used == 0


def test_pool_accounting_counts_evictable_blocks_as_free():
    alloc = BlockAllocator(10, 4)
    a = cached_request(alloc, [1, 2, 3, 4])
    assert alloc.num_used == 4 and alloc.num_free == 6
    alloc.free(a)
    assert alloc.num_used == 0 and alloc.num_free == 10 and alloc.num_evictable == 4
    big: list[int] = []
    assert alloc.grow(big, 40)  # every block, the cached ones evicted
    assert alloc.num_used == 10 and alloc.num_cached == 0 and alloc.num_evicted == 4
    alloc.free(big)
    assert alloc.num_free == 10


# ---- the scheduler ----------------------------------------------------------------------------------
def req(rid: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params))


def sched(blocks: int = 64, budget: int = 64, seed: int | None = SEED) -> Scheduler:
    return Scheduler(BlockAllocator(blocks, 4), 8, budget, seed)


def run_to_end(s: Scheduler, steps: int = 1000) -> None:
    """Iterations without a model, each sampled token 0, until every request has its tokens; then they finish."""
    for _ in range(steps):
        batch = s.schedule()
        if not batch:
            break
        sampled = [x.request for x in batch.scheduled if x.samples]
        s.advance(batch)
        take_tokens(s, sampled, [0] * len(sampled))
        for r in sampled:
            if len(r.output_token_ids) == r.params.max_tokens:
                s.finish(r, Status.FINISHED)
    assert not s.has_work()


def test_a_request_starts_after_its_longest_cached_prefix():
    s = sched()
    s.add(first := req("a", list(range(30))))
    run_to_end(s)
    s.add(second := req("b", list(range(22)) + [99, 98]))
    batch = s.schedule()
    assert second.num_computed_tokens == 20 and batch.scheduled[0].num_new_tokens == 4  # 5 blocks shared
    assert s.prefix_cache_queries == 30 + 24 and s.prefix_cache_hits == 20
    assert first.is_finished and s.allocator.num_used == len(second.block_ids)


def test_the_last_prompt_token_is_always_computed():
    s = sched()
    s.add(req("a", list(range(16))))
    run_to_end(s)
    s.add(again := req("b", list(range(16))))  # the same prompt, a whole number of blocks
    batch = s.schedule()
    assert again.num_computed_tokens == 12 and batch.scheduled[0].num_new_tokens == 4 and batch.scheduled[0].samples


def test_echo_with_logprobs_and_no_caching_bypass_the_cache():
    s = sched()
    s.add(req("a", list(range(30))))
    run_to_end(s)
    s.add(echo := req("e", list(range(30)), prompt_logprobs=1))
    s.schedule()
    assert echo.num_computed_tokens == 0 and s.prefix_cache_queries == 30
    off = sched(seed=None)
    off.add(req("a", list(range(30))))
    run_to_end(off)
    off.add(again := req("b", list(range(30))))
    off.schedule()
    assert again.num_computed_tokens == 0 and off.allocator.num_cached == 0 and off.prefix_cache_queries == 0


def test_a_blocked_head_gives_its_shared_blocks_back():
    s = sched(blocks=12, budget=64)
    s.add(req("a", list(range(24))))
    run_to_end(s)  # 6 blocks cached, evictable
    s.add(hog := req("hog", list(range(500, 524)), max_tokens=1))  # needs 7 blocks: 6 free, 1 evicted
    s.schedule()
    s.add(blocked := req("b", list(range(24)) + list(range(200, 220)), max_tokens=8))  # 13 blocks: never fits now
    s.schedule()
    assert blocked.status is Status.WAITING and not blocked.block_ids and blocked.num_computed_tokens == 0
    assert s.allocator.num_used == len(hog.block_ids)


def test_a_request_waits_for_the_prefix_a_running_request_computes():
    """Sent together, the second of two prompts with the same 40-token prefix waits a step instead of computing the
    prefix again (an unrelated request behind it goes ahead), then shares the first one's 10 blocks."""
    s = sched(budget=64)
    s.add(a := req("a", list(range(40)) + [1, 2]))
    s.add(b := req("b", list(range(40)) + [7, 8, 9]))
    s.add(c := req("c", list(range(1000, 1010))))
    batch = s.schedule()
    assert [x.request for x in batch.scheduled] == [a, c]
    assert b.status is Status.WAITING and not b.block_ids and s.prefix_cache_queries == 42 + 10
    s.advance(batch)
    batch = s.schedule()
    assert b in [x.request for x in batch.scheduled] and b.num_cached_blocks == 10 and b.num_computed_tokens == 40
    assert s.prefix_cache_hits == 40 and s.prefix_cache_queries == 42 + 10 + 43


def test_a_short_shared_prefix_or_a_holder_that_never_names_its_blocks_makes_nobody_wait():
    s = sched(budget=64)
    s.add(req("a", list(range(12)) + [1, 2]))  # 3 shared blocks: fewer than WAIT_FOR_PREFIX_BLOCKS
    s.add(b := req("b", list(range(12)) + [7, 8, 9]))
    assert b in [x.request for x in s.schedule().scheduled]
    s = sched(budget=128)
    s.add(req("echo", list(range(40)) + [1, 2], prompt_logprobs=1))  # bypasses the cache: its blocks stay unnamed
    s.add(b := req("b", list(range(40)) + [7, 8, 9]))
    assert b in [x.request for x in s.schedule().scheduled]


def test_the_wait_ends_when_the_holder_leaves_and_outlasts_its_preemption():
    """The waiting request is admitted (recomputing the prefix) as soon as the request computing it is aborted,
    whose blocks were never named. A preempted holder rejoins ahead of it and computes the prefix again: it still
    waits, and then shares."""
    s = sched(budget=64)
    s.add(a := req("a", list(range(40)) + [1, 2]))
    s.add(b := req("b", list(range(40)) + [7, 8, 9]))
    s.schedule()
    s.finish(a, Status.ABORTED)
    batch = s.schedule()
    assert [x.request for x in batch.scheduled] == [b] and b.num_computed_tokens == 0 and s.allocator.num_cached == 0

    s = sched(budget=64)
    s.add(a := req("a", list(range(40)) + [1, 2]))
    s.add(b := req("b", list(range(40)) + [7, 8, 9]))
    s.schedule()
    s._preempt(a, Batch())
    batch = s.schedule()
    assert [x.request for x in batch.scheduled] == [a] and b.status is Status.WAITING
    s.advance(batch)
    assert b in [x.request for x in s.schedule().scheduled] and b.num_computed_tokens == 40


@pytest.mark.parametrize("seed", range(4))
def test_preemption_and_abort_storms_leave_the_pool_whole(seed):
    """Shared prefixes under a small pool: requests preempt each other, share and evict blocks, and some are aborted
    at random points. Each slot of the pool records the token last computed into it: every request's computed
    positions always hold its own tokens (no shared block is overwritten). In the end every block is back."""
    rng = random.Random(seed)
    written: dict[int, int] = {}  # slot -> the token whose KV it holds
    s = sched(blocks=24, budget=16)
    system = list(range(1000, 1020))
    reqs = [
        req(
            str(i),
            system[: rng.randint(0, 20)] + [rng.randrange(500) for _ in range(rng.randint(1, 20))],
            max_tokens=rng.randint(1, 30),
        )
        for i in range(40)
    ]
    pending = list(reqs)
    for _ in range(5000):
        while pending and rng.random() < 0.3:
            s.add(pending.pop(0))
        batch = s.schedule()
        sampled = [x.request for x in batch.scheduled if x.samples]
        for x in batch.scheduled:
            write_kv(written, x.request, x.request.num_computed_tokens, x.num_new_tokens, s.allocator.block_size)
        s.advance(batch)
        for r in s.running:
            n = r.num_computed_tokens
            assert [written[slot(r, p, 4)] for p in range(n)] == r.token_ids(0, n)
        take_tokens(s, sampled, [rng.randrange(500) for _ in sampled])
        for r in sampled:
            if len(r.output_token_ids) == r.params.max_tokens:
                s.finish(r, Status.FINISHED)
        live = [*s.waiting, *s.running]
        if live and rng.random() < 0.05:
            s.finish(rng.choice(live), Status.ABORTED)
        if not pending and not s.has_work():
            break
    assert all(r.is_finished for r in reqs)
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0
    alloc = s.allocator
    assert alloc.num_free == 24 and alloc.num_used == 0 and all(alloc.refs(b) == 0 for b in range(24))


def slot(r: Request, pos: int, block_size: int) -> int:
    return r.block_ids[pos // block_size] * block_size + pos % block_size


def write_kv(written: dict[int, int], r: Request, start: int, n: int, block_size: int) -> None:
    for p, token in enumerate(r.token_ids(start, start + n), start):
        written[slot(r, p, block_size)] = token


# ---- the engine, against transformers -----------------------------------------------------------------
def shared_prefix_prompts(n: int, prefix_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(500) for _ in range(prefix_len)]
    return [
        prefix[: rng.randint(prefix_len // 2, prefix_len)] + [rng.randrange(500) for _ in range(rng.randint(1, 40))]
        for _ in range(n)
    ]


def greedy(rid: str, prompt: list[int], n: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


@pytest.mark.parametrize("kernels", ["on", "off"])
@pytest.mark.parametrize("num_blocks", [None, 24], ids=["roomy", "preempting"])
def test_greedy_with_cache_hits_equals_transformers(tiny_models, kernels, num_blocks):
    """A warm-up request caches a long prefix; then requests that share parts of it run together (in a small pool:
    preempting and evicting). Tokens are transformers'; the hits happened; every block comes back."""
    model = tiny_models["qwen3"]
    prompts = shared_prefix_prompts(9, 200, seed=3)
    outs = [12, 1, 20, 7, 16, 3, 24, 9, 14]
    ref = hf_greedy(model, prompts, outs)
    engine = build_engine(
        EngineConfig(model=str(model), max_num_batched_tokens=64, num_kv_blocks=num_blocks, cpu_kernels=kernels)
    )
    got = {}
    for rid, prompt, n in [("0", prompts[0], outs[0])]:  # the first alone: it fills the cache
        engine.add(greedy(rid, prompt, n))
    rest = [greedy(str(i), p, n) for i, (p, n) in enumerate(zip(prompts, outs, strict=True)) if i]
    while engine.has_work() or rest:
        if not engine.has_work():
            for r in rest:
                engine.add(r)
            rest = []
        for o in engine.step():
            got.setdefault(o.request.request_id, []).append(o.token_id)
    assert [got[str(i)] for i in range(len(prompts))] == ref
    counters = engine.cache_counters()
    assert counters["prefix_cache_hits"] >= 8 * 96  # every later request shares at least 6 blocks of 16
    assert counters["prefix_cache_queries"] >= sum(len(p) for p in prompts)
    if num_blocks is not None:
        assert engine.num_preemptions() > 0 and counters["prefix_cache_evictions"] > 0
    assert engine.pool.allocator.num_free == engine.pool.num_blocks and engine.pool.allocator.num_used == 0


def test_prompts_sent_together_compute_their_shared_prefix_once(tiny_models):
    """Two prompts behind the same 80-token prefix, added at once: the second waits for the first's blocks and
    shares them (the hits counted); both answers are transformers'."""
    model = tiny_models["qwen3"]
    rng = random.Random(5)
    prefix = [rng.randrange(500) for _ in range(80)]
    prompts = [prefix + [rng.randrange(500) for _ in range(n)] for n in (7, 12)]
    engine = build_engine(EngineConfig(model=str(model), max_num_batched_tokens=256))
    for i, p in enumerate(prompts):
        engine.add(greedy(str(i), p, 5))
    got = _run(engine)
    assert [got["0"], got["1"]] == hf_greedy(model, prompts, [5, 5])
    assert engine.cache_counters()["prefix_cache_hits"] == 80


def test_no_prefix_caching_recomputes(tiny_models):
    model = tiny_models["qwen3"]
    engine = build_engine(EngineConfig(model=str(model), prefix_caching=False))
    prompt = list(range(50, 120))
    for rid in ("a", "b"):
        engine.add(greedy(rid, prompt, 3))
        while engine.has_work():
            engine.step()
    assert engine.cache_counters()["prefix_cache_hits"] == 0 and engine.pool.allocator.num_cached == 0


# ---- disaggregated: the decode node pulls only the KV it lacks -------------------------------------------
def _run(engine: Engine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request.request_id, []).append(o.token_id)
    return got


def test_an_engine_pulls_only_the_blocks_it_lacks_through_the_in_process_backend(tiny_models):
    """The handoff between a prefill engine and a decode engine in one process, through the in-process fake of the
    KV interface: the decode engine holds the prompt's first blocks from an earlier request, so it pulls from the
    first block it lacks, the fake ships exactly those blocks, the checksums pass, and the answer is transformers'."""
    model = tiny_models["qwen3"]
    rng = random.Random(11)
    prompt = [rng.randrange(500) for _ in range(90)]
    prefill, decode = (
        build_engine(EngineConfig(model=str(model)), prefill_only=True),
        build_engine(EngineConfig(model=str(model))),
    )
    decode.add(greedy("earlier", prompt[:70], 2))  # leaves the prompt's first 4 blocks of 16 cached there
    _run(decode)
    sent = greedy("r", prompt, 6)
    prefill.add(sent)
    first = _run(prefill)["r"]
    held = Request("r", prompt, sent.params, output_token_ids=list(first), status=Status.WAITING_FOR_KV)
    decode.add(held)
    assert decode.reserve_remote() == [held] and decode.first_block_to_pull(held) == 4
    fake = InProcessBackend()
    landed = sum(decode.receive_kv(held, fake, h, f, None) for h, f in prefill.send_kv(sent, fake, 4))
    assert landed == decode.layout.num_layers and decode.kv_landed(held, fake, prefill.kv_checksums(sent, 4)) == ""
    assert {h.shape[2] for h in fake.sent} == {(6 - 4) * 16}  # blocks 4 and 5 of a 90-token prompt, nothing before
    prefill.release(sent, Status.FINISHED)
    assert first + _run(decode)["r"] == hf_greedy(model, [prompt], [6])[0]
    assert decode.cache_counters()["prefix_cache_hits"] == 4 * 16
    assert prefill.kv_stats()[0] == decode.kv_stats()[0] == 0  # every block back in both pools
