"""A request in flight in the router (`Flight`), and the inbox its events wait in for what streams them (`Inbox`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.router.nodes import NodeConn
from pdserve.wire.messages import TokenEvent
from pdserve.wire.params import Role, SamplingParams

PREFILL = Role.PREFILL  # looked up once: on its class, an enum member costs about a microsecond


class Inbox:
    """A request's events on their way from the core to what consumes them: held until a consumer attaches, then
    handed to it one by one as `put` gets them, on the node reader's stack, with no task switch (a streamed answer
    writes its SSE chunk there; a whole answer gathers its deltas and wakes its handler once, at its end)."""

    __slots__ = ("events", "push", "push_tokens")

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []  # those that came before a consumer attached
        self.push: Callable[[TokenEvent], None] | None = None
        self.push_tokens: Callable[[list[int]], None] | None = None  # plain events' tokens, where the pusher takes them

    def put(self, ev: TokenEvent) -> None:
        if self.push is not None:
            self.push(ev)
        else:
            self.events.append(ev)

    def attach(
        self, push: Callable[[TokenEvent], None], push_tokens: Callable[[list[int]], None] | None = None
    ) -> None:
        """From now on hand every event to `push` (which must not raise), those that came already first; a plain
        event's tokens to `push_tokens`, where given."""
        self.push, self.push_tokens = push, push_tokens
        events, self.events = self.events, []
        for ev in events:
            push(ev)


@dataclass(eq=False)
class Flight:
    """One request in flight. `request_id` changes when the request is dispatched again."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    inbox: Inbox = field(default_factory=Inbox)
    nodes: list[NodeConn] = field(default_factory=list)  # [colocated] or [prefill, decode]
    start: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    decode_started: bool = False  # disaggregated: the decode node has sent a token
    output: list[int] = field(default_factory=list)  # token ids streamed so far
    dispatched_after: int = 0  # len(output) when its latest dispatch went out: the tokens of earlier dispatches
    attempts: int = 0
    ended: bool = False
    early: list[TokenEvent] = field(default_factory=list)  # decode events that beat the first token
    names: list[int] = field(default_factory=list)  # its block names at the latest dispatch ([]: none taken)
    steady: NodeConn | None = None  # the node whose next plain events are only tokens (RouterCore._deliver_tokens)

    @property
    def handed_off(self) -> bool:
        """Whether its prompt is computed on a prefill node and its KV shipped to its decode node."""
        return bool(self.nodes) and self.nodes[0].role is PREFILL  # [prefill, decode]: once a token, kept cheap
