"""Bad input the router's validation must answer with a 400 naming the field at fault where there is one, never a
crash of the handler (a 500): JSON nested deeper than the parser recurses."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router import api
from pdserve.router.errors import ApiError
from pdserve.router.jobs import ChatBody, CompletionBody
from pdserve.router.text import load_model_info


@pytest.fixture(scope="module")
def info():
    return load_model_info("tiny")


def _refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        result = fn(*args)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        b'{"a":' * 50_000,
        b'{"model": "tiny", "prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
    ],
)
@pytest.mark.parametrize("model", [CompletionBody, ChatBody])
def test_json_nested_too_deeply_is_malformed_json(raw, model):
    e = _refused(api._parse, raw, model)
    assert "malformed JSON" in e.message and "nested too deeply" in e.message and e.param is None
