"""Iteration-level scheduler (Orca) with chunked prefill. Pure Python: budgets in, a batch out.

One path for every request: each iteration, a scheduled request catches its `num_computed_tokens`
up towards `num_tokens` by as many tokens as the budget allows; a decoding request needs one, a
prompt needs the rest of its prompt (in chunks). Running requests go first, oldest first, then
waiting ones FCFS while the token budget, `max_num_seqs` and the KV pool allow. When the pool runs
dry the newest running request is preempted: its blocks are freed and it recomputes later.

Prefix caching (`cache_seed` set): a request admitted without KV first shares the cached blocks of its
longest cached prefix (never its last token, whose logits it needs; never for echo with logprobs,
which scores every prompt position), and starts computing after them. After each step, the full
blocks a request has computed are named in the cache (`commit`), so they outlive it. A new request whose next
blocks a running request is computing now (the same system prompt, sent at once) waits for them instead of
computing them again, while requests behind it go ahead (`_waits_for_prefix`).

Asynchronous scheduling (docs/async-scheduling.md): the engine schedules step N+1 before step N's tokens
reach the host. A request then has a pending token (`Request.num_pending`): it is scheduled for one token
as usual (its input comes from the device), except when its next draw needs that token on the host (a
guided request, a logits processor: `Request.waits_for_host`) or when the pending token is its last one
(max_tokens): those sit the step out. The computed tokens are counted when a step is launched (`count`);
the blocks a step filled are named in the prefix cache when it finishes (`commit_computed`), by which time
the host knows every token in them.
"""

from __future__ import annotations

import functools
from collections import deque
from itertools import compress
from typing import NamedTuple

import numpy as np

from pdserve.engine.request import Request, Status
from pdserve.engine.rows import BatchRows
from pdserve.kv.block_allocator import BlockAllocator
from pdserve.wire.params import block_hashes

# A new request waits for a prefix a running request is computing when that saves it at least this many blocks.
WAIT_FOR_PREFIX_BLOCKS = 4
STEP_GROUPS = ((1, 8), (9, 32), (33, 128), (129, 256))  # decode-only steps by batch size, beside their memory floor


def step_group(requests: int, tokens: int, decode_tokens: int) -> str | None:
    """The group a step is set beside its floor in: "prompt chunks" when it runs any prompt token (the compute
    floor), else "decode LO-HI" by its batch size (the memory floor); None for a decode batch past STEP_GROUPS."""
    if decode_tokens != tokens:
        return "prompt chunks"
    return next((f"decode {lo}-{hi}" for lo, hi in STEP_GROUPS if lo <= requests <= hi), None)


GROUP_KEYS = {  # each floor group -> the prefix of its node counters
    g: "steps_" + g.replace(" ", "_").replace("-", "_")
    for g in [f"decode {lo}-{hi}" for lo, hi in STEP_GROUPS] + ["prompt chunks"]
}
GROUP_COUNTS = ("count", "time_s", "context_tokens", "tokens", "samples")  # each group's counters: <prefix>_<count>


def group_counts(batch: Batch | None, seconds: float) -> dict[str, float]:
    """One step's counts under its floor group's counter names (steps, seconds, context tokens, tokens, rows
    sampled); with no batch, every group's counters at zero."""
    if batch is None:
        return {f"{p}_{k}": 0 for p in GROUP_KEYS.values() for k in GROUP_COUNTS}
    prefix = GROUP_KEYS.get(batch.floor_group)
    values = (1, seconds, batch.num_context_tokens, batch.num_tokens, batch.num_samples)
    return {f"{prefix}_{k}": v for k, v in zip(GROUP_COUNTS, values, strict=True)} if prefix else {}


class ScheduledRequest(NamedTuple):
    """A request's part of an iteration (a tuple: one is made per running request per step)."""

    request: Request
    num_new_tokens: int
    samples: bool  # this chunk reaches the request's last token, so a new token is sampled
    past: int = 0  # tokens computed before this chunk

    @classmethod
    def of(cls, req: Request, n: int) -> ScheduledRequest:
        past = req.num_computed_tokens
        return cls(req, n, past + n == req.num_tokens, past)


class Batch:
    """What one iteration runs: requests in order, and how many new tokens each. Built request by request
    (`scheduled`), or, a steady step's, from the rows at once (`of_rows`: its `scheduled` is made only if asked)."""

    def __init__(
        self,
        scheduled: list[ScheduledRequest] | None = None,
        preempted: list[Request] | None = None,
        table: BatchRows | None = None,  # the running requests' rows (None: a batch built by hand, without rows)
        rows: list[int] | np.ndarray = (),  # with `table`: the row of each scheduled request
        owners: np.ndarray | None = None,  # with `table`: who held each of those rows when it was scheduled
    ) -> None:
        self._scheduled = [] if scheduled is None else scheduled
        self.preempted = [] if preempted is None else preempted
        self.table, self.rows, self.owners = table, rows, owners

    @classmethod
    def of_rows(cls, table: BatchRows, requests: list[Request], rows: np.ndarray, lens: np.ndarray) -> Batch:
        """The running requests `requests` in rows `rows` ([R]), each computing its `lens` next tokens up to all its
        tokens (so each samples), taken from the rows at once."""
        batch = cls(None, None, table, rows, table.owner[rows])
        pasts = table.num_computed_tokens[rows]
        batch._scheduled = None
        batch.columns = (tuple(requests), tuple(lens.tolist()), (True,) * len(requests), tuple(pasts.tolist()))
        batch.arrays = (rows, lens, np.ones(len(requests), dtype=bool), pasts)
        return batch

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """Each scheduled request's part, in order."""
        if self._scheduled is None:  # a steady step's, made now that it is asked for
            self._scheduled = list(map(ScheduledRequest, *self.columns))
        return self._scheduled

    @scheduled.setter
    def scheduled(self, value: list[ScheduledRequest]) -> None:
        self._scheduled = value
        self.__dict__.pop("columns", None)
        self.__dict__.pop("arrays", None)

    @functools.cached_property
    def columns(self) -> tuple[tuple, tuple, tuple, tuple]:
        """(requests, new tokens, samples, past) of the scheduled requests, in order, each a tuple (once scheduled)."""
        return tuple(zip(*self.scheduled, strict=True)) if self.scheduled else ((), (), (), ())

    @functools.cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(rows, new tokens, samples, past) of the scheduled requests as arrays, [R] each (int64, but samples bool),
        made once (with `table`; rows are empty without)."""
        _, lens, samples, pasts = self.columns
        rows = np.asarray(self.rows, dtype=np.int64)
        return rows, np.array(lens, dtype=np.int64), np.array(samples, dtype=bool), np.array(pasts, dtype=np.int64)

    @property
    def requests(self) -> tuple[Request, ...]:
        """The scheduled requests, in order."""
        return self.columns[0]

    @property
    def samples(self) -> tuple[bool, ...]:
        """Whether each scheduled request samples a token."""
        return self.columns[2]

    @property
    def num_tokens(self) -> int:
        return sum(self.columns[1])

    @property
    def num_samples(self) -> int:
        """Requests that sample a token this step (their last row's logits are computed)."""
        return sum(self.columns[2])

    @property
    def num_decode_tokens(self) -> int:
        """Requests with one new token after their whole prompt (not a one-token prompt, nor a recomputed chunk)."""
        if self.table is not None and self:  # from the rows, vectorised
            rows, lens, _, pasts = self.arrays
            return int(np.count_nonzero((lens == 1) & (pasts >= self.table.prompt_len[rows])))
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1 and s.past >= len(s.request.prompt_token_ids))

    @property
    def num_context_tokens(self) -> int:
        """The KV the batch's attention reads: each request's tokens up to the end of its chunk."""
        _, lens, _, pasts = self.columns
        return sum(lens) + sum(pasts)

    @property
    def floor_group(self) -> str | None:
        """`step_group` of this batch."""
        return step_group(len(self.scheduled), self.num_tokens, self.num_decode_tokens)

    def prompt_logprob_rows(self) -> list[tuple[int, Request, int]]:
        """(row of the iteration's flat tokens, request, position) of every prompt position whose logits score
        the next prompt token (echo with logprobs), in batch order. Before `advance`."""
        if self.table is not None and not self.table.scoring:
            return []  # no running request is scored (the common case): no look at each
        rows, start = [], 0
        for s in self.scheduled:
            req, past = s.request, s.request.num_computed_tokens
            rows.extend((start + p - past, req, p) for p in req.prompt_logprob_positions(past, s.num_new_tokens))
            start += s.num_new_tokens
        return rows

    def __bool__(self) -> bool:
        return bool(self.columns[0]) if self._scheduled is None else bool(self._scheduled)


class Scheduler:
    def __init__(
        self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int, cache_seed: int | None = None
    ) -> None:
        self.allocator = allocator
        self.cache_seed = cache_seed  # the block hash chain's seed (protocol.chain_seed); None: no prefix caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rows = BatchRows(max_num_seqs)  # a row per running request (engine/rows.py)
        self._rows_of_running: np.ndarray | None = None  # their rows in running order (`_running_rows`)
        self.waiting_for_kv: deque[Request] = deque()  # decode node: prompts computed elsewhere, no blocks yet
        self.receiving_kv: dict[str, Request] = {}  # decode node: blocks reserved, KV on its way
        self.num_preemptions = 0  # since start, for the node's counters
        self.steady_steps = 0  # since start: steps whose running requests were scheduled from the rows at once
        self.prefix_cache_queries = 0  # since start: tokens of the requests admitted without KV, looked up
        self.prefix_cache_hits = 0  # of those, the tokens found in the prefix cache

    # ---- queue --------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """A new request (WAITING), or one whose KV a prefill node will send (WAITING_FOR_KV)."""
        if request.status is Status.WAITING_FOR_KV:
            self.waiting_for_kv.append(request)
        else:
            self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: Status) -> None:
        """Take a request out of the queues for good and free its KV at once."""
        if request in self.running:
            self.running.remove(request)
            self._rows_of_running = None
            self.rows.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.waiting_for_kv:
            self.waiting_for_kv.remove(request)
        self.receiving_kv.pop(request.request_id, None)
        self.allocator.free(request.block_ids)
        request.move_to(status)

    # ---- remote KV (decode node) ----------------------------------------------------------------
    def reserve_remote(self) -> list[Request]:
        """Blocks for the requests waiting for remote KV, FCFS, while the pool has them: each gets its
        prompt's blocks and its first token's, so that it can run once its KV lands; the first of them are
        shared from the prefix cache when it holds them (then `num_computed_tokens` counts their tokens, and
        only the KV after them is pulled; never the whole prompt). Requests here that wait without KV
        (preempted ones) go first: blocks freed for them must not go to new imports."""
        reserved = []
        while self.waiting_for_kv and not self._waiting_without_kv():
            req = self.waiting_for_kv[0]
            n = len(req.prompt_token_ids)
            looked_up = self._share_prefix(req, (n - 1) // self.allocator.block_size)
            if not self.allocator.grow(req.block_ids, n + 1, req.max_total_tokens):
                if looked_up:
                    self._drop_kv(req)
                break
            if looked_up:
                self._count_lookup(req, n)
            self.waiting_for_kv.popleft()
            req.move_to(Status.RECEIVING_KV)
            self.receiving_kv[req.request_id] = req
            reserved.append(req)
        return reserved

    def kv_landed(self, req: Request) -> None:
        """A request's KV is in its blocks: it joins the queue with its prompt computed (its full blocks cached)."""
        del self.receiving_kv[req.request_id]
        req.num_computed_tokens = len(req.prompt_token_ids)
        self._commit(req)
        req.move_to(Status.WAITING)
        self.waiting.append(req)

    def kv_lost(self, req: Request) -> None:
        """A request's KV was lost or damaged on the way: it joins the queue and recomputes its prompt (and first
        token) in the blocks it holds, like a preempted request, from the first block it did not share (never
        writing into a block of the prefix cache)."""
        del self.receiving_kv[req.request_id]
        req.num_computed_tokens = req.num_cached_blocks * self.allocator.block_size
        req.move_to(Status.WAITING)
        self.waiting.append(req)

    def hold_for_transfer(self, req: Request) -> None:
        """Prefill node: a request whose first token is out leaves the batch, its KV held for shipping."""
        self.running.remove(req)
        self._rows_of_running = None
        self.rows.remove(req)
        req.move_to(Status.TRANSFERRING)

    # ---- one iteration ------------------------------------------------------------------------
    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        batch = self._steady(budget)
        if batch is not None:  # every running request runs as it is: from the rows, at once
            self.steady_steps += 1
            budget -= sum(batch.columns[1])
            if not (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs):
                return batch
            batch.scheduled = list(batch.scheduled)  # admission appends to it
        else:
            batch, budget = self._one_by_one(budget)
        if not batch.preempted:
            budget = self._admit(batch, budget)
        row_of = self.rows.row_of
        batch.table, batch.rows = self.rows, [row_of[s.request] for s in batch.scheduled]
        batch.owners = self.rows.owner[batch.rows]
        return batch

    def _steady(self, budget: int) -> Batch | None:
        """The running requests' part of a step from their rows, vectorised, when each of them runs as it is: all
        its tokens not yet computed fit the budget with everyone else's, and the pool gives the blocks they need
        without a preemption (only the requests crossing into a new block are looked at, to grow). Scheduling ahead,
        a request whose pending token its next draw needs on the host, or is its last, sits the step out, as one by
        one. None when a request needs more (the budget, a preemption, more than one token pending): then
        `_one_by_one`."""
        if not self.running:
            return None
        t, bs, reqs = self.rows, self.allocator.block_size, self.running
        rows = self._running_rows()  # [N], in running order
        pending, known = t.num_pending[rows], t.known[rows]
        if pending.any():
            if pending.max() > 1:
                return None
            sits = (pending > 0) & (t.guided[rows] | t.processed[rows] | (known + pending >= t.max_tokens[rows]))
            if sits.any():
                reqs, rows, pending, known = list(compress(reqs, ~sits)), rows[~sits], pending[~sits], known[~sits]
        past = t.num_computed_tokens[rows]
        lens = t.prompt_len[rows] + known + pending - past  # [N] tokens to compute
        if not len(rows) or int(lens.sum()) > budget or int(lens.min()) < 1:
            return None
        for i in np.flatnonzero(past + lens > t.num_blocks[rows] * bs).tolist():  # its blocks lack room
            req = reqs[i]
            if not self.allocator.grow(req.block_ids, int(past[i] + lens[i]), req.max_total_tokens):
                return None  # the pool is dry: one by one (what grew stays grown)
            t.grow(req)
        return Batch.of_rows(t, list(reqs), rows, lens)

    def _running_rows(self) -> np.ndarray:
        """The rows of the running requests, in running order (made again when the running requests change)."""
        if self._rows_of_running is None:
            row_of = self.rows.row_of
            self._rows_of_running = np.array([row_of[r] for r in self.running], dtype=np.int64)
        return self._rows_of_running

    def _one_by_one(self, budget: int) -> tuple[Batch, int]:
        """The running requests' part of a step, request by request (any step)."""
        batch = Batch()
        bs, running = self.allocator.block_size, Status.RUNNING
        for req in list(self.running):  # one lean pass: it runs for every running request at every step
            if budget == 0:
                break
            if req.status is not running or (req.num_pending and not self._runs_ahead(req)):  # preempted in this loop
                continue
            past, total = req.num_computed_tokens, len(req.prompt_token_ids) + len(req.output_token_ids)
            total += req.num_pending
            n = total - past if total - past < budget else budget
            if past + n > len(req.block_ids) * bs and not self._reserve(req, n, batch):  # its blocks lack room
                continue
            batch.scheduled.append(ScheduledRequest(req, n, past + n == total, past))
            budget -= n
        return batch, budget

    @staticmethod
    def _runs_ahead(req: Request) -> bool:
        """Whether a running request is scheduled now: always without a pending token; with one, unless its next draw
        needs it on the host or it is its last (max_tokens). At most one step may be in flight unfinished."""
        if req.num_pending == 0:
            return True
        if req.num_pending > 1:
            raise RuntimeError(f"request {req.request_id} has {req.num_pending} tokens pending: finish a step first")
        return not req.waits_for_host and req.num_output_tokens < req.params.max_tokens

    def _admit(self, batch: Batch, budget: int) -> int:
        i = 0  # the first waiting request not waiting for a prefix in flight
        in_flight: set[int] | None = None  # names of the prompt blocks running requests have yet to compute
        while i < min(len(self.waiting), self.max_num_seqs) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if req.num_pending:  # preempted with its last token still on the device: it rejoins once that is known
                break
            looked_up = self._share_prefix(req)
            if looked_up and in_flight is None:
                in_flight = {h for r in self.running for h in self._blocks_to_name(r)}
            if looked_up and self._waits_for_prefix(req, in_flight):
                self._drop_kv(req)
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow_head(req, n):
                if looked_up:
                    self._drop_kv(req)  # the shared blocks go back (evictable) until it is admitted
                break  # FCFS for the pool: nobody overtakes this request for blocks
            if looked_up:
                self._count_lookup(req, req.num_tokens)
            del self.waiting[i]
            req.move_to(Status.RUNNING)
            self.running.append(req)
            self._rows_of_running = None
            self.rows.add(req)
            if in_flight is not None:
                in_flight.update(self._blocks_to_name(req))
            batch.scheduled.append(ScheduledRequest.of(req, n))
            budget -= n
        return budget

    def _waits_for_prefix(self, req: Request, in_flight: set[int]) -> bool:
        """Whether `req` (its cached prefix just matched) should wait: its next WAIT_FOR_PREFIX_BLOCKS blocks are
        among `in_flight`, in the prompt of a running request that has not yet computed them (names chain, so the
        whole prefix up to them is the same). Once they are computed and named, it shares them. The running request
        moves on every step, so the wait ends; if it is preempted or aborted, the wait ends at once."""
        k = req.num_cached_blocks
        if (req.num_tokens - 1) // self.allocator.block_size - k < WAIT_FOR_PREFIX_BLOCKS:
            return False
        return req.block_hashes[k + WAIT_FOR_PREFIX_BLOCKS - 1] in in_flight

    def _blocks_to_name(self, req: Request) -> list[int]:
        """The names of a running request's full prompt blocks it has not yet named (none for one that never names
        its blocks: echo with logprobs, or no caching)."""
        full = len(req.prompt_token_ids) // self.allocator.block_size
        if self.cache_seed is None or req.num_cached_blocks >= full or req.params.prompt_logprobs is not None:
            return []
        return self._hashes(req, full)[req.num_cached_blocks :]

    def _share_prefix(self, req: Request, max_blocks: int | None = None) -> bool:
        """A request without KV takes the cached blocks of its longest cached prefix (at most `max_blocks`; by
        default all but its last token's), as computed tokens; False when it does not look (no caching, it holds
        KV, or it is scored at every prompt position)."""
        if self.cache_seed is None or req.block_ids or req.params.prompt_logprobs is not None:
            return False
        bs = self.allocator.block_size
        limit = (req.num_tokens - 1) // bs if max_blocks is None else max_blocks
        req.block_ids = self.allocator.match(self._hashes(req, limit))
        req.num_cached_blocks = len(req.block_ids)
        req.num_computed_tokens = len(req.block_ids) * bs
        return True

    def _count_lookup(self, req: Request, num_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += req.num_computed_tokens

    def _hashes(self, req: Request, num_blocks: int) -> list[int]:
        """The names of a request's first `num_blocks` full blocks (fewer if the host lacks their tokens yet)."""
        have, bs = len(req.block_hashes), self.allocator.block_size
        if have < num_blocks:
            parent = req.block_hashes[-1] if have else self.cache_seed
            req.block_hashes += block_hashes(req.token_ids(have * bs, num_blocks * bs), bs, parent)
        return req.block_hashes[:num_blocks]

    def _commit(self, req: Request, upto: int | None = None) -> None:
        """Name the full blocks of a request's computed KV (its first `upto` tokens; default: all computed) in the
        prefix cache."""
        if self.cache_seed is None or req.is_finished:
            return
        known = len(req.prompt_token_ids) + len(req.output_token_ids)  # a block is named once its tokens are known
        upto = min(req.num_computed_tokens if upto is None else upto, req.num_computed_tokens, known)
        full = min(upto // self.allocator.block_size, len(req.block_ids))
        if full <= req.num_cached_blocks:  # no new full block (most steps of a decoding request)
            return
        hashes = self._hashes(req, full)
        for i in range(req.num_cached_blocks, len(hashes)):
            self.allocator.commit(req.block_ids[i], hashes[i])
        req.num_cached_blocks = max(req.num_cached_blocks, len(hashes))
        self.rows.cached_changed(req)

    def _grow_head(self, req: Request, n: int) -> bool:
        """Blocks for the head of the queue. With nothing running, waiting requests that hold KV (imported
        from a prefill node, say) give theirs up, newest first, and recompute later: else no one moves."""
        while not self.allocator.grow(req.block_ids, req.num_computed_tokens + n, req.max_total_tokens):
            holders = [r for r in self.waiting if r.block_ids and r is not req]
            if self.running or not holders:
                return False
            self._drop_kv(holders[-1])
        return True

    def _waiting_without_kv(self) -> bool:
        """True when a waiting request has no KV yet (new or preempted): it goes before new imports."""
        return any(not r.block_ids for r in self.waiting)

    def _reserve(self, req: Request, n: int, batch: Batch) -> bool:
        """Grow `req`'s blocks for `n` more tokens, preempting the newest running requests if needed."""
        if req.num_computed_tokens + n <= len(req.block_ids) * self.allocator.block_size:
            return True  # its blocks hold them (most decode steps)
        while not self.allocator.grow(req.block_ids, req.num_computed_tokens + n, req.max_total_tokens):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is req:
                return False
        self.rows.grow(req)
        return True

    def _preempt(self, req: Request, batch: Batch) -> None:
        self.running.remove(req)
        self._rows_of_running = None
        self.rows.remove(req)
        self._drop_kv(req)
        req.move_to(Status.WAITING)
        self.waiting.appendleft(req)
        batch.preempted.append(req)
        self.num_preemptions += 1
        batch.scheduled = [s for s in batch.scheduled if s.request is not req]

    def _drop_kv(self, req: Request) -> None:
        """Free a request's KV; it recomputes it when it runs again."""
        self.allocator.free(req.block_ids)
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0

    # ---- after the forward --------------------------------------------------------------------
    def advance(self, batch: Batch) -> None:
        """Count the computed tokens of every scheduled request, and cache its full blocks (a step launched and
        finished at once)."""
        self.count(batch)
        self.commit_computed(batch)

    def count(self, batch: Batch) -> None:
        """A step is launched: its tokens count as computed (the next step is scheduled after them); in the rows at
        once, for the requests still in the rows they were scheduled in."""
        if batch.table is None:
            for s in batch.scheduled:
                s.request.num_computed_tokens += s.num_new_tokens
            return
        rows, lens, _, _ = batch.arrays
        held = batch.table.owner[rows] == batch.owners  # [R]
        batch.table.num_computed_tokens[rows[held]] += lens[held]
        for i in np.flatnonzero(~held).tolist():
            batch.requests[i].num_computed_tokens += int(lens[i])

    def commit_computed(self, batch: Batch) -> None:
        """A step finished and its sampled tokens are known: name the full blocks it computed in the prefix cache
        (not those of a request preempted since: its KV is gone)."""
        if self.cache_seed is None or not batch:
            return
        bs, reqs, (rows, lens, _, pasts) = self.allocator.block_size, batch.requests, batch.arrays
        upto = pasts + lens  # [R]
        maybe = range(len(reqs))
        if batch.table is not None:  # only the rows that may have filled a block, or changed hands since
            changed = batch.table.owner[rows] != batch.owners
            maybe = np.flatnonzero(changed | (upto // bs > batch.table.cached[rows])).tolist()
        for i in maybe:
            req = reqs[i]
            if upto[i] // bs > req.num_cached_blocks and req.status is not Status.WAITING:  # a new full block
                self._commit(req, int(upto[i]))
