"""Every step a graph: the step graphs' whole path on the CPU, and captured on a GPU where there is one.

On the CPU the forward each bucket would capture runs as it is (`eager_recorder`) over the bucket's fixed
buffers, padding included, with Triton under its interpreter in float32: everything but the CUDA capture. Mixed
steps (prompt chunks beside decodes, echo rows, a one-token prompt) replay token-exact against `transformers`, and
a padded, bucketed step gives the eager path's logits."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.request import Request
from pdserve.nodes.parts import build_engine
from pdserve.wire.params import SamplingParams
from tests.engine.test_async_scheduling import run_ahead, tokens
from tests.engine.test_engine import greedy_requests
from tests.helpers import hf_greedy, mixed_workload, optional

BUDGET, MAX_SEQS = 24, 8  # prompts of up to 40 tokens take two or more steps, beside the decodes


def graphed_engine(model, device: str = "cpu", **kw) -> Engine:
    """An engine on the Triton backend whose steps run through step graphs: captured on a GPU, replayed eagerly over
    the same fixed buffers on the CPU."""
    from pdserve.runner.cuda_graphs import StepGraphs, eager_recorder

    cfg = EngineConfig(
        model=str(model),
        attention_backend="triton",
        device=device,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=MAX_SEQS,
        **kw,
    )
    engine = build_engine(cfg)
    if engine.runner.graphs is None:  # on the CPU no graph is captured: record the same path eagerly
        engine.runner.graphs = StepGraphs.planned(engine.runner, BUDGET, MAX_SEQS)
        engine.runner.graphs.capture(eager_recorder)
    return engine


def workload() -> tuple[list[list[int]], list[Request]]:
    """Five greedy requests (a one-token prompt and a 40-token one among them) and a greedy one whose 3-token prompt
    is echoed with its log-probabilities: at most 6 sampling and 2 echo rows a step, which every bucket of
    MAX_SEQS holds."""
    prompts, outs = mixed_workload(5, 512, seed=2, max_prompt=40, max_out=8)
    echo = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1, ignore_eos=True)
    requests = [*greedy_requests(prompts, outs), Request("echo", [5, 9, 17], echo)]
    return [*prompts, [5, 9, 17]], requests


class StepLog:
    """Records each step the graphs run: (chunks as (past, new tokens), sampled rows, whether a bucket held it)."""

    def __init__(self, graphs) -> None:
        self.steps: list[tuple[list[tuple[int, int]], int, bool]] = []
        self.inner = graphs.run
        graphs.run = self

    def __call__(self, step, feed=None):
        logits = self.inner(step, feed=feed)
        chunks = list(zip(step.past.tolist(), step.q_len.tolist(), strict=True))
        self.steps.append((chunks, len(step.sample), logits is not None))
        return logits


@pytest.fixture(scope="module")
def engine(tiny_models):
    optional("triton")
    return graphed_engine(tiny_models["qwen3"], async_scheduling=True)


def test_mixed_steps_replay_token_exact(engine, tiny_models):
    """Scheduled ahead (each step's pending tokens fed into the bucket's fixed input buffer on the device): every
    step replays, prompt chunks, decodes, the one-token prompt and the echo rows together, and the tokens are
    transformers'."""
    log = StepLog(engine.runner.graphs)
    prompts, requests = workload()
    want = hf_greedy(tiny_models["qwen3"], prompts, [r.params.max_tokens for r in requests])
    outputs = run_ahead(engine, requests)
    got = tokens(outputs)
    assert [got[r.request_id] for r in requests] == want
    assert len(outputs["echo"][0].prompt_logprobs) == 2  # its echo rows ran in replayed steps too
    counts = engine.run_counters()
    assert counts["eager_steps"] == 0 and all(held for *_, held in log.steps)
    assert counts["graph_steps"] == len(log.steps) and engine.steps_ahead > 5
    assert counts["graph_tokens"] == sum(n for chunks, *_ in log.steps for _, n in chunks)
    assert 0 < counts["graph_decode_tokens"] < counts["graph_tokens"]
    assert counts["graph_captures"] == len(engine.runner.graphs.buckets)
    steps = [chunks for chunks, *_ in log.steps]
    assert any(any(n > 1 for _, n in c) and any(p > 0 and n == 1 for p, n in c) for c in steps), "no mixed step"
    assert any((0, 1) in c for c in steps), "the one-token prompt"
    assert engine.pool.allocator.num_free == engine.pool.num_blocks


def test_a_bucketed_step_gives_the_eager_logits(engine):
    """The same mixed step (decodes, a one-token prompt, a chunk after a cached past, with echo rows), padded into a
    larger bucket and replayed over the fixed buffers, and run eagerly at its own sizes: the same logits."""
    from bench.kernels import flat_inputs
    from pdserve.runner.backends import StepInputs
    from pdserve.runner.cuda_graphs import Bucket

    runner, graphs = engine.runner, engine.runner.graphs
    ids, positions, slots, sample, chunks = flat_inputs([(20, 1), (0, 1), (16, 7), (33, 1)])
    ids = [(7 * i + 3) % 500 for i in range(len(ids))]
    sample += [3, 4, 5]  # the chunk's first rows, scored as an echo would
    eager = runner.forward(runner.backend.inputs(ids, positions, slots, sample, chunks))
    log = StepLog(graphs)
    replayed = graphs.run(StepInputs.of_chunks(ids, positions, slots, sample, chunks, engine.pool.block_size))
    assert log.steps == [([(20, 1), (0, 1), (16, 7), (33, 1)], 7, True)]
    assert graphs.layouts[Bucket(16, 8, 8)].rows == 16  # 10 tokens padded to 16, 7 rows to 8
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)  # bitwise equal on the development host
    assert replayed.argmax(-1).tolist() == eager.argmax(-1).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_replay_mixed_steps_on_a_gpu(tiny_models):
    """The same workload through graphs captured on the GPU (float32), one step at a time: every step replayed, the
    tokens transformers'."""
    from tests.engine.test_engine import run_engine

    engine = graphed_engine(tiny_models["qwen3"], device="cuda:0")
    assert engine.runner.graph_captures == len(engine.runner.graphs.buckets) > 0
    prompts, requests = workload()
    want = hf_greedy(tiny_models["qwen3"], prompts, [r.params.max_tokens for r in requests])
    got = run_engine(engine, requests)
    assert [got[r.request_id] for r in requests] == want
    counts = engine.run_counters()
    assert counts["eager_steps"] == 0 and counts["graph_steps"] > 5
