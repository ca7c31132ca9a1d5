"""The engine in-process: token-for-token equality with transformers, chunking, preemption, sampling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.request import Request
from pdserve.nodes.parts import build_engine
from pdserve.runner.model import UNPADDED_ROWS, Linear, padded_rows
from pdserve.runner.sampling import Sampler
from pdserve.wire.params import SamplingParams
from tests.helpers import hf_greedy, mixed_workload, optional


def run_engine(engine: Engine, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        engine.add(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_work():
        for o in engine.step():
            out[o.request.request_id].append(o.token_id)
    return out


def backend_args(kernels: str) -> dict:
    """EngineConfig fields for "on" / "off" (the CPU kernels, or torch) and "triton" (the GPU kernels, run here
    by Triton's interpreter)."""
    if kernels == "triton":
        optional("triton")
        return {"attention_backend": "triton"}
    return {"cpu_kernels": kernels}


def greedy_requests(prompts, outs) -> list[Request]:
    return [
        Request(str(i), p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, outs, strict=True))
    ]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize(
    "budget,num_blocks",
    [(512, None), (64, 40)],  # roomy; then prompts split over many iterations and a pool that forces preemption
    ids=["roomy", "chunked-preempting"],
)
@pytest.mark.parametrize("kernels", ["on", "off"])
def test_greedy_equals_transformers(tiny_models, arch, budget, num_blocks, kernels):
    prompts, outs = mixed_workload(16, 512, seed=11)
    check_equals_transformers(tiny_models[arch], prompts, outs, budget, num_blocks, kernels)


def check_equals_transformers(model, prompts, outs, budget: int, num_blocks: int | None, kernels: str) -> Engine:
    """The engine's greedy tokens are transformers' on the backend `kernels` names, every block comes back, and a
    small pool did preempt."""
    ref = hf_greedy(model, prompts, outs)
    cfg = EngineConfig(
        model=str(model), max_num_batched_tokens=budget, num_kv_blocks=num_blocks, **backend_args(kernels)
    )
    engine = build_engine(cfg)
    reqs = greedy_requests(prompts, outs)
    got = run_engine(engine, reqs)
    assert [got[str(i)] for i in range(len(prompts))] == ref
    assert engine.runner.backend.name == {"on": "cpu", "off": "torch", "triton": "triton"}[kernels]  # the one tested
    assert engine.pool.allocator.num_free == engine.pool.num_blocks
    if num_blocks is not None:
        assert engine.num_preemptions() > 0, "the small pool should have forced a preemption"
    return engine


@pytest.mark.parametrize(
    "arch,budget,num_blocks", [("llama", 512, None), ("qwen3", 32, 8)], ids=["roomy-llama", "chunked-preempting-qwen3"]
)
def test_triton_greedy_equals_transformers(tiny_models, arch, budget, num_blocks):
    """The GPU path (packed inputs, Triton KV store and paged attention) on the CPU, by Triton's interpreter:
    smaller than the test above, as the interpreter runs each kernel program in Python (one a token for the
    KV store: its cost goes with the tokens computed); prompts of up to three blocks still chunk and preempt.
    Each architecture and each budget once (pairs, not their product: the interpreter is slow, and the
    scheduling does not depend on the architecture; the test above runs their product on the CPU kernels)."""
    prompts, outs = mixed_workload(8, 512, seed=5, max_prompt=48, max_out=16)
    check_equals_transformers(tiny_models[arch], prompts, outs, budget, num_blocks, "triton")


@pytest.mark.parametrize("kernels", ["on", "off", "triton"])
def test_swapped_spans_break_equivalence(tiny_models, monkeypatch, kernels):
    """The equivalence test can fail: attention against another request's KV changes the tokens."""
    prompts, outs = mixed_workload(4, 512, seed=3, max_prompt=40, max_out=6)
    ref = hf_greedy(tiny_models["qwen3"], prompts, outs)
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"]), **backend_args(kernels)))
    real_prepare = engine.runner.prepare

    def swapped(batch):
        inp = real_prepare(batch)
        meta = inp.attn
        if kernels == "triton":  # the Triton kernels' inputs: block tables and lengths of two decodes
            if int((meta.q_len == 1).sum()) >= 2:
                rows = (meta.q_len == 1).nonzero()[:2, 0].tolist()
                swap = rows[::-1]
                meta.block_tables[rows], meta.ctx_len[rows] = meta.block_tables[swap], meta.ctx_len[swap]
            return inp
        if len(meta.spans) >= 2 and all(sp.length == 1 and sp.past for sp in meta.spans[:2]):  # two decodes
            a, b = meta.spans[0], meta.spans[1]
            a.ctx_slots, b.ctx_slots = b.ctx_slots, a.ctx_slots
        if meta.decode is not None and len(meta.decode.lens) >= 2:  # the kernel's inputs: block tables
            dec = meta.decode
            dec.block_tables[[0, 1]], dec.lens[[0, 1]] = dec.block_tables[[1, 0]], dec.lens[[1, 0]]
        return inp

    monkeypatch.setattr(engine.runner, "prepare", swapped)
    got = run_engine(engine, greedy_requests(prompts, outs))
    assert [got[str(i)] for i in range(4)] != ref


def test_abort_frees_kv_at_once(tiny_models):
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=64))
    prompts, outs = mixed_workload(6, 512, seed=4, max_prompt=60, max_out=20)
    for r in greedy_requests(prompts, outs):
        engine.add(r)
    engine.step()
    assert engine.pool.allocator.num_used > 0
    for rid in list(engine.requests):
        engine.abort(rid)
    assert engine.pool.allocator.num_free == 64 and not engine.has_work()


def test_seeded_sampling_repeats_and_stops(tiny_models, monkeypatch):
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"])))
    asked = []  # requests whose parameters the sampler read one by one: none, it gathers them from the rows
    monkeypatch.setattr(Sampler, "row_params", lambda self, req: asked.append(req))
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    prompt = list(range(10, 30))
    a = run_engine(engine, [Request("a", prompt, params), Request("x", prompt[:5], params)])["a"]
    b = run_engine(engine, [Request("b", prompt, params)])["b"]
    assert a == b and len(a) == 12
    unseeded = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    c = run_engine(engine, [Request("c", prompt, unseeded)])["c"]
    d = run_engine(engine, [Request("d", prompt, unseeded)])["d"]
    assert c != d  # 12 draws from a ~512-token distribution: equal only by a tiny chance
    stop = dataclasses.replace(params, stop_token_ids=(a[3],))
    e = run_engine(engine, [Request("e", prompt, stop)])["e"]
    assert e == a[: a.index(a[3]) + 1]
    assert asked == []


def test_eos_stops_unless_ignored(tiny_models):
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"])))
    prompt = [5, 6, 7]
    free = run_engine(engine, [Request("f", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))])
    eos = free["f"][2]
    params = SamplingParams(max_tokens=6, temperature=0, eos_token_ids=(eos,))
    stopped = run_engine(engine, [Request("s", prompt, params)])["s"]
    assert stopped == free["f"][: free["f"].index(eos) + 1]


def test_sampling_keeps_top_k_support(tiny_models):
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"])))
    prompt = [1, 2, 3]
    greedy = run_engine(engine, [Request("g", prompt, SamplingParams(max_tokens=1, temperature=0))])["g"]
    for seed in range(8):  # top_k=1 is greedy whatever the temperature and seed
        p = SamplingParams(max_tokens=1, temperature=2.0, top_k=1, seed=seed)
        assert run_engine(engine, [Request(f"k{seed}", prompt, p)])[f"k{seed}"] == greedy


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(tiny_models, monkeypatch):
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=64))
    real_run = engine.runner.run
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("a logits processor raised")
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", flaky)
    prompts, outs = mixed_workload(3, 512, seed=8, max_prompt=20, max_out=6)
    outputs = []
    for r in greedy_requests(prompts, outs):
        engine.add(r)
    while engine.has_work():
        outputs += engine.step()
    failed = [o for o in outputs if o.finish_reason == "error"]
    assert failed and all(o.token_id is None and "a logits processor raised" in o.error for o in failed)
    assert engine.pool.allocator.num_free == 64 and not engine.requests and engine.lost is None  # not a CUDA error
    ref = hf_greedy(tiny_models["qwen3"], prompts[:1], outs[:1])
    assert run_engine(engine, greedy_requests(prompts[:1], outs[:1]))["0"] == ref[0]  # still serving, exactly


def test_packed_linears_pad_rows_to_a_bounded_set_of_shapes_and_keep_the_real_rows():
    shapes = {padded_rows(t) for t in range(1, 513)}
    assert len(shapes) <= 64 and all(padded_rows(t) == t for t in range(1, UNPADDED_ROWS + 1))
    assert all(t <= padded_rows(t) <= t + max(7, t // 16) for t in range(1, 4097))
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48)
    packed, x = Linear(lin), torch.randn(100, 32)  # 100 rows run as 104
    assert packed.packed or not torch.backends.mkldnn.is_available()
    with torch.no_grad():
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert packed(x).shape == (100, 48)
