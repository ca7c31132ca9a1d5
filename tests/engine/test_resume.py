"""A request dispatched again after a lost node draws on where its stream stands: a seeded sampler's i-th token
comes from the same noise whether the request ran whole or resumed, so its output is unchanged; its penalties count
the tokens it streamed before."""

from __future__ import annotations

import torch

from pdserve.engine.request import Request
from pdserve.router.core import RouterCore
from pdserve.router.flight import Flight
from pdserve.runner.sampling import Sampler, apply_processors
from pdserve.wire.params import SamplingParams


def test_resumed_params_count_the_streamed_tokens():
    flight = Flight("", [1, 2], SamplingParams(max_tokens=10, seed=7, temperature=0.8), None, output=[5, 6, 7])
    resumed = RouterCore._resumed_params(flight)
    assert (resumed.resumed, resumed.max_tokens, resumed.seed) == (3, 7, 7)
    assert RouterCore._resumed_params(Flight("", [1, 2], flight.params, None)).resumed == 0


def test_a_resumed_seeded_request_draws_with_the_keys_of_the_whole_one():
    sampler, params = Sampler(), SamplingParams(max_tokens=10, seed=7, temperature=0.8)
    whole = Request("a", [1, 2], params, output_token_ids=[5, 6, 7, 8])
    flight = Flight("", [1, 2], params, None, output=[5, 6, 7])
    resumed = Request("b", [1, 2, 5, 6, 7], RouterCore._resumed_params(flight), output_token_ids=[8])
    assert sampler.row_params(resumed) == sampler.row_params(whole)
    restarted = Request("c", [1, 2, 5, 6, 7], params, output_token_ids=[8])  # what a resumed request drew before
    assert sampler.row_params(restarted) != sampler.row_params(whole)


def test_a_resumed_request_keeps_its_frequency_and_presence_penalties():
    params = SamplingParams(max_tokens=10, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2)
    whole = Request("a", [1, 2], params, output_token_ids=[5, 6, 5, 8])
    flight = Flight("", [1, 2], params, None, output=[5, 6, 5])
    resumed = Request("b", [1, 2, 5, 6, 5], RouterCore._resumed_params(flight), output_token_ids=[8])
    logits = torch.linspace(-2.0, 2.0, 10).repeat(2, 1)  # [2, 10]
    done = apply_processors(logits.clone(), [whole, resumed])  # [2, 10]
    assert not torch.equal(done[0], logits[0])  # the penalties changed the row
    assert torch.equal(done[0], done[1])
