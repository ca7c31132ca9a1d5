"""The engine: one iteration is schedule() -> run(batch) -> update(batch, logits).

Shared by all three node roles. A prefill-only engine stops each request after its first token
and parks it in TRANSFERRING, KV held, for the prefill node to ship. A step that raises (a kernel
error, a bad input that slipped through) fails the requests of that step with the error and frees
their KV; the engine, and the node around it, keep serving.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_allocator import blocks_for
from pdserve.engine.checkpoint import resolve_model
from pdserve.engine.kv_cache import KVPool
from pdserve.engine.model import ModelRunner, kv_layout, load_model, max_model_len
from pdserve.engine.request import Request, Status
from pdserve.engine.sampling import Drawn, Sampler, TokenLogprob, finish_reason
from pdserve.engine.scheduler import Batch, Scheduler
from pdserve.wire.protocol import ErrorCode, FinishReason, Role, kv_tokens_needed

log = logging.getLogger("pdserve.engine")


@dataclass(frozen=True)
class TokenOutput:
    request: Request
    token_id: int | None  # None when the step failed
    finish_reason: FinishReason | None  # ERROR: `error` and `error_code` say why; None: it goes on
    error: str = ""
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # echo with logprobs: prompt tokens 1.., on the first token
    error_code: ErrorCode | None = None  # with finish_reason "error"


def pin_process(cfg: EngineConfig) -> None:
    """Pin this process to its cores and size torch's thread pool to them."""
    if cfg.cpu_cores:
        os.sched_setaffinity(0, cfg.cpu_cores)
        torch.set_num_threads(len(cfg.cpu_cores))


class Engine:
    def __init__(self, cfg: EngineConfig, prefill_only: bool = False, pool_storage=None) -> None:
        self.cfg = cfg
        self.prefill_only = prefill_only
        self.model = load_model(resolve_model(cfg.model), cfg.dtype, cfg.device)
        self.layout = kv_layout(self.model, cfg.block_size, cfg.dtype)
        num_blocks = cfg.num_blocks_for(self.layout.bytes_per_token())
        storage = pool_storage(self.layout, num_blocks, cfg.device) if pool_storage else None
        self.pool = KVPool(self.layout, num_blocks, cfg.device, data=storage)
        self.scheduler = Scheduler(self.pool.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.pool, cfg.attention_backend, cfg.cpu_kernels,
                                  graphs=not (cfg.enforce_eager or prefill_only), max_batch=cfg.max_num_seqs)
        self.sampler = Sampler()
        self.max_model_len = max_model_len(self.model.config)
        self.requests: dict[str, Request] = {}

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
        prefill node will send: the scheduler reserves its blocks (`reserve_remote`), then it lands."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    # ---- KV across nodes ----------------------------------------------------------------------
    def reserve_remote(self) -> list[Request]:
        """Requests waiting for remote KV that now hold blocks for it: their KV may be pulled."""
        return self.scheduler.reserve_remote()

    def waiting_for_kv(self) -> list[Request]:
        """Requests still queued for blocks, oldest first."""
        return list(self.scheduler.waiting_for_kv)

    def receive_kv(self, req: Request, backend, header, frames, source) -> int:
        """Land part of a request's KV (RECEIVING_KV) in its blocks; return how many layers it carried."""
        return backend.unpack(self.pool, req.block_ids, len(req.prompt_token_ids), header, frames, source)

    def kv_landed(self, req: Request, backend) -> None:
        """Every layer is in: once the copies have read the sender's memory, the request joins the queue."""
        backend.wait_landed(self.pool)
        self.scheduler.kv_landed(req)

    def send_kv(self, req: Request, backend):
        """A held request's KV for shipping: (header, frames) messages from the backend."""
        return backend.pack(self.pool, req.request_id, req.block_ids, len(req.prompt_token_ids))

    def kv_stats(self) -> tuple[int, int, int]:
        """(blocks used, blocks free, tokens the pool holds)."""
        alloc = self.pool.allocator
        return alloc.num_used, alloc.num_free, self.pool.num_blocks * self.pool.block_size

    def num_preemptions(self) -> int:
        """Preemptions since start."""
        return self.scheduler.num_preemptions

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.scheduler.running), len(self.scheduler.waiting) + len(self.scheduler.waiting_for_kv)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.release(req, Status.ABORTED)
        return req

    def release(self, req: Request, status: Status) -> None:
        """End a request for good: out of the queues, KV freed."""
        self.scheduler.finish(req, status)
        self.requests.pop(req.request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one iteration ------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        sampled = [s.request for s in batch.scheduled if s.samples]
        scored = [(req, req.prompt_token_ids[pos + 1]) for _, req, pos in batch.prompt_logprob_rows()]
        try:
            drawn = self.sampler(self.runner.run(batch), sampled, scored)
        except Exception as e:  # noqa: BLE001 - one bad step must not take the node down
            log.exception("a step of %d requests failed", len(batch.scheduled))
            return self.fail(batch, f"the engine raised an error while running this request: {type(e).__name__}: {e}")
        return self.update(batch, drawn, [req for req, _ in scored])

    def fail(self, batch: Batch, why: str) -> list[TokenOutput]:
        """End every request of a failed step with an error; their KV is freed."""
        for s in batch.scheduled:
            self.release(s.request, Status.ABORTED)
        error = FinishReason.ERROR
        return [TokenOutput(s.request, None, error, why, error_code=ErrorCode.INTERNAL) for s in batch.scheduled]

    def update(self, batch: Batch, drawn: Drawn, scored: list[Request] = ()) -> list[TokenOutput]:
        """Count the step's computed tokens and take in its sampled ones (one per sampled request), and the scores of
        the prompt rows (`scored`: the request of each)."""
        self.scheduler.advance(batch)
        for req, lp in zip(scored, drawn.prompt_logprobs, strict=True):
            req.prompt_logprobs.append(lp)
        sampled = [s.request for s in batch.scheduled if s.samples]
        outputs = []
        for req, token, lp in zip(sampled, drawn.tokens, drawn.logprobs, strict=True):
            req.output_token_ids.append(token)
            reason = finish_reason(req, req.params, self.max_model_len)
            if reason:
                self.release(req, Status.FINISHED)
            elif self.prefill_only:
                self.scheduler.hold_for_transfer(req)
            first = req.params.prompt_logprobs is not None and len(req.output_token_ids) == 1
            echo = req.prompt_logprobs if first else None
            outputs.append(TokenOutput(req, token, reason, logprob=lp, prompt_logprobs=echo))
        return outputs
