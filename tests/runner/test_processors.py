"""Logits processors (penalties, bias, min_tokens, min_p) against hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.runner.sampling import Sampler, apply_processors, process_rows
from pdserve.wire.params import SamplingParams


def _req(prompt, output, **kw) -> Request:
    return Request("r", prompt, SamplingParams(max_tokens=8, **kw), output_token_ids=list(output))


def test_penalties_and_bias_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 1.0]])
    req = _req(
        [0, 1],
        [2, 2, 4],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias=((3, 5.0),),
        temperature=0,
    )
    # repetition: seen {0, 1, 2, 4}: 2 -> 1, -1 -> -2, 0.5 -> 0.25, 1 -> 0.5; bias: token 3 +5;
    # frequency (counts 2: x2, 4: x1) and presence: token 2 -= 1.0 + 0.25, token 4 -= 0.5 + 0.25
    want = [1.0, -2.0, -1.0, 5.0, -0.25]
    assert apply_processors(logits.clone(), [req])[0].tolist() == pytest.approx(want)
    assert Sampler()(logits, [req]).tokens == [3]  # greedy rows are penalised too
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 0.0, 1.0]  # the raw logits (for logprobs) are untouched


def test_min_tokens_masks_stops_until_reached():
    logits = torch.zeros(3, 6)
    early = _req([1], [5], min_tokens=3, eos_token_ids=(4,), stop_token_ids=(2,))
    late = _req([1], [5, 5, 5], min_tokens=3, eos_token_ids=(4,), stop_token_ids=(2,))
    no_eos = _req([1], [], min_tokens=2, eos_token_ids=(4,), ignore_eos=True)
    out = process_rows(logits, [early, late, no_eos])
    assert out[0].tolist() == [0, 0, float("-inf"), 0, float("-inf"), 0]
    assert out[1].tolist() == [0] * 6 and out[2].tolist() == [0] * 6


def test_rows_without_processors_keep_their_logits():
    logits = torch.randn(2, 7)
    plain = _req([1, 2], [3], temperature=0)
    assert process_rows(logits, [plain, plain]) is logits
    pen = _req([1, 2], [3], presence_penalty=1.0)
    out = process_rows(logits, [plain, pen])
    assert torch.equal(out[0], logits[0]) and out[1, 3] == logits[1, 3] - 1.0


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(300, 1)
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=1.0, min_p=0.5, seed=i)) for i in range(300)]
    drawn = set(Sampler()(logits, reqs).tokens)
    assert drawn == {0, 1}  # 0.15 and 0.05 are below 0.5 * 0.5


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
        ({"min_tokens": 9}, "min_tokens"),
    ],
)
def test_bad_values_are_value_errors(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(max_tokens=8, **kw)
