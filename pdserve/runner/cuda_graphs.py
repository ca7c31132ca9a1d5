"""Engine steps as replayed CUDA graphs: one graph per token-count bucket, prompt chunks and decodes alike.

A step of a small model on a GPU is bound by kernel launches and Python, not by the GPU: a replayed graph
launches the whole forward at once. A graph replays fixed shapes and fixed kernel grids, so at start-up
the forward is captured once per bucket (`plan`): a bucket of T tokens holds any step of at most T new
tokens, R = min(T, --max-num-seqs) requests and S = R rows whose logits are computed (each sampling
request's last row, and the prompt rows that echo scores). Its inputs are the Triton backend's packed int32
layout at the bucket's sizes (`TritonBackend.bucket_layout`), every shape fixed:
- T rows: a step's tokens, then padding rows (token 0, KV slot -1: they store nothing), which form one
  more request with no context (its attention output is 0: the padding rows stay finite);
- R + 1 requests: the step's, that one, then padding requests with no rows (q_len 0);
- one attention launch over a work list of the most (request, query tile) items R requests of T tokens
  can have: the step's tiles, then padding items (tile -1) that read and store nothing;
- S sampled rows: the step's, then padding entries that read row 0 (their logits are not used);
- block tables as wide as the longest request can be (only the columns a step uses are copied).

So a step with prompt chunks, echo rows, one-token prompts and decodes is one replay like a decode step.
Buckets (`token_counts`): 1, 2, 4, 8, then every 16 tokens up to --max-num-seqs (at least 128): decode steps,
bound by launches and weight reads, where padding rows cost next to nothing; above, the mixed steps (a prompt
chunk beside decodes), whose padding rows are computed: 4 sizes an octave, so such a step pads by at most a
quarter (5.4% of the tokens on bench.gpu's workload, 3.7% with the 8 an octave of before, for 28 graphs instead of
44); up to --max-num-batched-tokens, so that every step the scheduler makes fits one. A step takes the smallest
bucket that holds it. Every bucket reads one shared device buffer of inputs and writes one shared logits buffer:
steps run in stream order, so no two replays overlap. What falls outside every bucket (a step scoring more prompt
rows than --max-num-seqs) runs eagerly. `--enforce-eager` turns graphs off.

How a forward is recorded is a parameter (`StepGraphs.capture`): `CudaRecorder` captures a CUDA graph;
`eager_recorder` replays the same forward over the same fixed buffers kernel by kernel, which is how the
tests run this whole path on the CPU (Triton under its interpreter), everything but the capture itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.runner.backends import ForwardInputs, PackLayout, StepInputs

log = logging.getLogger("pdserve.graphs")

FINE_STEP = 16  # buckets every 16 tokens where a step is bound by launches and weight reads (decode steps)
FINE_UP_TO = 128  # ... up to --max-num-seqs, and at least this far
MIXED_PER_OCTAVE = 4  # then 4 an octave: a mixed step pads by at most a quarter


@dataclass(frozen=True)
class Bucket:
    """The sizes a captured graph runs: any step within them is padded up to them."""

    tokens: int  # T: new tokens, all requests together
    requests: int  # R
    samples: int  # S: rows whose logits are computed

    def holds(self, tokens: int, requests: int, samples: int) -> bool:
        return tokens <= self.tokens and requests <= self.requests and samples <= self.samples


def token_counts(max_tokens: int, max_seqs: int) -> list[int]:
    """The buckets' token counts, up to and including max_tokens: 1, 2, 4, 8, every FINE_STEP tokens up to
    max(max_seqs, FINE_UP_TO) (a step pads by at most 15 tokens), then MIXED_PER_OCTAVE an octave (at most a quarter);
    and a full decode step (max_seqs tokens)."""
    sizes = {1, 2, 4, 8, *range(FINE_STEP, max(max_seqs, FINE_UP_TO) + 1, FINE_STEP)}
    t = max(sizes)
    while t < max_tokens:
        t += max(FINE_STEP, (1 << (t.bit_length() - 1)) // MIXED_PER_OCTAVE)  # a quarter of t's octave
        sizes.add(t)
    return sorted({s for s in sizes if s < max_tokens} | {min(max_seqs, max_tokens), max_tokens})


def plan(max_tokens: int, max_seqs: int) -> list[Bucket]:
    """The buckets an engine of `--max-num-batched-tokens` max_tokens and `--max-num-seqs` max_seqs captures."""
    return [Bucket(t, min(t, max_seqs), min(t, max_seqs)) for t in token_counts(max_tokens, max_seqs)]


def pick(buckets: list[Bucket], tokens: int, requests: int, samples: int) -> Bucket | None:
    """The smallest bucket that holds a step, or None: it runs eagerly."""
    return next((b for b in buckets if b.holds(tokens, requests, samples)), None)


class CudaRecorder:
    """Captures a forward into a CUDA graph; every graph shares one memory pool (their replays never overlap)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, forward: Callable[[], object]) -> Callable[[], None]:
        """Capture `forward` (after running it on a side stream: kernel compilation, cuBLAS workspaces, as capture
        needs); the graph's replay."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        return graph.replay


def eager_recorder(forward: Callable[[], object]) -> Callable[[], object]:
    """Where there is no CUDA (the tests, on the CPU): a replay runs the forward that would be captured, over the
    same fixed buffers, one kernel at a time."""
    return forward


class StepGraphs:
    """A recorded forward per bucket, each reading its inputs from the shared buffer and writing the shared logits."""

    def __init__(self, runner, buckets: list[Bucket], width: int) -> None:
        self.runner, self.backend, self.buckets = runner, runner.backend, buckets
        self.layouts: dict[Bucket, PackLayout] = {
            b: self.backend.bucket_layout(b.tokens, b.requests, b.samples, width) for b in buckets
        }
        dev = runner.device
        size = max(lay.size() for lay in self.layouts.values())
        self.buffer = torch.zeros(size, dtype=torch.int32, device=dev)  # [size]: the packed inputs of any bucket
        vocab = runner.lm_head.splits[0]
        self.logits = torch.empty(max(b.samples for b in buckets), vocab, dtype=torch.float32, device=dev)  # [S, V]
        self.inputs: dict[Bucket, ForwardInputs] = {}  # each bucket's views of `buffer`
        self.replays: dict[Bucket, Callable[[], object]] = {}
        self.captures = 0

    @classmethod
    def planned(cls, runner, max_tokens: int, max_seqs: int) -> StepGraphs:
        """The buckets of an engine's budgets (`plan`), block tables as wide as the longest request."""
        return cls(runner, plan(max_tokens, max_seqs), runner.max_blocks())

    def static_inputs(self, b: Bucket) -> ForwardInputs:
        """Bucket b's inputs, read in place from the shared buffer, which this fills with padding (nothing stored,
        nothing attended)."""
        lay = self.layouts[b]
        host = self.backend.pack(lay, [], [], [], [], [])
        self.buffer[: host.numel()].copy_(host)
        return self.backend.views(self.buffer[: lay.size()], lay)

    def capture(self, record: Callable[[Callable[[], object]], Callable[[], object]]) -> None:
        """Record every bucket's forward with `record` (`CudaRecorder`, or `eager_recorder`), largest first: the
        smaller graphs reuse the memory of the larger."""
        for b in reversed(self.buckets):
            self.inputs[b] = self.static_inputs(b)
            self.replays[b] = record(functools.partial(self.runner.forward, self.inputs[b], self.logits[: b.samples]))
            self.captures += 1
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)
        log.info(
            "recorded %d step graphs, up to %d tokens: %s",
            len(self.buckets),
            self.buckets[-1].tokens,
            [b.tokens for b in self.buckets],
        )

    def run(self, step: StepInputs, feed=None) -> torch.Tensor | None:
        """Logits [len(step.sample), V] of a step by replay, or None when no bucket holds it. `feed` (a
        model.DeviceFeed): input tokens taken from the previous step's sampled ids on the device."""
        b = pick(self.buckets, len(step.ids), len(step.q_len), len(step.sample))
        if b is None:
            return None
        host = self.backend.pack_step(self.layouts[b], step)  # a prefix of the layout
        self.buffer[: host.numel()].copy_(host, non_blocking=True)
        if feed is not None:
            feed.into(self.inputs[b].input_ids)
        self.replays[b]()
        return self.logits[: len(step.sample)]
