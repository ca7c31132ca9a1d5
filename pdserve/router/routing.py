"""The router's routing policy, as pure functions over what it knows of each node (a `NodeView`): which node of a role
takes a request, and whether a disaggregated request skips its prefill node. No sockets here: the core (core.py)
takes a view of its nodes at each dispatch and sends where these functions say.

1. The decode node (disaggregated) or the colocated node is picked first (`pick`): among the live nodes of its role
   (up, not draining), the one whose prefix cache holds the longest prefix of the prompt (its block names), unless
   it holds more than --cache-balance-margin requests above the least loaded (-1: by load only); among equals the
   least loaded (fewest requests, then fewest KV blocks used; ties go to the node listed first).
2. Disaggregated, the decode node computes the prompt itself, with no prefill node and no KV transfer
   (conditional disaggregation), when its cache holds the prompt's first block and all but at most
   --local-prefill-max-tokens of it (`prefills_locally`), or when every prefill node holds at least
   --max-prefill-queue requests not yet handed off while it holds fewer prompts of its own (`takes_a_queued_prefill`).
   Neither for a request scored at every prompt position (echo with logprobs): it shares no cached block.
3. Otherwise a prefill node is picked as in 1.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass

from pdserve.wire.params import Role


class NoNodeAvailable(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the router knows of one node when it routes a request."""

    role: Role
    up: bool = True
    draining: bool = False
    requests: int = 0  # this router's requests on it
    kv_blocks_used: int = 0  # as its latest Stats tell
    cached: Set[int] = frozenset()  # the block names its prefix cache holds
    own_prompts: int = 0  # prompts it computes itself (no prefill node) still waiting for their first token
    local_prefill_limit: int = 0  # the most prompt tokens it may compute itself (decode nodes)

    @property
    def usable(self) -> bool:
        return self.up and not self.draining


@dataclass(frozen=True, slots=True)
class Policy:
    """The routing flags, and the nodes' block size (0: not told yet)."""

    mode: str = "colocated"  # or "disagg"
    cache_balance_margin: int = 0  # -1: by load only
    max_prefill_queue: int = 0  # 0: never
    block_size: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: indices into the views, [colocated], [decode] (it prefills itself) or [prefill, decode]."""

    nodes: tuple[int, ...]

    @property
    def handed_off(self) -> bool:
        return len(self.nodes) == 2


def route(nodes: Sequence[NodeView], policy: Policy, num_tokens: int, names: list[int], scored: bool) -> Route:
    """The nodes a prompt of `num_tokens` whose block names are `names` goes to; `scored`: a request scored at every
    prompt position. NoNodeAvailable when a role it needs has no live node."""
    if policy.mode == "colocated":
        return Route((pick(nodes, Role.COLOCATED, names, policy.cache_balance_margin),))
    decode = pick(nodes, Role.DECODE, names, policy.cache_balance_margin)
    if not scored and (
        prefills_locally(nodes[decode], num_tokens, names, policy.block_size)
        or takes_a_queued_prefill(nodes, nodes[decode], policy.max_prefill_queue)
    ):
        return Route((decode,))
    return Route((pick(nodes, Role.PREFILL, names, policy.cache_balance_margin), decode))


def pick(nodes: Sequence[NodeView], role: Role, names: list[int], margin: int) -> int:
    """The index of the live node of `role` holding the longest cached prefix of `names`, among those within `margin`
    requests of the least loaded (-1: by load only); the least loaded among equals (fewest requests, then fewest KV
    blocks used; ties go to the node listed first)."""
    live = [i for i, n in enumerate(nodes) if n.role == role and n.usable]
    if not live:
        raise NoNodeAvailable(f"no {role} node is up")
    names = names if margin >= 0 else []
    least = min(nodes[i].requests for i in live)
    near = [i for i in live if nodes[i].requests <= least + margin] if names else live
    return min(near, key=lambda i: (-cached_prefix(nodes[i].cached, names), nodes[i].requests, nodes[i].kv_blocks_used))


def prefills_locally(decode: NodeView, num_tokens: int, names: list[int], block_size: int) -> bool:
    """Whether `decode` holds the prompt's first block and all but at most its local prefill limit of tokens."""
    hit = cached_prefix(decode.cached, names)
    if not hit or not block_size:
        return False
    return tokens_to_compute(num_tokens, hit, block_size) <= decode.local_prefill_limit


def takes_a_queued_prefill(nodes: Sequence[NodeView], decode: NodeView, limit: int) -> bool:
    """Whether every live prefill node holds at least `limit` requests (0: never) while `decode` holds fewer prompts
    of its own waiting for their first token than the shortest of them."""
    if not limit:
        return False
    shortest = min((n.requests for n in nodes if n.role is Role.PREFILL and n.usable), default=0)
    return shortest >= limit and decode.own_prompts < shortest


def cached_prefix(cached: Set[int], names: list[int]) -> int:
    """How many of `names`, from the first, are in `cached`."""
    n = 0
    while n < len(names) and names[n] in cached:
        n += 1
    return n


def tokens_to_compute(num_tokens: int, cached_blocks: int, block_size: int) -> int:
    """The tokens of a prompt of `num_tokens` a node computes when its cache holds the prompt's first `cached_blocks`
    blocks: those after the blocks it shares, which never include the block of the last token (its logits give the
    first token), as the scheduler shares them."""
    return num_tokens - min(cached_blocks, (num_tokens - 1) // block_size) * block_size
