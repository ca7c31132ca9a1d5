"""What an engine runs on: a model, its KV pool, runner, sampler and grammar support (torch), or the mock's
stand-ins (engine/mock.py, no torch). The engine itself (engine.py) only schedules, counts and hands tokens out: it is
given its parts (pdserve/nodes/parts.py builds them: the side that `--engine` names, and only that side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.kv.layout import KVLayout


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
