"""The engine: one iteration is schedule() -> run(batch) -> update(batch, logits).

Shared by all three node roles. A prefill-only engine stops each request after its first token
and parks it in TRANSFERRING, KV held, for the prefill node to ship. A step that raises (a kernel
error, a bad input that slipped through) fails the requests of that step with the error and frees
their KV; the engine, and the node around it, keep serving.

An iteration is two calls, so that the node's host work runs while the device computes:
`launch()` schedules, builds the inputs and queues the forward, the sampling and the copy of the
sampled ids to the host; `finish(step)` waits for those ids and takes them in (`update`). On a GPU,
launch returns while the device works (`overlapped`); on the CPU it returns with the work done. Between
the two, requests may come and go: one aborted meanwhile gets no output from the step, and its blocks
go back to the pool only at finish, once the device is done writing them. `step()` is both at once.

Asynchronous scheduling (`--async-scheduling`, docs/async-scheduling.md): `launch()` may be called once more
while a step is in flight, so that step N+1 is scheduled, packed and queued while the device runs step N; then
`finish(N)`, `launch()` (N+2), `finish(N+1)`... A request sampled by N is scheduled in N+1 with its input token
read from N's sampled ids on the device (`DeviceFeed`); the host learns the token at N's finish. A request that
N ends (EOS, a stop token) costs one wasted row in N+1, whose token is dropped. Steps finish in launch order.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import compress, count
from typing import Any

import numpy as np

from pdserve.config import EngineConfig
from pdserve.engine.draws import Drawn, TokenLogprob, finish_reason
from pdserve.engine.parts import EngineParts
from pdserve.engine.request import Request, Status
from pdserve.engine.rows import DrawRows
from pdserve.engine.scheduler import Batch, Scheduler, group_counts
from pdserve.kv.backend import KvBackend, Message
from pdserve.kv.block_allocator import blocks_for
from pdserve.wire.messages import KvData
from pdserve.wire.params import ErrorCode, FinishReason, Role, chain_seed, kv_tokens_needed

log = logging.getLogger("pdserve.engine")

RUN_COUNTERS = tuple(f"{kind}_{n}" for kind in ("graph", "eager") for n in ("steps", "tokens", "decode_tokens"))


@dataclass(slots=True)
class TokenOutput:
    request: Request
    token_id: int | None  # None when the step failed
    finish_reason: FinishReason | None  # ERROR: `error` and `error_code` say why; None: it goes on
    error: str = ""
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # echo with logprobs: prompt tokens 1.., on the first token
    error_code: ErrorCode | None = None  # with finish_reason "error"


@dataclass
class Step:
    """One iteration between `launch()` and `finish()`."""

    batch: Batch
    scored: list[Request]  # the request of each prompt row scored (echo with logprobs)
    draw: object | None  # its sampling, queued on the device (`wait()` gives the Drawn); None when launching failed
    error: str = ""  # why it failed
    parked: list[list[int]] = field(default_factory=list)  # blocks of members released while it runs: freed at finish
    rows: np.ndarray = field(init=False)  # [S] the persistent row of each sampling request (engine/rows.py)
    owners: np.ndarray = field(init=False)  # [S] who held those rows at launch
    draw_rows: DrawRows | None = field(init=False, default=None)  # where the sampler finds their parameters

    def __post_init__(self) -> None:
        if self.batch.table is None:  # a batch built by hand: no rows
            self.rows = self.owners = np.zeros(0, dtype=np.int64)
            return
        rows, lens, mask, pasts = self.batch.arrays  # [R] each; mask: the sampling ones
        self.rows, self.owners = rows[mask], self.batch.owners[mask]
        self.draw_rows = DrawRows(self.batch.table, self.rows, (pasts + lens)[mask])

    @functools.cached_property
    def members(self) -> set[Request]:
        """The batch's requests (made when first asked: a request leaves while the step runs)."""
        return set(self.batch.requests)

    @functools.cached_property
    def sampled(self) -> dict[Request, int]:
        """Each sampling request's row in the draw."""
        return dict(zip(compress(self.batch.requests, self.batch.samples), count()))


class DeviceLost(RuntimeError):
    """The engine's device can run no more steps: the node exits rather than fail every request sent to it."""


def device_lost(e: BaseException) -> bool:
    """Whether an error may have left the device unusable: a CUDA error (an illegal address, a device-side assert, a
    launch failure) can poison the process's CUDA context, so that every later step fails as well; running out of
    memory does not, nor does an error of the host's. The engine then asks the runner whether the device still works
    (`device_works`): a launch refused for its arguments is a CUDA error too, and leaves it working."""
    text = f"{type(e).__name__}: {e}"
    if "OutOfMemoryError" in text or "out of memory" in text:
        return False
    return type(e).__name__ == "AcceleratorError" or "CUDA error" in text or "Triton Error [CUDA]" in text


def pin_process(cfg: EngineConfig) -> None:
    """Pin this process to its cores (a model engine sizes torch's thread pool to them)."""
    if cfg.cpu_cores:
        os.sched_setaffinity(0, cfg.cpu_cores)


def checksum_mismatch(got: list[int], want: list[int], layers: list[int] | None = None) -> str:
    """Why per-layer checksums `got` (here) differ from `want` (the sender's), of the layers `layers` (default:
    every layer, in order); "" when they agree or `got` is []."""
    if not got or got == want:
        return ""
    bad = [i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b]
    i = bad[0] if bad else min(len(got), len(want))
    return f"KV checksum mismatch in layer {layers[i] if layers and i < len(layers) else i}"


class Engine:
    def __init__(self, cfg: EngineConfig, parts: EngineParts, prefill_only: bool = False) -> None:
        """An engine over `parts` (the model's, or the mock's: pdserve/nodes/parts.py builds them)."""
        self.cfg = cfg
        self.prefill_only = prefill_only
        self.guides, self.layout, self.pool = parts.guides, parts.layout, parts.pool
        self.runner, self.sampler, self.max_model_len = parts.runner, parts.sampler, parts.max_model_len
        seed = chain_seed(self.layout.model_fingerprint) if cfg.prefix_caching else None
        self.scheduler = Scheduler(self.pool.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens, seed)
        self.requests: dict[str, Request] = {}
        self.in_flight: list[Step] = []  # launched, not finished, oldest first (two at most, scheduling ahead)
        self.lost: str | None = None  # the error that left the device unusable (`device_lost`), once one has
        self.overlapped = parts.overlapped  # launch() returns before the device (or the mock's step) is done
        self.ahead = cfg.schedules_ahead and parts.feeds and not prefill_only  # schedule N+1 before N's tokens
        self.steps_ahead = 0  # since start: steps launched while another was in flight
        self.run_counts = dict.fromkeys(RUN_COUNTERS, 0)  # since start: steps and tokens, by how the forward ran

    # ---- requests -----------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> str:
        """Why a request can never run here ("" when it can)."""
        total = kv_tokens_needed(Role.PREFILL if self.prefill_only else Role.COLOCATED, num_prompt_tokens, max_tokens)
        need = blocks_for(min(total, self.max_model_len), self.pool.block_size)
        if need > self.pool.num_blocks:
            return f"the request needs {need} KV blocks but the pool has {self.pool.num_blocks}"
        return ""

    def add(self, req: Request) -> None:
        """A new request, or (status WAITING_FOR_KV, its first token as output) one whose prompt's KV a
        prefill node will send: the scheduler reserves its blocks (`reserve_remote`), then it lands. A guided request
        gets its grammar's matcher here, over the tokens it has (GrammarError, a ValueError, if it cannot)."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        self.guides.attach(req)
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    # ---- KV across nodes ----------------------------------------------------------------------
    def reserve_remote(self) -> list[Request]:
        """Requests waiting for remote KV that now hold blocks for it: their KV may be pulled."""
        return self.scheduler.reserve_remote()

    def waiting_for_kv(self) -> list[Request]:
        """Requests still queued for blocks, oldest first."""
        return list(self.scheduler.waiting_for_kv)

    def first_block_to_pull(self, req: Request) -> int:
        """A RECEIVING_KV request's first prompt block whose KV it lacks (those before came from the prefix cache)."""
        return req.num_computed_tokens // self.pool.block_size

    def receive_kv(self, req: Request, backend: KvBackend, header: KvData, frames: list, source: Any | None) -> int:
        """Land part of a request's KV (RECEIVING_KV) in its blocks; return how many layers it carried."""
        blocks, num_tokens = self.prompt_kv(req, self.first_block_to_pull(req))
        return backend.unpack(self.pool, blocks, num_tokens, header, frames, source)

    def kv_landed(
        self,
        req: Request,
        backend: KvBackend,
        checksums: list[int],
        got: list[int] | None = None,
        layers: list[int] | None = None,
    ) -> str:
        """Every layer is in: once the copies have read the sender's memory, the KV is checked against the sender's
        per-layer `checksums` of what it sent ([]: none to check). If it matches, the request joins the queue and ""
        is returned; else why not, and the request stays RECEIVING_KV (then `kv_lost` or `abort`): never decoded
        from. `got`: the checksums of what landed, taken by a copy that is done (see kv/copier.py); `layers`: the
        layers the checksums are of (default: every layer, in order)."""
        if got is None:
            backend.wait_landed(self.pool)
            got = self.kv_checksums(req, self.first_block_to_pull(req)) if checksums else []
        why = checksum_mismatch(got, checksums, layers) if checksums else ""
        if not why:
            self.scheduler.kv_landed(req)
        return why

    def prompt_kv(self, req: Request, first_block: int) -> tuple[list[int], int]:
        """The blocks holding a request's prompt KV from block `first_block` on, and how many tokens of it."""
        return req.block_ids[first_block:], len(req.prompt_token_ids) - first_block * self.pool.block_size

    def kv_checksums(self, req: Request, first_block: int = 0, layers: list[int] | None = None) -> list[int]:
        """A CRC-32 per layer (of `layers`, default all) of a request's prompt KV from block `first_block` on, as it
        lies in the pool ([] for a pool off the CPU)."""
        return self.pool.checksums(*self.prompt_kv(req, first_block), layers)

    def copied_checksums(
        self, req: Request, prefix: tuple[Any, list[int]], layers: list[int] | None = None
    ) -> list[int]:
        """kv_checksums of a request whose KV from its first block to pull on was copied here, its blocks before (those
        of our prefix cache) as another pool holds them (`prefix`: that pool's storage, its block ids)."""
        copied = self.prompt_kv(req, self.first_block_to_pull(req))[0]
        return self.pool.checksums_after(prefix, copied, len(req.prompt_token_ids), layers)

    def copy_matches(self, req: Request, source: Any, src_blocks: list[int]) -> bool:
        """Whether a request's blocks copied out of a shared pool (from its first block to pull on) hold what
        `src_blocks` of that pool's storage `source` hold, byte for byte (True for a pool off the CPU: not checked)."""
        if self.pool.data.device.type != "cpu":
            return True
        copied = self.prompt_kv(req, self.first_block_to_pull(req))[0][: len(src_blocks)]
        return self.pool.holds_copy(source, list(src_blocks), copied)

    def kv_lost(self, req: Request) -> None:
        """A RECEIVING_KV request whose KV was lost or damaged: it waits to recompute its prompt here."""
        self.scheduler.kv_lost(req)

    def send_kv(self, req: Request, backend: KvBackend, first_block: int = 0) -> Iterator[Message]:
        """A held request's prompt KV from block `first_block` on, for shipping: (header, frames) messages from the
        backend."""
        return backend.pack(self.pool, req.request_id, *self.prompt_kv(req, first_block))

    def kv_stats(self) -> tuple[int, int, int]:
        """(blocks used, blocks free, tokens the pool holds)."""
        alloc = self.pool.allocator
        return alloc.num_used, alloc.num_free, self.pool.num_blocks * self.pool.block_size

    def num_preemptions(self) -> int:
        """Preemptions since start."""
        return self.scheduler.num_preemptions

    def cache_counters(self) -> dict[str, int]:
        """The prefix cache since start: tokens looked up and tokens found (vLLM's names), blocks evicted."""
        s = self.scheduler
        return {
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_evictions": self.pool.allocator.num_evicted,
        }

    def follow_cache(self) -> None:
        """Record the prefix cache's changes from now on, for `cache_changes` (the router's view of the cache)."""
        self.pool.allocator.changes = {}

    def cache_changes(self, whole: bool) -> tuple[list[int], list[int]]:
        """(names stored, names evicted) in the prefix cache since the last call; with `whole`, every name cached now
        and none evicted."""
        stored, evicted = self.pool.allocator.take_changes()
        return (self.pool.allocator.cached_names(), []) if whole else (stored, evicted)

    def count_run(self, batch: Batch, graphed: bool) -> None:
        kind = "graph" if graphed else "eager"
        for name, n in (("steps", 1), ("tokens", batch.num_tokens), ("decode_tokens", batch.num_decode_tokens)):
            self.run_counts[f"{kind}_{name}"] += n

    @staticmethod
    def floor_counts(batch: Batch | None, seconds: float) -> dict[str, float]:
        """A finished step's counts under its floor group's counter names (`group_counts`); with no batch, every
        group's counters at zero."""
        return group_counts(batch, seconds)

    def run_counters(self) -> dict[str, int]:
        """Since start: the steps, tokens and decode tokens computed by a replayed CUDA graph (graph_*) and by an eager
        forward (eager_*), and the graphs captured."""
        return {**self.run_counts, "graph_captures": self.runner.graph_captures}

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.scheduler.running), len(self.scheduler.waiting) + len(self.scheduler.waiting_for_kv)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.release(req, Status.ABORTED)
        return req

    def release(self, req: Request, status: Status) -> None:
        """End a request for good: out of the queues, KV freed (once the step in flight, if it holds it, is done)."""
        holder = next((st for st in reversed(self.in_flight) if req in st.members), None)
        if holder is not None:  # the last step that writes its KV frees its blocks when it is done
            holder.parked.append(req.block_ids)
            req.block_ids = []
        self.scheduler.finish(req, status)
        self.requests.pop(req.request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one iteration ------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """One whole iteration."""
        return self.finish(self.launch())

    def launch(self) -> Step | None:
        """Schedule an iteration and queue its forward, sampling and copy back on the device; None when nothing
        runs. On a GPU it returns while the device computes; on the CPU, once it has. Scheduling ahead, one step may
        be in flight already."""
        if len(self.in_flight) > int(self.ahead):
            raise RuntimeError("launch() while a step is in flight: finish() it first")
        batch = self.scheduler.schedule()
        if not batch:
            return None
        sampled = list(compress(batch.requests, batch.samples))
        scored = [(req, req.prompt_token_ids[pos + 1]) for _, req, pos in batch.prompt_logprob_rows()]
        step = Step(batch, [req for req, _ in scored], None)
        try:
            logits, graphed = self.runner.run(batch, *self.feed(batch))
            step.draw = self.sampler.launch(logits, sampled, scored, step.draw_rows)
        except Exception as e:  # noqa: BLE001 - one bad step must not take the node down
            step.error = self.step_error(batch, e)
        else:
            self.count_run(batch, graphed)
            self.scheduler.count(batch)
            if batch.table is not None:  # in the rows, at once (every sampling request holds its row now)
                batch.table.num_pending[step.rows] += 1
            else:
                for req in sampled:
                    req.num_pending += 1
        self.steps_ahead += bool(self.in_flight)
        self.in_flight.append(step)
        return step

    def due(self, launched: Step | None) -> Step | None:
        """The step to finish after `launched` (this iteration's launch): that one, or, scheduling ahead, the step
        launched before it (None right after the first launch: it finishes after the next one)."""
        if not self.ahead:
            return launched
        if len(self.in_flight) > 1 or (launched is None and self.in_flight):
            return self.in_flight[0]
        return None

    def feed(self, batch: Batch) -> tuple:
        """The runner's extra argument: the rows whose input token is pending, read from the step in flight's
        sampled ids on the device (`DeviceFeed`); () when there are none."""
        prev = self.in_flight[-1] if self.in_flight else None
        if prev is None:  # nothing in flight: every input token is known
            return ()
        if batch.table is not None and prev.draw is not None:
            rows, index = self.pending_rows(batch, prev)
            return (self.runner.feed(prev.draw, rows, index),) if len(rows) else ()
        rows, index, row = [], [], 0
        for s in batch.scheduled:
            row += s.num_new_tokens
            if s.request.num_pending:  # its last input token is the one the step in flight samples
                rows.append(row - 1)
                index.append(prev.sampled[s.request])
        if not rows:
            return ()
        if prev.draw is None:
            raise RuntimeError("the step in flight failed to launch: its tokens cannot feed the next")
        return (self.runner.feed(prev.draw, rows, index),)

    @staticmethod
    def pending_rows(batch: Batch, prev: Step) -> tuple[np.ndarray, np.ndarray]:
        """(input rows of `batch`, their index in `prev`'s draw) of the requests `prev` (the step in flight) samples,
        matched by their persistent rows, vectorised: a request sampled by the step in flight is the one whose token
        is pending (it cannot leave and come back while it is)."""
        table = batch.table
        draw_of = np.full(table.capacity, -1, dtype=np.int64)  # [rows] each row's index in prev's draw
        held = table.owner[prev.rows] == prev.owners  # [S'] rows still held by the request prev sampled
        draw_of[prev.rows[held]] = np.flatnonzero(held)
        index = draw_of[np.asarray(batch.rows, dtype=np.int64)]  # [R]
        ends = np.cumsum(batch.columns[1])  # [R] each request's last input row, + 1
        fed = index >= 0
        return ends[fed] - 1, index[fed]

    def finish(self, step: Step | None) -> list[TokenOutput]:
        """Wait for a launched step's tokens and take them in: an output per sampled request still here. Steps
        finish in the order they were launched."""
        if step is None:
            return []
        if step is not self.in_flight[0]:
            raise RuntimeError("finish() the oldest step in flight first")
        try:
            drawn = step.draw.wait() if step.draw is not None else None
        except Exception as e:  # noqa: BLE001 - a device error surfaces here, when the step is waited for
            drawn, step.error = None, self.step_error(step.batch, e)
        self.in_flight.pop(0)
        for blocks in step.parked:
            self.pool.allocator.free(blocks)
        if drawn is None:
            return self.fail(step.batch, step.error)
        if step.batch.table is None:
            return self.update(step.batch, drawn, step.scored)
        tokens, table = np.asarray(drawn.tokens, dtype=np.int64), step.batch.table  # [S]
        held = table.take_tokens(step.rows, step.owners, tokens)  # every sampling row learns its token
        table.num_pending[step.rows[held]] -= 1
        if not held.all():  # those that left their row since: their own counts
            sampled = list(compress(step.batch.requests, step.batch.samples))
            for i in np.flatnonzero(~held).tolist():
                sampled[i].num_pending -= 1
        return self.update(step.batch, drawn, step.scored, self.looked_at(step, held, tokens))

    def looked_at(self, step: Step, held: np.ndarray, tokens: np.ndarray) -> list[bool]:
        """Which of a step's sampling requests `update` takes in one by one ([S]): those that stop now (a stop or EOS
        token, max_tokens, the model's context), checked at once over their rows; those no longer holding their row
        (ended, preempted); and those that need more than their token appended (a grammar, their first token: the
        prompt's scores, a prefill node's hand-off, too many stop ids for their row)."""
        if self.prefill_only:
            return [True] * len(tokens)
        t, r = step.batch.table, step.rows
        known = t.known[r]  # [S] output tokens, this step's included (for the rows still held)
        ends = (t.stops[r] == tokens[:, None]).any(axis=1)  # [S]
        ends |= (known >= t.max_tokens[r]) | (t.prompt_len[r] + known >= self.max_model_len)
        return (ends | ~held | (known <= 1) | t.guided[r] | t.stops_many[r]).tolist()

    def step_error(self, batch: Batch, e: Exception) -> str:
        log.exception("a step of %d requests failed", len(batch.scheduled))
        if device_lost(e) and not getattr(self.runner, "device_works", lambda: True)():
            self.lost = self.lost or f"{type(e).__name__}: {e}"
        return f"the engine raised an error while running this request: {type(e).__name__}: {e}"

    def fail(self, batch: Batch, why: str) -> list[TokenOutput]:
        """End every request of a failed step with an error (those still here); their KV is freed."""
        failed = [s.request for s in batch.scheduled if not s.request.is_finished]
        for req in failed:
            self.release(req, Status.ABORTED)
        error = FinishReason.ERROR
        return [TokenOutput(req, None, error, why, error_code=ErrorCode.INTERNAL) for req in failed]

    def update(
        self, batch: Batch, drawn: Drawn, scored: list[Request] = (), looked_at: list[bool] | None = None
    ) -> list[TokenOutput]:
        """Count the step's computed tokens and take in its sampled ones (one per sampled request), and the scores of
        the prompt rows (`scored`: the request of each). The step's tokens were counted as computed at its launch.
        `looked_at` ([S], from the rows: `looked_at()`): the requests taken in one by one (`take_token`); every other
        one goes on, its token appended; their pending counts were taken down (`finish`). Without it, each request is
        looked at, and its pending count taken down here."""
        self.scheduler.commit_computed(batch)
        for req, lp in zip(scored, drawn.prompt_logprobs, strict=True):
            req.prompt_logprobs.append(lp)
        sampled = compress(batch.requests, batch.samples)
        slow = looked_at
        if looked_at is None:
            sampled, slow = list(sampled), [True] * len(drawn.tokens)
            for req in sampled:
                req.num_pending -= 1
        outputs = []
        for req, token, lp, one in zip(sampled, drawn.tokens, drawn.logprobs, slow, strict=True):  # one lean pass
            if not one:
                req.output_token_ids.append(token)
                outputs.append(TokenOutput(req, token, None, "", lp))
            elif (out := self.take_token(req, token, lp)) is not None:
                outputs.append(out)
        return outputs

    def take_token(self, req: Request, token: int, lp: TokenLogprob | None) -> TokenOutput | None:
        """Take in a request's sampled token, looking at it (whether it stops, its grammar, the prompt's scores); None
        for one that ended before it came (aborted while the step ran, or ended by the step before): dropped."""
        if req.status in (Status.FINISHED, Status.ABORTED):
            return None
        req.output_token_ids.append(token)
        if req.guide is not None:
            req.guide.advance(token)
        params = req.params
        reason = finish_reason(req, params, self.max_model_len)
        if reason:
            self.release(req, Status.FINISHED)
        elif self.prefill_only:
            self.scheduler.hold_for_transfer(req)
        echo = None
        if params.prompt_logprobs is not None and len(req.output_token_ids) == 1:
            echo = req.prompt_logprobs  # the prompt's scores, with the first token
        return TokenOutput(req, token, reason, "", lp, echo)
