"""Cache-aware routing: the nodes' prefix cache changes in their Stats, the router's view of each node's cache, and
its pick of the node holding the longest cached prefix unless that node is too loaded. In-process, fake sockets."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig, NodeConfig, RouterConfig
from pdserve.engine.request import Request
from pdserve.kv.block_allocator import BlockAllocator
from pdserve.nodes.colocated import ColocatedNode
from pdserve.router.core import RouterCore
from pdserve.router.nodes import NodeConn, follow_cache
from pdserve.wire.messages import PROTOCOL_VERSION, Generate, Hello, Stats, TokenEvent
from pdserve.wire.params import FinishReason, Role, SamplingParams, block_hashes, chain_seed
from tests.helpers import FakeNodeSock

LAYOUT = {"block_size": 4, "model_fingerprint": "fp"}


def stats(role: Role, stored=(), evicted=(), reset: bool = False) -> Stats:
    return Stats(role, 0, 0, 0, 10, {}, cache_stored=list(stored), cache_evicted=list(evicted), cache_reset=reset)


def names(prompt: list[int]) -> list[int]:
    return block_hashes(prompt, 4, chain_seed("fp"))


@pytest.fixture
def colocated():
    c = RouterCore(RouterConfig(model="tiny", colocated=("tcp://c0", "tcp://c1", "tcp://c2")))
    for m in c.links.membership._members:
        c.nodes.append(NodeConn(m.role, m.addr, m.kv_addr, sock=FakeNodeSock(), up=True, info={"layout": LAYOUT}))
    yield c
    c.links.ctx.destroy(linger=0)


def submit(core: RouterCore, prompt: list[int]) -> str:
    return core.submit(prompt, SamplingParams(max_tokens=4)).nodes[0].addr


def test_the_allocator_reports_net_changes_and_its_whole_cache():
    alloc = BlockAllocator(4, 4)
    alloc.changes = {}
    blocks: list[int] = []
    alloc.grow(blocks, 16)
    for b, h in zip(blocks, [1, 2, 3, 4], strict=True):
        alloc.commit(b, h)
    assert alloc.take_changes() == ([1, 2, 3, 4], []) and alloc.take_changes() == ([], [])
    alloc.free(blocks)
    other: list[int] = []
    alloc.grow(other, 8)  # evicts two (the last released first)
    alloc.commit(other[0], 9)
    stored, evicted = alloc.take_changes()
    assert stored == [9] and sorted(evicted) == [3, 4] and sorted(alloc.cached_names()) == [1, 2, 9]


def test_the_router_follows_a_nodes_cache_and_a_reset_replaces_it():
    node = NodeConn(Role.COLOCATED, "tcp://c0")
    follow_cache(node, stats(Role.COLOCATED, stored=[1, 2, 3]))
    follow_cache(node, stats(Role.COLOCATED, stored=[4], evicted=[2]))
    assert node.cached == {1, 3, 4}
    follow_cache(node, stats(Role.COLOCATED, stored=[7], reset=True))  # a restarted node: its whole cache
    assert node.cached == {7}


def test_the_node_with_the_longest_cached_prefix_is_picked(colocated):
    prompt = list(range(40))
    c1, c2 = colocated.nodes[1], colocated.nodes[2]
    follow_cache(c1, stats(Role.COLOCATED, stored=names(prompt)[:3]))
    follow_cache(c2, stats(Role.COLOCATED, stored=names(prompt)[:6]))
    assert submit(colocated, prompt) == "tcp://c2"
    assert submit(colocated, list(range(100, 140))) == "tcp://c0"  # no overlap anywhere: the least loaded


def test_a_loaded_node_is_passed_over_beyond_the_margin(colocated):
    prompt = list(range(40))
    hot = colocated.nodes[1]
    follow_cache(hot, stats(Role.COLOCATED, stored=names(prompt)))
    picked = [submit(colocated, prompt) for _ in range(8)]
    # c0 and c2 stay at 0 requests; the hot node takes requests while it holds at most 4 more than they do
    assert picked == ["tcp://c1"] * 5 + ["tcp://c0", "tcp://c2", "tcp://c1"]


def test_margin_minus_one_routes_by_load_only():
    c = RouterCore(RouterConfig(model="tiny", colocated=("tcp://c0", "tcp://c1"), cache_balance_margin=-1))
    try:
        for m in c.links.membership._members:
            c.nodes.append(NodeConn(m.role, m.addr, sock=FakeNodeSock(), up=True, info={"layout": LAYOUT}))
        follow_cache(c.nodes[1], stats(Role.COLOCATED, stored=names(list(range(40)))))
        assert submit(c, list(range(40))) == "tcp://c0"
    finally:
        c.links.ctx.destroy(linger=0)


def test_disagg_picks_the_prefill_and_the_decode_node_by_their_caches():
    c = RouterCore(
        RouterConfig(
            model="tiny",
            prefill=("tcp://p0", "tcp://p1"),
            decode=("tcp://d0", "tcp://d1"),
            decode_kv=("tcp://k0", "tcp://k1"),
        )
    )
    try:
        for m in c.links.membership._members:
            c.nodes.append(NodeConn(m.role, m.addr, m.kv_addr, sock=FakeNodeSock(), up=True, info={"layout": LAYOUT}))
        prompt = list(range(40))
        follow_cache(c.nodes[1], stats(Role.PREFILL, stored=names(prompt)[:2]))
        follow_cache(c.nodes[3], stats(Role.DECODE, stored=names(prompt)[:8]))
        flight = c.submit(prompt, SamplingParams(max_tokens=4))
        assert [n.addr for n in flight.nodes] == ["tcp://p1", "tcp://d1"]
        c.links.node_down(c.nodes[3], "test")
        assert not c.nodes[3].cached  # a node that is back sends its whole cache again
    finally:
        c.links.ctx.destroy(linger=0)


def test_a_nodes_stats_carry_its_whole_cache_after_a_hello_then_its_changes(tiny_models, monkeypatch):
    """What a (re)connecting router gets first is the node's whole cache, so that a restarted node or router starts
    from the truth; then only what changed."""
    node = ColocatedNode(NodeConfig("colocated", EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=32)))
    try:
        first = node.stats()
        assert first.cache_reset and first.cache_stored == []
        node.engine.add(Request("a", list(range(40)), SamplingParams(max_tokens=2, temperature=0)))
        while node.engine.has_work():
            node.engine.step()
        changes = node.stats()
        assert not changes.cache_reset and len(changes.cache_stored) == 2 and changes.cache_evicted == []
        assert node.stats().cache_stored == []
        sent = []
        monkeypatch.setattr(node, "send_stats", lambda: sent.append(node.stats()))
        node.on_hello(b"router", Hello(PROTOCOL_VERSION, Role.ROUTER))  # a router (re)connects
        again = sent[0]
        assert again.cache_reset and sorted(again.cache_stored) == sorted(changes.cache_stored)
    finally:
        node.close()


# ---- conditional disaggregation: the router's choice ----------------------------------------------------
def disagg_core(**cfg) -> RouterCore:
    """A disaggregated router over fake nodes p0 and d0; d0 says it runs 64 tokens a step."""
    cfg.setdefault("prefill", ("tcp://p0",))
    c = RouterCore(RouterConfig(model="tiny", decode=("tcp://d0",), decode_kv=("tcp://k0",), **cfg))
    for m in c.links.membership._members:
        info = {"layout": LAYOUT, "max_num_batched_tokens": 64}
        c.nodes.append(NodeConn(m.role, m.addr, m.kv_addr, sock=FakeNodeSock(), up=True, info=info))
    return c


def routed(core: RouterCore, prompt: list[int], **params) -> list[str]:
    """The nodes a request goes to, after checking that the first of them got its Generate."""
    flight = core.submit(prompt, SamplingParams(max_tokens=4, **params))
    sent = flight.nodes[0].sock.sent[-1]
    assert isinstance(sent, Generate) and sent.request_id == flight.request_id
    assert sent.decode_addr == ("" if len(flight.nodes) == 1 else "tcp://k0")
    return [n.addr for n in flight.nodes]


@pytest.mark.parametrize("margin", [4, -1])
def test_a_decode_node_holding_all_but_a_few_tokens_prefills_them_itself(margin):
    """d0 holds 8 of the 10 blocks of a 40-token prompt: it would compute 8 tokens. Taken at a limit of 8, not at 7;
    with cache-aware routing on or off (the decode node is picked first either way)."""
    prompt = list(range(40))
    for limit, want in [(8, ["tcp://d0"]), (7, ["tcp://p0", "tcp://d0"])]:
        c = disagg_core(local_prefill_max_tokens=limit, cache_balance_margin=margin)
        try:
            follow_cache(c.nodes[1], stats(Role.DECODE, stored=names(prompt)[:8]))
            assert routed(c, prompt) == want, limit
        finally:
            c.links.ctx.destroy(linger=0)


def test_local_prefill_counts_the_tokens_the_node_computes_and_needs_a_cached_block():
    c = disagg_core()  # the limit: the decode node's 64 tokens a step
    try:
        prompt = list(range(40))
        follow_cache(c.nodes[1], stats(Role.DECODE, stored=names(prompt)))  # every block, the last included
        assert routed(c, prompt) == ["tcp://d0"]  # it computes the last block's 4 tokens (the last one's logits)
        assert routed(c, prompt + list(range(500, 565))) == ["tcp://p0", "tcp://d0"]  # 65 to compute
        assert routed(c, prompt + list(range(500, 564))) == ["tcp://d0"]  # 64: one chunk
        assert routed(c, list(range(100, 110))) == ["tcp://p0", "tcp://d0"]  # short, but nothing of it is cached
        assert routed(c, prompt, prompt_logprobs=1) == ["tcp://p0", "tcp://d0"]  # echo scores every position
    finally:
        c.links.ctx.destroy(linger=0)


def test_local_prefill_off_with_zero():
    c = disagg_core(local_prefill_max_tokens=0)
    try:
        prompt = list(range(40))
        follow_cache(c.nodes[1], stats(Role.DECODE, stored=names(prompt)))
        assert routed(c, prompt) == ["tcp://p0", "tcp://d0"]
    finally:
        c.links.ctx.destroy(linger=0)


def test_a_decode_node_takes_prompts_while_every_prefill_node_holds_the_queue_limit():
    """--max-prefill-queue 1: while p0 holds a request not yet handed off, d0 takes the next prompt itself (nothing of
    it cached), unless it already holds as many prompts of its own waiting for their first token; never a request
    scored at every prompt position. First tokens and hand-offs shorten the queues again."""
    c = disagg_core(max_prefill_queue=1)
    try:
        p, d = c.nodes
        prompts = iter(list(range(100 * i, 100 * i + 40)) for i in range(10))
        assert routed(c, next(prompts)) == ["tcp://p0", "tcp://d0"]
        assert routed(c, next(prompts)) == ["tcp://d0"]  # p0 holds 1, d0 none of its own
        assert routed(c, next(prompts)) == ["tcp://p0", "tcp://d0"]  # d0 holds 1 of its own: not fewer
        assert routed(c, next(prompts), prompt_logprobs=1) == ["tcp://p0", "tcp://d0"]
        assert routed(c, next(prompts)) == ["tcp://d0"]  # p0 holds 3, d0 1 of its own
        for f in [f for f in c.waiting if f.nodes == [d]]:
            c._deliver(TokenEvent(f.request_id, [7], None), d)  # d0's own have their first token
        assert routed(c, next(prompts)) == ["tcp://d0"] and len(p.requests) == 3
        for f in [f for f in c.waiting if f.nodes == [p, d]]:
            c._deliver(TokenEvent(f.request_id, [7], None), p)
            c._deliver(TokenEvent(f.request_id, [], None), d)  # the KV landed: handed off
        assert not p.requests and routed(c, next(prompts)) == ["tcp://p0", "tcp://d0"]
    finally:
        c.links.ctx.destroy(linger=0)


@pytest.mark.parametrize(
    "limit, prefill, want",
    [
        (0, ("tcp://p0",), ["tcp://p0", "tcp://d0"]),
        (2, ("tcp://p0",), ["tcp://p0", "tcp://d0"]),
        (1, ("tcp://p0", "tcp://p1"), ["tcp://p1", "tcp://d0"]),
    ],
)
def test_a_prefill_queue_below_the_limit_keeps_the_prompt_on_the_prefill_nodes(limit, prefill, want):
    """Off (0, the default), a limit not yet reached, or a second prefill node with room: the second request goes
    through a prefill node like the first."""
    c = disagg_core(max_prefill_queue=limit, prefill=prefill)
    try:
        routed(c, list(range(40)))
        assert routed(c, list(range(100, 140))) == want
    finally:
        c.links.ctx.destroy(linger=0)


@pytest.mark.parametrize("case", ["caching", "ended by the client", "node without caching", "one-token answer"])
def test_a_conversations_next_turn_finds_the_last_turns_blocks_on_its_decode_node(case):
    """A request that ends well leaves its blocks (prompt and output, but the last token's) in its decode node's
    cache: the router's view has them at once, before the node's next Stats, so the next turn, sent right away, is
    prefilled on the decode node. Not for a request the client ended (its end is the router's guess), nor for a
    node that does not cache; a one-token answer ends on its prefill node, which holds its prompt's blocks (the
    decode node never got them)."""
    c = disagg_core()
    try:
        p, d = c.nodes
        d.info["prefix_caching"] = case != "node without caching"
        p.info["prefix_caching"] = True
        prompt = list(range(40))
        if case == "one-token answer":
            flight = c.submit(prompt, SamplingParams(max_tokens=1))
            c._deliver(TokenEvent(flight.request_id, [7], FinishReason.LENGTH), p)
            assert flight.ended and p.cached == set(names(prompt)) and not d.cached  # 10 blocks, all computed
            return
        flight = c.submit(prompt, SamplingParams(max_tokens=4))
        c._deliver(TokenEvent(flight.request_id, [7], None), p)
        c._deliver(TokenEvent(flight.request_id, [], None), d)  # the KV landed
        if case == "ended by the client":
            c.abort(flight.request_id)
        else:
            c._deliver(TokenEvent(flight.request_id, [8, 9, 10], FinishReason.LENGTH), d)
        assert flight.ended
        history = prompt + flight.output
        if case == "caching":
            assert d.cached == set(names(history)[:10]) and not p.cached  # 44 tokens, the last one's KV not computed
            assert routed(c, history + list(range(300, 320))) == ["tcp://d0"]
        else:
            assert not d.cached and routed(c, history + list(range(300, 320))) == ["tcp://p0", "tcp://d0"]
    finally:
        c.links.ctx.destroy(linger=0)


def test_a_locally_prefilled_request_streams_from_its_decode_node_alone():
    """Its first token comes from the decode node (not held back for a prefill node's, as a handed-off request's
    decode events are); no hand-off is timed; a lost prefill node does not concern it."""
    c = disagg_core()
    try:
        prompt = list(range(40))
        follow_cache(c.nodes[1], stats(Role.DECODE, stored=names(prompt)))
        flight = c.submit(prompt, SamplingParams(max_tokens=2))
        decode = c.nodes[1]
        assert flight.nodes == [decode] and not flight.handed_off
        c._deliver(TokenEvent(flight.request_id, [7], None), decode)
        assert flight.output == [7] and flight.first_token_at is not None and not flight.early
        c.links.node_down(c.nodes[0], "test")
        assert not flight.ended and flight.attempts == 1
        c._deliver(TokenEvent(flight.request_id, [8], FinishReason.LENGTH), decode)
        assert flight.output == [7, 8] and flight.ended
        assert c.metrics.registry.get_sample_value("pdserve:request_handoff_time_seconds_count") == 0
        assert decode.requests == set()
    finally:
        c.links.ctx.destroy(linger=0)
