"""The persistent batch: every running request owns a row of preallocated host arrays, updated by diffs.

A step's inputs are gathered from these rows with a few vectorised numpy operations (`runner/model.py`
`ModelRunner.flatten`); a steady decode step writes no row at all, and a step writes only the rows of the
requests that joined, left, or grew a block (vLLM V1's persistent batch, SGLang's req-to-token pool).

What a row holds, one entry per array, indexed by the row:
- `table[row, :num_blocks[row]]`: the request's KV block ids (int32; columns past `num_blocks` are 0, so a
  stale id of a row's previous owner is never in reach of a kernel);
- `last[row]`: its last token the host knows (a decode step's input; a pending one comes from the device);
- `prompt_len[row]`: its prompt's length (which of a step's rows decode);
- `cached[row]`: its first blocks in the prefix cache (which rows may have filled a block to name);
- `num_computed_tokens[row]`, `num_pending[row]`: its counters, owned by the row while the request runs (they
  move in at `add` and back out at `remove`: `RowCounter` in engine/request.py), so that a step counts them for
  every row at once;
- `owner[row]`: a number that changes whenever the row changes hands, so that a step's tokens, taken in
  after the request that sampled them left, never land in the row of the request that took its place;
- its sampling parameters, written once when it takes the row (the sampler gathers a step's from them,
  `runner/sampling.py`): `temperature`, `top_k`, `top_p`, `min_p` (float32 as the device draws with them),
  `greedy`, `key_base` (its seed, or for an unseeded request its id's hash, which the sampler salts) and
  `seeded`, `draw_base` (its prompt's length less its `resumed` tokens: its i-th draw is made with
  `draw_base + i` tokens), `asks` (log-probabilities), and the flags of the rows the per-request path still
  serves: `processed` (logits processors) and `guided` (a grammar);
- its stop conditions, for the engine's vectorised check of a step's tokens (`Engine.update`): `known[row]` its
  output tokens the host knows (counted up by `take_tokens`), `max_tokens[row]`, and `stops[row]` the token ids
  that end it (its stop token ids, and its EOS ids unless it ignores them; -1 pads), `stops_many[row]` when they
  are more than `stops` holds (then the request is checked one by one).

The interface (the scheduler is its only writer, and every request reaches it through the same path):
- `add(req) -> row`: the request starts running (the scheduler admits it to RUNNING: a new request, a
  preempted one back, or one whose KV arrived from a prefill node, by a background copy or otherwise;
  all of them join here and only here, at admission);
- `grow(req)`: its block list grew (the scheduler reserved blocks for its next tokens): the new ids are
  written, nothing else;
- `cached_changed(req)`: the scheduler named more of its blocks in the prefix cache;
- `remove(req)`: it stops running (finished, aborted, preempted, held for a KV transfer); its row is free;
- `take_tokens(rows, owners, tokens)`: a step's sampled tokens, in bulk: `last` and `known` of every row still
  held by the request that sampled it.
`writes` counts the rows written by add, grow and remove since start (tests read it: a steady step adds none).
Torch-free: the engine's control core and the mock engine use it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.engine.request import Request

STOP_COLUMNS = 4  # stop token ids a row holds (`stops`); a request with more is checked one by one


class BatchRows:
    """Rows of up to `capacity` running requests; block tables widen (doubling) as requests grow."""

    def __init__(self, capacity: int, width: int = 16) -> None:
        self.capacity = capacity
        self.table = np.zeros((capacity, width), dtype=np.int32)  # [R, W] block ids
        self.num_blocks = np.zeros(capacity, dtype=np.int64)  # [R] block ids held in `table`
        self.last = np.zeros(capacity, dtype=np.int64)  # [R] last known token
        self.prompt_len = np.zeros(capacity, dtype=np.int64)  # [R] prompt tokens
        self.cached = np.zeros(capacity, dtype=np.int64)  # [R] its first blocks in the prefix cache
        self.owner = np.zeros(capacity, dtype=np.int64)  # [R] changes each time the row changes hands
        self.num_computed_tokens = np.zeros(capacity, dtype=np.int64)  # [R] the request's counters, while it runs
        self.num_pending = np.zeros(capacity, dtype=np.int64)  # [R]
        self.temperature = np.zeros(capacity, dtype=np.float32)  # [R] sampling parameters, from here on
        self.top_k = np.zeros(capacity, dtype=np.int64)
        self.top_p = np.ones(capacity, dtype=np.float32)
        self.min_p = np.zeros(capacity, dtype=np.float32)
        self.greedy = np.ones(capacity, dtype=bool)
        self.key_base = np.zeros(capacity, dtype=np.uint64)
        self.seeded = np.zeros(capacity, dtype=bool)
        self.draw_base = np.zeros(capacity, dtype=np.int64)
        self.processed = np.zeros(capacity, dtype=bool)
        self.guided = np.zeros(capacity, dtype=bool)
        self.asks = np.zeros(capacity, dtype=bool)  # [R] it asks for its tokens' log-probabilities
        self.known = np.zeros(capacity, dtype=np.int64)  # [R] output tokens the host knows
        self.max_tokens = np.zeros(capacity, dtype=np.int64)  # [R]
        self.stops = np.full((capacity, STOP_COLUMNS), -1, dtype=np.int64)  # [R, K] token ids that end it; -1 pads
        self.stops_many = np.zeros(capacity, dtype=bool)  # [R] more stop ids than `stops` holds
        self.row_of: dict[Request, int] = {}
        self.scoring: set[Request] = set()  # those whose prompt positions are scored (echo with logprobs)
        self._free = list(range(capacity - 1, -1, -1))  # the lowest row first
        self._owners = 0
        self.writes = 0  # rows written (add, grow, remove) since start

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, req: Request) -> bool:
        return req in self.row_of

    def add(self, req: Request) -> int:
        """A request starts running: it takes a free row, written with its blocks and last known token."""
        if req in self.row_of:
            raise ValueError(f"request {req.request_id} already holds a row")
        if not self._free:
            raise RuntimeError(f"every one of the {self.capacity} rows is held")
        row = self._free.pop()
        req.enter_row(self, row)  # its row owns its counters from now on
        self.row_of[req] = row
        if req.params.prompt_logprobs is not None:
            self.scoring.add(req)
        self._owners += 1
        self.owner[row] = self._owners
        known = req.output_token_ids or req.prompt_token_ids
        self.last[row] = known[-1] if known else 0
        self.prompt_len[row] = len(req.prompt_token_ids)
        self.known[row] = len(req.output_token_ids)
        self.cached[row] = req.num_cached_blocks
        self.num_blocks[row] = 0
        self._write_params(req, row)
        self._write_blocks(req, row)
        return row

    def grow(self, req: Request) -> None:
        """A running request's block list grew: write its new block ids (no-op for one without a row)."""
        row = self.row_of.get(req)
        if row is not None and len(req.block_ids) != self.num_blocks[row]:
            self._write_blocks(req, row)

    def cached_changed(self, req: Request) -> None:
        """More of a request's first blocks are in the prefix cache (no-op for one without a row)."""
        row = self.row_of.get(req)
        if row is not None:
            self.cached[row] = req.num_cached_blocks

    def remove(self, req: Request) -> None:
        """A request stops running; its row is cleared and free (no-op for one without a row)."""
        row = self.row_of.pop(req, None)
        if row is None:
            return
        req.leave_row()  # its counters go back to it
        self.scoring.discard(req)
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._owners += 1
        self.owner[row] = self._owners
        self._free.append(row)
        self.writes += 1

    def take_tokens(self, rows: np.ndarray, owners: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """A step's sampled `tokens` of rows `rows` (held then by `owners`): each row still so held learns its token.
        Returns which were still so held ([S] bool)."""
        same = self.owner[rows] == owners
        held = rows[same]
        self.last[held] = tokens[same]
        self.known[held] += 1
        return same

    def _write_params(self, req: Request, row: int) -> None:
        p = req.params
        self.temperature[row], self.top_k[row], self.top_p[row], self.min_p[row] = (
            p.temperature,
            p.top_k,
            p.top_p,
            p.min_p,
        )
        self.greedy[row], self.processed[row], self.guided[row] = p.greedy, p.processed, req.guide is not None
        self.seeded[row], self.asks[row] = p.seed is not None, p.logprobs is not None
        self.key_base[row] = (p.seed if p.seed is not None else hash(req.request_id)) & 0xFFFFFFFFFFFFFFFF
        self.draw_base[row] = len(req.prompt_token_ids) - p.resumed
        self.max_tokens[row] = p.max_tokens
        stops = (*p.stop_token_ids, *(() if p.ignore_eos else p.eos_token_ids))
        self.stops_many[row] = len(stops) > STOP_COLUMNS
        self.stops[row] = -1
        self.stops[row, : min(len(stops), STOP_COLUMNS)] = stops[:STOP_COLUMNS]

    def _write_blocks(self, req: Request, row: int) -> None:
        blocks, have = req.block_ids, int(self.num_blocks[row])
        if len(blocks) > self.table.shape[1]:
            wider = np.zeros((self.capacity, max(len(blocks), 2 * self.table.shape[1])), dtype=np.int32)
            wider[:, : self.table.shape[1]] = self.table
            self.table = wider
        if len(blocks) < have:  # never while running; kept exact all the same
            self.table[row, len(blocks) : have] = 0
            have = 0
        self.table[row, have : len(blocks)] = blocks[have:]
        self.num_blocks[row] = len(blocks)
        self.writes += 1


@dataclass
class DrawRows:
    """A step's sampling requests in the persistent batch: the sampler reads their parameters from the rows' arrays,
    vectorised, instead of from each request."""

    table: BatchRows
    rows: np.ndarray  # [S] each sampling request's row
    num_tokens: np.ndarray  # [S] its tokens (prompt, output, pending) when its draw is made
