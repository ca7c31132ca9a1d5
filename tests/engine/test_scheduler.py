"""Budget tests of the iteration-level scheduler, without a model."""

from __future__ import annotations

import pytest

from pdserve.engine.request import IllegalTransition, Request, Status
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.block_allocator import BlockAllocator
from pdserve.wire.params import SamplingParams
from tests.helpers import take_tokens


def req(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens, temperature=0))


def sched(blocks: int = 64, block_size: int = 4, seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(BlockAllocator(blocks, block_size), seqs, budget)


def run(s: Scheduler):
    """One iteration without a model: schedule, then count tokens and 'sample' one token per finished chunk."""
    batch = s.schedule()
    sampled = [x.request for x in batch.scheduled if x.samples]
    s.advance(batch)
    take_tokens(s, sampled, [0] * len(sampled))
    return batch


def test_token_budget_chunks_a_long_prompt():
    s = sched(budget=16)
    r = req("a", 40)
    s.add(r)
    sizes = [run(s).num_tokens for _ in range(3)]
    assert sizes == [16, 16, 8]
    assert r.num_computed_tokens == 40 and r.output_token_ids == [0]


def test_decodes_go_first_and_prompts_fill_the_rest():
    s = sched(budget=16)
    a, b = req("a", 4), req("b", 30)
    s.add(a)
    run(s)  # a's prompt
    s.add(b)
    batch = run(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in batch.scheduled] == [("a", 1), ("b", 15)]
    batch = run(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in batch.scheduled] == [("a", 1), ("b", 15)]
    assert batch.scheduled[1].samples  # b's prompt is complete after this chunk


def test_max_num_seqs_caps_the_running_batch():
    s = sched(seqs=2, budget=100)
    for i in range(3):
        s.add(req(str(i), 5))
    batch = run(s)
    assert len(batch.scheduled) == 2 and len(s.waiting) == 1
    s.finish(s.running[0], Status.FINISHED)
    batch = run(s)
    assert {x.request.request_id for x in batch.scheduled} == {"1", "2"}


def test_fcfs_head_of_queue_is_not_overtaken():
    s = sched(blocks=4, block_size=4, budget=64)
    s.add(req("big", 20))  # needs 5 blocks: never fits the 4-block pool while anything else holds any
    s.add(req("small", 2))
    batch = run(s)
    assert batch.num_tokens == 0 and len(s.waiting) == 2


def test_newest_request_is_preempted_when_the_pool_runs_dry():
    s = sched(blocks=4, block_size=4, budget=64)
    a, b = req("a", 7), req("b", 7)
    s.add(a)
    s.add(b)
    run(s)  # both prompts: 2 blocks each, pool full
    assert s.allocator.num_free == 0
    run(s)  # a's decode token 8 fits block 2; b's too
    batch = run(s)  # a needs a 3rd block: b (newest) is preempted
    assert batch.preempted == [b] and b.status is Status.WAITING and b.num_computed_tokens == 0
    assert b.block_ids == [] and s.waiting[0] is b
    assert [x.request for x in batch.scheduled] == [a]


def test_finish_frees_blocks_and_refuses_illegal_moves():
    s = sched()
    r = req("a", 9)
    s.add(r)
    run(s)
    assert s.allocator.num_used == 3
    s.finish(r, Status.ABORTED)
    assert s.allocator.num_free == 64 and not s.has_work()
    with pytest.raises(IllegalTransition):
        r.move_to(Status.RUNNING)


def test_requests_get_consecutive_blocks_while_the_pool_allows():
    alloc = BlockAllocator(16, 4)
    a, b = [], []
    assert alloc.grow(a, 8, expected_tokens=24)  # a expects 6 blocks: promised 0..5
    assert alloc.grow(b, 8, expected_tokens=16)  # b starts after a's promise
    assert a == [0, 1] and b == [6, 7]
    assert alloc.grow(a, 24) and a == [0, 1, 2, 3, 4, 5]
    c = []
    assert alloc.grow(c, 20, expected_tokens=20) and c == [10, 11, 12, 13, 14]
    d = []  # the last open block, then one promised to b: any free block will do when runs are gone
    assert alloc.grow(d, 8) and d == [15, 8]
    alloc.free(a)
    alloc.free(b)
    alloc.free(c)
    alloc.free(d)
    assert alloc.num_free == 16
    e = []
    assert alloc.grow(e, 64) and e == list(range(16))


def remote(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    """A request whose prompt a prefill node computed: its first token is out, its KV on the way."""
    return Request(
        rid,
        list(range(prompt_len)),
        SamplingParams(max_tokens=max_tokens, temperature=0),
        output_token_ids=[7],
        status=Status.WAITING_FOR_KV,
    )


def test_remote_requests_get_blocks_fcfs_and_run_once_their_kv_lands():
    s = sched(blocks=8, block_size=4)
    a, b, c, d = remote("a", 11), remote("b", 11), remote("c", 11), remote("d", 3)
    for r in (a, b, c, d):
        s.add(r)
    assert not s.has_work()  # nothing to compute until some KV lands
    got = s.reserve_remote()
    assert got == [a, b] and len(a.block_ids) == 3 and s.allocator.num_free == 2  # prompt + first token each
    assert c.status is Status.WAITING_FOR_KV and not c.block_ids
    assert d.status is Status.WAITING_FOR_KV and not d.block_ids  # FCFS: d would fit, but c came first
    assert s.reserve_remote() == []
    s.kv_landed(a)
    assert a.status is Status.WAITING and a.num_computed_tokens == 11
    batch = run(s)
    assert [(x.request, x.num_new_tokens) for x in batch.scheduled] == [(a, 1)]  # the first token, decoded
    s.finish(b, Status.ABORTED)  # aborted while its KV was on the way: its blocks come back
    assert s.reserve_remote() == [c, d] and c.status is Status.RECEIVING_KV


def test_remote_kv_waits_behind_requests_that_must_recompute():
    s = sched(blocks=4, block_size=4, budget=64)
    p = req("p", 12)
    s.add(p)
    run(s)
    s.add(remote("r", 4))
    s._preempt(p, s.schedule())  # p lost its blocks: it recomputes before any new import takes them
    assert s.allocator.num_free == 4 and s.reserve_remote() == []
    run(s)
    assert p.status is Status.RUNNING and s.reserve_remote() == []  # the pool is p's now


def test_a_request_waiting_for_kv_can_only_be_aborted_or_reserved():
    s = sched()
    r = remote("r", 5)
    s.add(r)
    with pytest.raises(IllegalTransition):
        r.move_to(Status.RUNNING)
    s.finish(r, Status.ABORTED)
    assert not s.waiting_for_kv and s.allocator.num_free == 64


def test_a_request_whose_kv_was_lost_recomputes_its_prompt_and_first_token_in_its_blocks():
    s = sched(blocks=8, block_size=4, budget=64)
    r = remote("r", 10)
    s.add(r)
    assert s.reserve_remote() == [r]
    blocks = list(r.block_ids)
    s.kv_lost(r)
    assert r.status is Status.WAITING and r.num_computed_tokens == 0 and r.block_ids == blocks
    batch = run(s)
    assert [(x.request, x.num_new_tokens, x.samples) for x in batch.scheduled] == [(r, 11, True)]
    assert r.output_token_ids == [7, 0] and not s.receiving_kv
