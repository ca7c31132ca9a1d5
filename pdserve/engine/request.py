"""A request's state on a node, and the legal moves between states.

0. (decode node) WAITING_FOR_KV: its prompt was computed on a prefill node; queued FCFS for blocks.
   RECEIVING_KV: blocks reserved by the scheduler, the KV on its way into them; then WAITING.
1. WAITING: queued; owns no KV, or (decode node) owns KV imported from a prefill node.
2. RUNNING: scheduled each iteration; a prompt is caught up chunk by chunk, then one token a step.
3. TRANSFERRING (prefill node only): first token sampled; KV held until the decode node acknowledges.
4. FINISHED / ABORTED: terminal; its KV blocks are already back in the pool.
A preempted request goes RUNNING -> WAITING and recomputes its KV later. Under asynchronous scheduling a
request preempted while its last token was still on the device learns that token waiting, and it may end
it: WAITING -> FINISHED.

Which tokens the host knows: `output_token_ids` holds the sampled tokens the host has taken in (a step's
`finish`); `num_pending` counts those sampled by launched steps whose ids are still on the device (0 or 1
when a step is scheduled; the next step reads such a token from the device as its input). `num_tokens`
counts both; `token_ids` gives known tokens only.

While a request runs, its `num_computed_tokens` and `num_pending` live in its row of the persistent batch
(engine/rows.py, `row`), where the scheduler and the engine count them for every running request at once; the
request reads and writes them there, and takes them back when it leaves its row.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdserve.wire.params import SamplingParams


class Status(enum.Enum):
    WAITING_FOR_KV = "waiting_for_kv"
    RECEIVING_KV = "receiving_kv"
    WAITING = "waiting"
    RUNNING = "running"
    TRANSFERRING = "transferring"
    FINISHED = "finished"
    ABORTED = "aborted"


_LEGAL = {
    Status.WAITING_FOR_KV: {Status.RECEIVING_KV, Status.ABORTED},
    Status.RECEIVING_KV: {Status.WAITING, Status.ABORTED},
    Status.WAITING: {Status.RUNNING, Status.FINISHED, Status.ABORTED},
    Status.RUNNING: {Status.WAITING, Status.TRANSFERRING, Status.FINISHED, Status.ABORTED},
    Status.TRANSFERRING: {Status.FINISHED, Status.ABORTED},
    Status.FINISHED: set(),
    Status.ABORTED: set(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    prompt_logprobs: list = field(default_factory=list)  # echo: the scores of prompt tokens 1.. so far
    guide: Any = None  # a guided request's grammar state (engine.grammar.Guide), built when it joins an engine
    block_hashes: list[int] = field(default_factory=list)  # names of its first full blocks of tokens, so far
    num_cached_blocks: int = 0  # its first blocks that are in the prefix cache (shared from it, or named by it)
    num_pending: int = 0  # tokens sampled by launched steps whose ids the host has not learned yet
    row: ClassVar[tuple[Any, int] | None] = None  # (BatchRows, its row) while it holds one: set by BatchRows

    def prompt_logprob_positions(self, past: int, n: int) -> range:
        """The positions of a chunk [past, past + n) whose logits score a prompt token not scored yet (position p
        scores token p + 1): only while no token is sampled, so a recomputation after a preemption adds none."""
        if self.params.prompt_logprobs is None or self.num_output_tokens:
            return range(0)
        return range(max(past, len(self.prompt_logprobs)), min(past + n, len(self.prompt_token_ids) - 1))

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:  # outputs only (a decoding request's new block): no copy of the lists before
            return self.output_token_ids[start - n : end - n]
        return (self.prompt_token_ids[start:] + self.output_token_ids[: end - n])[max(0, start - n) :]

    @property
    def num_tokens(self) -> int:
        """Prompt plus sampled tokens, those still on the device included."""
        return len(self.prompt_token_ids) + self.num_output_tokens

    @property
    def num_output_tokens(self) -> int:
        """Sampled tokens, known or pending."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def waits_for_host(self) -> bool:
        """Its next draw needs its previous token on the host (a grammar's mask, a logits processor's counts): it
        is not scheduled while a token of it is pending."""
        return self.guide is not None or self.params.processed

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can reach: its prompt plus every token it may generate."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def move_to(self, status: Status) -> None:
        if status not in _LEGAL[self.status]:
            raise IllegalTransition(f"request {self.request_id}: {self.status.value} -> {status.value}")
        self.status = status


def _row_backed(name: str) -> property:
    """A counter kept in the request's row (the BatchRows array of the same name) while it holds one, else here."""
    own = "_" + name

    def get(req: Request) -> int:
        at = req.row
        return getattr(req, own) if at is None else int(getattr(at[0], name)[at[1]])

    def put(req: Request, value: int) -> None:
        at = req.row
        if at is None:
            setattr(req, own, value)
        else:
            getattr(at[0], name)[at[1]] = value

    return property(get, put, doc=f"{name}: in the request's row while it holds one (engine/rows.py)")


Request.num_computed_tokens = _row_backed("num_computed_tokens")  # the dataclass's __init__ sets them through these
Request.num_pending = _row_backed("num_pending")
