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
Buckets (`token_counts`) go where a graph pays: a step whose launches and Python outweigh its GPU work. Those are
the decode steps (at most --max-num-seqs tokens) and small mixed ones; the buckets stop at twice --max-num-seqs
(at most 512 tokens, at least --max-num-seqs), as vLLM's default does, for a step of more tokens is mostly prompt,
long enough on the GPU that its launches are a small share, and a large graph is the slowest to capture. Below
that: 1, 2, 4, then every 8 tokens up to 128 (decode batches are often small), then 8 sizes an octave, so a step
pads by at most 7 tokens or an eighth; and --max-num-seqs itself. A step takes the smallest bucket that holds
it. Every bucket reads one shared device buffer of inputs and writes one shared logits buffer: steps run in
stream order, so no two replays overlap. What falls outside every bucket (more tokens than the largest, or more
scored prompt rows than --max-num-seqs) runs eagerly. `--enforce-eager` turns graphs off.

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

GRAPH_TOKENS_CAP = 512  # the largest bucket, at most (unless --max-num-seqs is larger: decode steps are graphed)
MIXED_FACTOR = 2  # buckets up to this many tokens a request: decode steps and small mixed ones
FINE_STEP = 8  # buckets every 8 tokens, until an octave's eighth is larger


@dataclass(frozen=True)
class Bucket:
    """The sizes a captured graph runs: any step within them is padded up to them."""

    tokens: int  # T: new tokens, all requests together
    requests: int  # R
    samples: int  # S: rows whose logits are computed

    def holds(self, tokens: int, requests: int, samples: int) -> bool:
        return tokens <= self.tokens and requests <= self.requests and samples <= self.samples


def largest_bucket(max_tokens: int, max_seqs: int) -> int:
    """Tokens of the largest bucket: twice --max-num-seqs, within GRAPH_TOKENS_CAP, but never less than a full decode
    step (max_seqs tokens) nor more than a step can have (max_tokens)."""
    return min(max_tokens, max(max_seqs, min(MIXED_FACTOR * max_seqs, GRAPH_TOKENS_CAP)))


def token_counts(max_tokens: int, max_seqs: int) -> list[int]:
    """The buckets' token counts: 1, 2, 4, then every FINE_STEP tokens and, from 128, 8 an octave (a step of t tokens
    pads by at most max(7, t // 8)), up to `largest_bucket`; and a full decode step (max_seqs tokens)."""
    top = largest_bucket(max_tokens, max_seqs)
    sizes, t = {1, 2, 4}, FINE_STEP
    while t < top:
        sizes.add(t)
        t += max(FINE_STEP, (1 << (t.bit_length() - 1)) // 8)  # an eighth of t's octave
    return sorted({s for s in sizes if s < top} | {min(max_seqs, top), top})


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
