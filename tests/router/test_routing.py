"""The routing policy (pdserve/router/routing.py) as functions: tables of node views in, the node picked out."""

from __future__ import annotations

import pytest

from pdserve.router.routing import (
    NodeView,
    NoNodeAvailable,
    Policy,
    cached_prefix,
    pick,
    prefills_locally,
    route,
    takes_a_queued_prefill,
    tokens_to_compute,
)
from pdserve.wire.params import Role

C, P, D = Role.COLOCATED, Role.PREFILL, Role.DECODE
NAMES = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # a 40-token prompt's blocks, 4 tokens each


def node(role: Role = C, requests: int = 0, cached: int = 0, **kw) -> NodeView:
    """A node holding the first `cached` of NAMES."""
    return NodeView(role, requests=requests, cached=frozenset(NAMES[:cached]), **kw)


@pytest.mark.parametrize(
    ("nodes", "margin", "want", "why"),
    [
        ([node(requests=2), node(requests=1), node(requests=3)], 0, 1, "the least loaded"),
        ([node(requests=1), node(requests=1)], 0, 0, "a tie goes to the node listed first"),
        ([node(kv_blocks_used=9), node(kv_blocks_used=3)], 0, 1, "equal requests: the fewest KV blocks used"),
        ([node(cached=3), node(cached=6), node()], 0, 1, "the longest cached prefix"),
        ([node(cached=6, requests=6), node(requests=1)], 4, 1, "the cache holder, too loaded beyond the margin"),
        ([node(cached=6, requests=6), node(requests=1)], 5, 0, "the cache holder, within the margin"),
        ([node(cached=6, requests=2), node(requests=1)], -1, 1, "margin -1: by load only"),
        ([node(cached=6, up=False), node()], 0, 1, "a node that is down is not picked"),
        ([node(cached=6, draining=True), node(requests=4)], 0, 1, "nor one that drains"),
        ([node(P), node(D, requests=3), node(D, requests=1)], 0, 2, "only nodes of the role"),
    ],
)
def test_pick(nodes, margin, want, why):
    role = nodes[-1].role
    assert pick(nodes, role, NAMES, margin) == want, why


def test_pick_with_no_live_node_of_the_role():
    with pytest.raises(NoNodeAvailable, match="no decode node"):
        pick([node(P), node(D, up=False)], D, NAMES, 0)


@pytest.mark.parametrize(
    ("cached", "names", "want"),
    [({1, 2, 3}, [1, 2, 4, 3], 2), (set(), [1], 0), ({1}, [], 0), ({2, 3}, [1, 2, 3], 0)],
)
def test_cached_prefix(cached, names, want):
    assert cached_prefix(cached, names) == want


@pytest.mark.parametrize(
    ("num_tokens", "cached_blocks", "block_size", "want"),
    [
        (40, 10, 4, 4),  # every block cached: the last block's tokens are computed again (its logits)
        (41, 10, 4, 1),
        (40, 8, 4, 8),
        (40, 0, 4, 40),
        (1, 1, 4, 1),
    ],
)
def test_tokens_to_compute(num_tokens, cached_blocks, block_size, want):
    assert tokens_to_compute(num_tokens, cached_blocks, block_size) == want


@pytest.mark.parametrize(
    ("cached", "num_tokens", "limit", "block_size", "want", "why"),
    [
        (8, 40, 8, 4, True, "8 tokens to compute, limit 8"),
        (8, 40, 7, 4, False, "8 tokens to compute, limit 7"),
        (10, 40, 4, 4, True, "all cached: the last block's 4 tokens"),
        (10, 105, 64, 4, False, "65 to compute"),
        (10, 104, 64, 4, True, "64: one chunk"),
        (0, 4, 64, 4, False, "short, but nothing of it cached"),
        (10, 40, 0, 4, False, "limit 0: never"),
        (10, 40, 64, 0, False, "no block size told yet"),
    ],
)
def test_prefills_locally(cached, num_tokens, limit, block_size, want, why):
    decode = node(D, cached=cached, local_prefill_limit=limit)
    assert prefills_locally(decode, num_tokens, NAMES, block_size) is want, why


@pytest.mark.parametrize(
    ("prefill_loads", "own", "limit", "want", "why"),
    [
        ([1], 0, 1, True, "the prefill node holds the limit, the decode node nothing of its own"),
        ([1], 1, 1, False, "the decode node holds as many of its own"),
        ([2, 1], 0, 2, False, "one prefill node below the limit"),
        ([3, 2], 1, 2, True, "every prefill node at the limit, fewer of its own than the shortest"),
        ([5], 0, 0, False, "limit 0: never"),
        ([], 0, 1, False, "no live prefill node"),
    ],
)
def test_takes_a_queued_prefill(prefill_loads, own, limit, want, why):
    decode = node(D, own_prompts=own)
    nodes = [node(P, requests=r) for r in prefill_loads] + [decode]
    assert takes_a_queued_prefill(nodes, decode, limit) is want, why


@pytest.mark.parametrize(
    ("nodes", "policy", "scored", "want", "why"),
    [
        ([node(), node(cached=4)], Policy(), False, (1,), "colocated: one node"),
        ([node(P), node(D)], Policy("disagg"), False, (0, 1), "disaggregated: prefill, then decode"),
        (
            [node(P), node(D, cached=10, local_prefill_limit=64)],
            Policy("disagg", block_size=4),
            False,
            (1,),
            "the decode node holds the prompt: it prefills it alone",
        ),
        (
            [node(P), node(D, cached=10, local_prefill_limit=64)],
            Policy("disagg", block_size=4),
            True,
            (0, 1),
            "a request scored at every prompt position never skips the prefill node",
        ),
        (
            [node(P, requests=1), node(D)],
            Policy("disagg", max_prefill_queue=1),
            False,
            (1,),
            "the prefill queue is full: the decode node takes the prompt",
        ),
        (
            [node(P), node(P, cached=3), node(D, requests=1), node(D, cached=2)],
            Policy("disagg", block_size=4),
            False,
            (1, 3),
            "each role's node picked by its cache",
        ),
    ],
)
def test_route(nodes, policy, scored, want, why):
    assert route(nodes, policy, 40, NAMES, scored).nodes == want, why
