"""The field policy and the API key parsing, without a server."""

from __future__ import annotations

import pytest

from pdserve.router.auth import bearer_token
from pdserve.router.openai_fields import UnsupportedField, check_fields


@pytest.mark.parametrize(
    "extra",
    [
        {"user": "x", "store": True},
        {"best_of": 2, "n": 2},
        {"top_logprobs": 0},
        {"tool_choice": "none"},
        {"modalities": ["text"]},
        {"anything_else": None},
        {"use_beam_search": False},
    ],
)
def test_neutral_values_pass(extra):
    check_fields({k: v for k, v in extra.items() if k != "n"}, extra)


@pytest.mark.parametrize(
    "extra,name",
    [
        ({"best_of": 3}, "best_of"),
        ({"suffix": "s"}, "suffix"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"my_flag": False}, "my_flag"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": False}, "length_penalty"),
    ],
)
def test_values_that_ask_for_something_are_refused(extra, name):
    with pytest.raises(UnsupportedField) as e:
        check_fields(extra, extra)
    assert e.value.field == name and name in str(e.value)


def test_bearer_token():
    assert bearer_token(b"Bearer abc ") == b"abc" and bearer_token(b"bearer abc") == b"abc"
    assert bearer_token(b"Basic abc") == b"" and bearer_token(b"abc") == b"" and bearer_token(b"") == b""
