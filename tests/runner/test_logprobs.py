"""Log-probabilities in the engine: sampled tokens' and echoed prompts', against a transformers forward."""

from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.request import Request
from pdserve.nodes.parts import build_engine
from pdserve.wire.params import SamplingParams
from tests.helpers import mixed_workload


def hf_log_softmax(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over a teacher-forced sequence: [len(ids), V] float32."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def run_outputs(engine: Engine, requests: list[Request]) -> dict[str, list]:
    for r in requests:
        engine.add(r)
    out: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_work():
        for o in engine.step():
            out[o.request.request_id].append(o)
    return out


@pytest.mark.parametrize("budget,num_blocks", [(512, None), (16, 7)], ids=["roomy", "chunked-preempting"])
def test_logprobs_equal_transformers_log_softmax(tiny_models, budget, num_blocks):
    """Greedy and sampled rows, with and without logprobs and echo, batched together (chunked prompts and
    preemptions in the second case): each asked-for value is transformers' log_softmax at its position."""
    path = tiny_models["qwen3"]
    prompts, _ = mixed_workload(6, 512, seed=3, max_prompt=40)
    kinds = [
        dict(temperature=0, logprobs=5),
        dict(temperature=0.9, seed=1, logprobs=0),
        dict(temperature=0, logprobs=3, prompt_logprobs=2),
        dict(temperature=0),
        dict(temperature=1.2, seed=4, logprobs=20, prompt_logprobs=0),
        dict(temperature=0, prompt_logprobs=4),
    ]
    reqs = [
        Request(str(i), p, SamplingParams(max_tokens=8, ignore_eos=True, **k))
        for i, (p, k) in enumerate(zip(prompts, kinds, strict=True))
    ]
    engine = build_engine(EngineConfig(model=str(path), max_num_batched_tokens=budget, num_kv_blocks=num_blocks))
    got = run_outputs(engine, reqs)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for req in reqs:
        outs, p = got[req.request_id], req.params
        tokens = [o.token_id for o in outs]
        ref = hf_log_softmax(model, req.prompt_token_ids + tokens)  # [L + 8, V]
        L = len(req.prompt_token_ids)
        if p.temperature == 0:
            assert tokens == ref[L - 1 : -1].argmax(-1).tolist()
        for i, o in enumerate(outs):
            if p.logprobs is None:
                assert o.logprob is None
                continue
            row = ref[L - 1 + i]
            assert o.logprob.logprob == pytest.approx(float(row[tokens[i]]), abs=1e-4)
            assert o.logprob.top_logprobs == pytest.approx(row.topk(p.logprobs).values.tolist(), abs=1e-4)
            assert row[o.logprob.top_ids].tolist() == pytest.approx(o.logprob.top_logprobs, abs=1e-4)
        echo = outs[0].prompt_logprobs
        assert [o.prompt_logprobs for o in outs[1:]] == [None] * (len(outs) - 1)
        if p.prompt_logprobs is None:
            assert echo is None
            continue
        assert len(echo) == L - 1
        want = ref[: L - 1].gather(1, torch.tensor(req.prompt_token_ids[1:])[:, None])[:, 0]
        assert [e.logprob for e in echo] == pytest.approx(want.tolist(), abs=1e-4)
        assert all(len(e.top_ids) == p.prompt_logprobs for e in echo)
    if num_blocks is not None:
        assert engine.num_preemptions() > 0, "the small pool should have forced a preemption"


def test_one_token_prompt_with_echo_scores_nothing(tiny_models):
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"])))
    req = Request("a", [7], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    (out,) = run_outputs(engine, [req])["a"]
    assert out.prompt_logprobs == [] and out.logprob is None


def test_no_logprobs_no_extra_host_copy(tiny_models, monkeypatch):
    """Without logprobs the step copies only the sampled ids to the host (one `tolist` of the token tensor)."""
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"])))
    calls = []
    real = torch.Tensor.tolist

    def counting(self):
        calls.append(tuple(self.shape))
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    run_outputs(
        engine,
        [
            Request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0)),
            Request("b", [4, 5], SamplingParams(max_tokens=3, temperature=0.7, seed=1)),
        ],
    )
    assert calls == [(2,)] * 3
