"""What an engine runs on: a model, its KV pool, runner, sampler and grammar support (torch), or the mock's
stand-ins (engine/mock.py, no torch). The engine itself (engine.py) only schedules, counts and hands tokens out, so it
imports neither; `build_parts` imports the side that `--engine` names, and only that side.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pdserve.config import EngineConfig, eos_token_ids, max_model_len
from pdserve.kv.layout import KVLayout

log = logging.getLogger("pdserve.engine")


@dataclass(frozen=True)
class EngineParts:
    guides: Any  # prepare(); attach(request) gives a guided request its matcher (ValueError if it cannot)
    layout: KVLayout
    pool: Any  # .allocator, .num_blocks, .block_size, .checksums(block_ids, num_tokens); the model's holds the KV
    runner: Any  # run(batch) -> (what the sampler draws from (the model's logits), whether a CUDA graph ran it);
    # graph_captures: CUDA graphs captured since start
    sampler: Any  # launch(run's result, sampled requests, scored prompt rows) -> a draw whose wait() gives Drawn
    max_model_len: int
    overlapped: bool  # launch() returns before the step is done (a GPU; the mock, which waits out its step time)
    feeds: bool = False  # the runner reads pending input tokens from the device (`feed`): scheduling ahead works


def build_parts(cfg: EngineConfig, prefill_only: bool, pool_storage=None) -> EngineParts:
    if cfg.engine == "mock":
        from pdserve.engine.mock import mock_parts

        return mock_parts(cfg, prefill_only)
    return model_parts(cfg, prefill_only, pool_storage)


def model_parts(cfg: EngineConfig, prefill_only: bool, pool_storage=None) -> EngineParts:
    """The checkpoint loaded on its device, its pool (in `pool_storage(layout, num_blocks, device)` if given) and a
    runner warmed up to the engine's batch sizes."""
    import torch

    from pdserve.checkpoint import resolve_model
    from pdserve.kv.pool import KVPool
    from pdserve.runner.grammar import Guides
    from pdserve.runner.model import ModelRunner, kv_layout, load_model
    from pdserve.runner.sampling import Sampler

    if cfg.cpu_cores:
        torch.set_num_threads(len(cfg.cpu_cores))
    started = time.perf_counter()
    checkpoint = resolve_model(cfg.model)
    model = load_model(checkpoint, cfg.dtype, cfg.device)
    log.info(
        "loaded the weights of %s (%s on %s) in %.1f s", cfg.model, cfg.dtype, cfg.device, time.perf_counter() - started
    )
    guides = Guides(checkpoint, model.config.vocab_size, eos_token_ids(model.config))
    layout = kv_layout(model, cfg.block_size, cfg.dtype)
    num_blocks = cfg.num_blocks_for(layout.bytes_per_token())
    storage = pool_storage(layout, num_blocks, cfg.device) if pool_storage else None
    pool = KVPool(layout, num_blocks, cfg.device, data=storage)
    started = time.perf_counter()
    runner = ModelRunner(
        model,
        pool,
        cfg.attention_backend,
        cfg.cpu_kernels,
        graphs=not (cfg.enforce_eager or prefill_only),
        max_seqs=cfg.max_num_seqs,
        max_tokens=cfg.max_num_batched_tokens,
    )
    runner.warm_up(cfg.max_num_batched_tokens, cfg.max_num_seqs)
    log.info(
        "built the kernels%s and warmed up in %.1f s (attention: %s; KV pool: %d blocks of %d tokens)",
        " and CUDA graphs" if runner.graphs else "",
        time.perf_counter() - started,
        runner.backend.name,
        num_blocks,
        cfg.block_size,
    )
    overlapped = runner.device.type == "cuda"
    return EngineParts(guides, layout, pool, runner, Sampler(), max_model_len(model.config), overlapped, feeds=True)
