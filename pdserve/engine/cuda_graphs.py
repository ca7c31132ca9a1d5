"""Decode steps as captured CUDA graphs: one graph per batch-size bucket, replayed with new inputs.

A decode step of a small model on a GPU is bound by kernel launches and Python, not by the GPU: a
replayed graph launches the whole forward at once. At start-up, for each bucket size B (1, 2, 4, 8,
then multiples of 16 up to --max-num-seqs), the forward of B single-token requests is captured
over fixed device buffers: one packed int32 buffer of inputs (the Triton backend's layout, with
every block table as wide as the longest request can be, of which a step copies only the columns it
uses) and the logits it writes. A step with n
decode requests packs its inputs for the smallest bucket B >= n (padding rows store no KV and
padding requests attend to nothing), copies them into that bucket's buffer in one host-to-device
copy, replays the graph and reads the first n rows of logits. Anything else (prompt chunks, more
requests than the largest bucket) runs eagerly. `--enforce-eager` turns this off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.engine.backends import Chunk, ForwardInputs, PackLayout

log = logging.getLogger("pdserve.graphs")


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every multiple of 16, up to and including max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n requests, or None."""
    return next((b for b in sizes if b >= n), None)


def graphable(chunks: list[Chunk], sample: list[int]) -> bool:
    """A step a decode graph can run: every request adds one token after a past, and every row, in order, samples."""
    return bool(chunks) and sample == list(range(len(chunks))) and all(c.length == 1 and c.past > 0 for c in chunks)


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    layout: PackLayout
    buffer: torch.Tensor  # [layout.size()] int32 on the device: the graph's inputs
    inputs: ForwardInputs  # views of `buffer`
    logits: torch.Tensor  # [B, V] float32, written by every replay


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_blocks: int) -> None:
        self.runner = runner
        self.backend = runner.backend
        self.sizes = bucket_sizes(max_batch)
        self.width = max_blocks
        self.captured: dict[int, Captured] = {}

    def layout(self, b: int) -> PackLayout:
        return self.backend.layout(b, 0, [], pad_requests=b, width=self.width)

    def static_inputs(self, b: int) -> tuple[PackLayout, torch.Tensor, ForwardInputs]:
        """Bucket b's layout, its device buffer (all padding: nothing stored, nothing attended), and the
        ForwardInputs that read it in place."""
        lay = self.layout(b)
        buffer = torch.zeros(lay.size(), dtype=torch.int32, device=self.runner.device)
        host = self.backend.pack(lay, [], [], [], [], [])
        buffer[: host.numel()].copy_(host)
        return lay, buffer, self.backend.views(buffer, lay)

    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            lay, buffer, inp = self.static_inputs(b)
            self._warm_up(inp)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.runner.forward(inp)
            self.captured[b] = Captured(graph, lay, buffer, inp, logits)
        torch.cuda.synchronize(self.runner.device)
        log.info("captured decode graphs for batch sizes %s", self.sizes)

    def _warm_up(self, inp: ForwardInputs) -> None:
        """Run the forward on a side stream first (kernel compilation, cuBLAS workspaces), as capture needs."""
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.runner.forward(inp)
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)

    def run(self, ids, positions, slots, sample, chunks: list[Chunk], feed=None) -> torch.Tensor | None:
        """Logits [n, V] of a decode step by graph replay, or None when no graph fits it. `feed` (a model.DeviceFeed):
        input tokens taken from the previous step's sampled ids on the device."""
        b = bucket_for(len(chunks), self.sizes) if graphable(chunks, sample) else None
        if b is None:
            return None
        cap = self.captured[b]
        host = self.backend.pack(cap.layout, ids, positions, slots, [], chunks)  # a prefix of the layout
        cap.buffer[: host.numel()].copy_(host, non_blocking=True)
        if feed is not None:
            feed.into(cap.inputs.input_ids)
        cap.graph.replay()
        return cap.logits[: len(chunks)]
