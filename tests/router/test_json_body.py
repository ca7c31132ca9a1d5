"""A request body decoded before json.loads (api._json_text, which skips json's encoding detection for the common
UTF-8 object) gives what json.loads gives the bytes: the same value, or the same error."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.router.api import _json_text

BODIES = [
    b'{"a":1}',
    b'{\x00"\x00',
    b"{\x00",
    b"{",
    b"",
    b"\xef\xbb\xbf{}",
    b"[1]",
    b'{"\xed\xa0\x80":1}',
    b'{"\xff":1}',
    '{"é":1}'.encode("utf-16-le"),
    '{"é":1}'.encode("utf-16-be"),
    '{"é":1}'.encode("utf-32-le"),
    '{"é":1}'.encode("utf-16"),
    b"{\x00}",
    b' {"a":1}',
    '{"ü": "✓"}'.encode(),
]


def _outcome(body: bytes, ours: bool):
    try:
        return "ok", json.loads(_json_text(body) if ours else body)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        return type(e).__name__, str(e)


@pytest.mark.parametrize("body", BODIES)
def test_the_same_value_or_error_as_json_loads(body):
    assert _outcome(body, ours=True) == _outcome(body, ours=False)


def test_random_bytes_after_a_brace_decode_alike():
    rng = random.Random(0)
    for _ in range(3000):
        body = b"{" + bytes(rng.randrange(256) for _ in range(rng.randrange(8)))
        assert _outcome(body, ours=True) == _outcome(body, ours=False), body
