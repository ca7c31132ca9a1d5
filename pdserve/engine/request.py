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

While a request runs, its row of the persistent batch (engine/rows.py) owns its `num_computed_tokens` and
`num_pending`, so that the scheduler and the engine count them for every running request at once; `RowCounter`
says who owns them when.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

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


class RowCounter:
    """A request's counter that its row of the persistent batch (engine/rows.py) owns while the request runs.

    Who owns the value, and when:
    - the request holds no row (waiting, receiving KV, transferring, ended): the request, in `_<name>`;
    - from `enter_row` (`BatchRows.add`, at admission) to `leave_row` (`BatchRows.remove`): the BatchRows array
      of the same name, at the request's row. There the scheduler (`_steady`, `count`) and the engine (`launch`,
      `finish`) count every running request's value at once, vectorised, without touching the request.
    The attribute reads and writes whichever owns it, so code that looks at one request (`_one_by_one`,
    `take_token`, a test) sees the current value; the value moves only in `enter_row` and `leave_row`.
    On the class it reads `default`, which the dataclass takes as the field's default.
    """

    def __init__(self, default: int = 0) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.own = name, "_" + name

    def __get__(self, req: Request | None, owner: type | None = None) -> int:
        if req is None:
            return self.default
        at = req.row
        return req.__dict__[self.own] if at is None else int(getattr(at[0], self.name)[at[1]])

    def __set__(self, req: Request, value: int) -> None:
        at = req.row
        if at is None:
            req.__dict__[self.own] = value
        else:
            getattr(at[0], self.name)[at[1]] = value


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = RowCounter()  # tokens whose KV is computed or being computed by a launched step
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    prompt_logprobs: list = field(default_factory=list)  # echo: the scores of prompt tokens 1.. so far
    guide: Any = None  # a guided request's grammar state (engine.grammar.Guide), built when it joins an engine
    block_hashes: list[int] = field(default_factory=list)  # names of its first full blocks of tokens, so far
    num_cached_blocks: int = 0  # its first blocks that are in the prefix cache (shared from it, or named by it)
    num_pending: int = RowCounter()  # tokens sampled by launched steps whose ids the host has not learned yet
    row: tuple[Any, int] | None = field(default=None, init=False, repr=False)  # (BatchRows, its row) while it runs

    def enter_row(self, rows: Any, row: int) -> None:
        """It takes row `row` of the BatchRows `rows` (`BatchRows.add`): its counters (`RowCounter`) move there."""
        rows.num_computed_tokens[row], rows.num_pending[row] = self.num_computed_tokens, self.num_pending
        self.row = (rows, row)

    def leave_row(self) -> None:
        """It leaves its row (`BatchRows.remove`): its counters move back to it."""
        computed, pending = self.num_computed_tokens, self.num_pending
        self.row = None
        self.num_computed_tokens, self.num_pending = computed, pending

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
