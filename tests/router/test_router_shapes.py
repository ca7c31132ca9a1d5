"""What the router sends back, shaped as OpenAI's API: the error object (a string or null `code`, the field at
fault as `param`, one log line each) and completions' top_logprobs maps where token texts collide."""

from __future__ import annotations

import logging

import pytest

from pdserve.router.errors import ApiError, api_error_body, error_body, logged_error
from pdserve.router.logprobs import FLOOR, LogprobFormatter
from pdserve.wire.params import InvalidField, SamplingParams


@pytest.mark.parametrize("status", [400, 401, 404, 413, 429, 500, 503])
def test_an_error_without_a_code_sends_null_never_the_status(status):
    err = error_body(status, "why")["error"]
    assert err["code"] is None and err["param"] is None and err["message"] == "why"


def test_an_error_keeps_its_string_code_and_param():
    err = error_body(404, "no such model", "model", "model_not_found")["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert error_body(503, "node lost", code="node_failed")["error"]["type"] == "server_error"


def test_each_error_is_logged_as_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        body = logged_error("POST /v1/completions", 400, "max_tokens must be at least 1", "max_tokens")
        api_error_body("GET /v1/models", ApiError(401, "a key is needed", code="invalid_api_key"))
    assert body == error_body(400, "max_tokens must be at least 1", "max_tokens")
    assert [r.getMessage() for r in caplog.records] == [
        "POST /v1/completions -> 400 param=max_tokens: max_tokens must be at least 1",
        "GET /v1/models -> 401 code=invalid_api_key: a key is needed",
    ]


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 2.0}, "min_p"),
        ({"logit_bias": ((1, 200.0),)}, "logit_bias"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"grammar": "{}", "ignore_eos": True}, "grammar"),
    ],
)
def test_sampling_params_name_the_field_out_of_range(kw, field):
    with pytest.raises(InvalidField) as e:
        SamplingParams(**{"max_tokens": 4, **kw})
    assert e.value.field == field and isinstance(e.value, ValueError)


class Texts:
    """A tokenizer whose ids 5 and 6 are both byte pieces that decode alone to "\ufffd"."""

    def decode(self, ids: list[int]) -> str:
        return "\ufffd" if ids[0] in (5, 6) else f"t{ids[0]}"


def _top(chosen: int, lp: float, top: list[tuple[int, float]]) -> dict:
    return LogprobFormatter(Texts(), chat=False, top=len(top))._completion([(chosen, lp, top)])["top_logprobs"][0]


@pytest.mark.parametrize("top", [[(5, -1.0), (6, -2.0), (7, -3.0)], [(6, -2.0), (5, -1.0), (7, -3.0)]])
def test_colliding_texts_keep_the_higher_value_in_either_order(top):
    assert _top(7, -3.0, top) == {"\ufffd": -1.0, "t7": -3.0}


@pytest.mark.parametrize("top", [[(5, -1.0), (6, -2.0)], [(6, -2.0), (5, -1.0)]])
def test_the_chosen_token_carries_its_own_value_even_where_its_text_collides(top):
    piece = LogprobFormatter(Texts(), chat=False, top=2)._completion([(6, -2.0, top)])
    assert piece["top_logprobs"][0]["\ufffd"] == piece["token_logprobs"][0] == -2.0
    assert _top(8, -5.0, [(5, -1.0), (6, -2.0)]) == {"\ufffd": -1.0, "t8": -5.0}  # chosen outside the top: added


def test_minus_infinity_stays_the_floor_in_a_collision():
    assert _top(7, float("-inf"), [(5, float("-inf")), (6, -4.0)]) == {"\ufffd": -4.0, "t7": FLOOR}
