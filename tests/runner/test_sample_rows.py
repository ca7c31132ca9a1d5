"""Sampling parameters kept in the persistent rows (engine/rows.py): the sampler's vectorised gather gives exactly
the per-request parameters, and so exactly the same tokens, and a step drawn from the rows reads no request's."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.request import Request
from pdserve.engine.rows import BatchRows, DrawRows
from pdserve.runner.sampling import Sampler
from pdserve.wire.params import SamplingParams

V = 50


def _requests() -> list[Request]:
    kinds = [
        {"temperature": 0},
        {"temperature": 0.8, "seed": 7},
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05},
        {"temperature": 1.0, "seed": -3, "resumed": 2},
        {"temperature": 0.9, "repetition_penalty": 1.2},
    ]
    reqs = []
    for i, kw in enumerate(kinds):
        req = Request(f"r{i}", list(range(3, 9 + i)), SamplingParams(max_tokens=32, **kw), output_token_ids=[1] * i)
        req.num_pending = i % 2  # a token still on the device counts as drawn
        reqs.append(req)
    return reqs


def _draw_rows(reqs: list[Request]) -> DrawRows:
    table = BatchRows(8)
    rows = np.array([table.add(r) for r in reqs], dtype=np.int64)
    return DrawRows(table, rows, np.array([r.num_tokens for r in reqs], dtype=np.int64))


def test_gathered_parameters_equal_per_request_ones():
    sampler, reqs = Sampler(), _requests()
    pick = np.arange(len(reqs))
    got, want = sampler.gather(reqs, _draw_rows(reqs), pick), sampler.params(reqs, pick)
    for g, w in zip(got, want, strict=True):
        assert g.tolist() == w.tolist()


def test_tokens_from_the_rows_are_those_drawn_request_by_request(monkeypatch):
    sampler, reqs = Sampler(), _requests()
    logits = torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(0))
    rows = _draw_rows(reqs)
    want = sampler.draw(logits, reqs).tolist()
    calls = []
    real = Sampler.row_params
    monkeypatch.setattr(Sampler, "row_params", lambda self, req: calls.append(req) or real(self, req))
    assert sampler.draw(logits, reqs, rows).tolist() == want
    assert calls == []  # no request was asked for its parameters
    sampler.draw(logits, reqs)
    assert len(calls) == len(reqs) - 1  # the per-request path asks each row that samples
