"""A node's engine and the parts it runs on: the model's (torch; pdserve/runner/) or the mock's (no torch), only the
side that `--engine` names imported."""

from __future__ import annotations

import logging
import time

from pdserve.config import EngineConfig, eos_token_ids, max_model_len
from pdserve.engine.engine import Engine
from pdserve.engine.parts import EngineParts

log = logging.getLogger("pdserve.engine")


def build_engine(cfg: EngineConfig, prefill_only: bool = False, pool_storage=None) -> Engine:
    """An engine on the parts `cfg` names (a prefill node's pool in `pool_storage(layout, num_blocks, device)`)."""
    return Engine(cfg, build_parts(cfg, prefill_only, pool_storage), prefill_only)


def build_parts(cfg: EngineConfig, prefill_only: bool, pool_storage=None) -> EngineParts:
    if cfg.engine == "mock":
        from pdserve.engine.mock import mock_parts

        return mock_parts(cfg, prefill_only)
    return model_parts(cfg, prefill_only, pool_storage)


def use_device(device: str) -> None:
    """Makes a GPU the node's current device: Triton launches its kernels, and a CUDA graph is captured, on the
    current device's stream, whatever device their tensors are on (a node on cuda:1 would run them on cuda:0's).
    The node's steps run on this thread; the KV copier's thread names its stream's device itself."""
    import torch

    d = torch.device(device)
    if d.type == "cuda" and d.index is not None:
        torch.cuda.set_device(d)


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
    use_device(cfg.device)
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
