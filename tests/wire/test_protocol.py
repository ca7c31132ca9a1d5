"""The wire protocol: round trips, and refusal of what a peer must not send."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.wire import codec
from pdserve.wire.codec import ProtocolError, decode, encode
from pdserve.wire.messages import (
    PROTOCOL_VERSION,
    Generate,
    Hello,
    KvAck,
    KvData,
    KvOffer,
    Logprobs,
    TokenEvent,
    TokenEvents,
)
from pdserve.wire.params import ErrorCode, FinishReason, SamplingParams


def test_round_trip_of_every_message():
    params = SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=3, seed=1, stop_token_ids=(4,))
    msgs = [
        Hello(PROTOCOL_VERSION, "router", {"a": 1}),
        Generate("r1", [1, 2, 3], params, "tcp://127.0.0.1:5"),
        TokenEvents(
            [TokenEvent("r1", [7], None), TokenEvent("r2", [], "error", "boom", error_code=ErrorCode.INTERNAL)]
        ),
        KvOffer("r1", [1, 2], 9, params, 2),
        KvData("r1", "float32", [16, 2, 4, 64], 3, [5, 6]),
        KvAck("r1", False, "full", ErrorCode.INVALID_REQUEST),
    ]
    for m in msgs:
        assert decode(encode(m)) == m


def _raw(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    "data,words",
    [
        (_raw({"t": "Popen", "args": ["sh"]}), "unknown message type"),
        (_raw({"t": "Abort", "request_id": "x", "extra": 1}), "unknown fields"),
        (_raw({"t": "Abort"}), "Abort"),
        (_raw({"request_id": "x"}), "type tag"),
        (
            _raw({"t": "Generate", "request_id": "x", "prompt_token_ids": [1], "params": {"max_tokens": 0}}),
            "max_tokens",
        ),
        (b"\xc1\xc1garbage", "undecodable"),
        (
            _raw(
                {
                    "t": "KvOffer",
                    "request_id": "x",
                    "prompt_token_ids": list(range(10)),
                    "first_token_id": 1,
                    "params": {"max_tokens": 1, "evil": True},
                    "num_tokens": 1,
                }
            ),
            "unknown fields",
        ),
    ],
)
def test_refuses_bad_messages(data, words):
    with pytest.raises(ProtocolError, match=words):
        decode(data)


def test_refuses_oversized_messages(monkeypatch):
    monkeypatch.setattr(codec, "MAX_HEADER_BYTES", 100)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(encode(Generate("r", list(range(200)), SamplingParams())))


def test_only_registered_types_encode():
    class Sneaky:
        pass

    with pytest.raises(TypeError):
        encode(Sneaky())


@pytest.mark.parametrize(
    "body,words",
    [
        ({"t": "Generate", "request_id": "x", "prompt_token_ids": [1, "2"], "params": {}}, "prompt_token_ids"),
        ({"t": "Generate", "request_id": "x", "prompt_token_ids": [1, -2], "params": {}}, "non-negative"),
        ({"t": "Generate", "request_id": 5, "prompt_token_ids": [1], "params": {}}, "request_id must be a string"),
        ({"t": "Generate", "request_id": "x", "prompt_token_ids": [1], "params": {"seed": "7"}}, "seed"),
        ({"t": "Generate", "request_id": "x", "prompt_token_ids": [1], "params": {"max_tokens": True}}, "max_tokens"),
        ({"t": "TokenEvents", "events": [{"request_id": "r", "token_ids": [{"a": 1}]}]}, "TokenEvent.token_ids"),
        ({"t": "KvData", "request_id": "r", "dtype": "f", "shape": "1234"}, "shape must be a list"),
        ({"t": "KvAck", "request_id": "r", "ok": 1}, "ok must be true or false"),
        ({"t": "KvAck", "request_id": "r", "ok": False, "error_code": "oops"}, "error_code must be one of"),
        (
            {"t": "TokenEvents", "events": [{"request_id": "r", "token_ids": [], "finish_reason": "error"}]},
            "error code",
        ),
        (
            {"t": "TokenEvents", "events": [{"request_id": "r", "token_ids": [], "error_code": "internal"}]},
            "error code",
        ),
        ({"t": "TokenEvents", "events": [], "tokens": ["r"]}, "request ids and token id lists"),
        ({"t": "TokenEvents", "events": [], "tokens": ["r", [1], 5, [2]]}, "request ids and token id lists"),
        ({"t": "TokenEvents", "events": [], "tokens": ["r", 7]}, "request ids and token id lists"),
        ({"t": "TokenEvents", "events": [], "tokens": ["r", [1, -2]]}, "non-negative"),
        ({"t": "TokenEvents", "events": [], "tokens": ["r", [1.5]]}, "non-negative"),
        ({"t": "TokenEvents", "tokens": []}, "expected events"),
        ({"t": "TokenEvents", "events": [], "tokens": [], "extra": 1}, "expected events"),
        (
            {
                "t": "Stats",
                "role": "decode",
                "num_running": 1,
                "num_waiting": 0,
                "kv_blocks_used": 0,
                "kv_blocks_free": 0,
                "counters": [1],
            },
            "counters must be a map",
        ),
    ],
)
def test_refuses_fields_of_the_wrong_type(body, words):
    with pytest.raises(ProtocolError, match=words):
        decode(_raw(body))


def test_numbers_and_tuples_arrive_as_declared():
    body = {
        "t": "Generate",
        "request_id": "x",
        "prompt_token_ids": [1],
        "params": {"temperature": 1, "stop_token_ids": [3, 4], "seed": None},
    }
    msg = decode(_raw(body))
    assert msg.params.temperature == 1.0 and type(msg.params.temperature) is float
    assert msg.params.stop_token_ids == (3, 4) and msg.params.seed is None


def test_an_error_code_arrives_as_its_enum_and_travels_as_a_string():
    ev = TokenEvent("r", [], "error", "lease ran out", error_code=ErrorCode.KV_TRANSFER_FAILED)
    assert msgpack.unpackb(encode(TokenEvents([ev])))["events"][0]["error_code"] == "kv_transfer_failed"
    assert decode(encode(TokenEvents([ev]))).events[0].error_code is ErrorCode.KV_TRANSFER_FAILED


def test_a_steps_plain_events_travel_flat_and_come_back_as_events():
    """TokenEvents.of: a plain event (tokens and nothing else) as its id and ids; the others whole. `all` gives every
    event back, the flat ones first, which keeps each request's order because each request is there once."""
    plain, last = TokenEvent("a", [5, 6]), TokenEvent("b", [7], FinishReason.LENGTH)
    landed = TokenEvent("c", [])  # "KV landed": plain too
    lp = TokenEvent("d", [8], logprobs=Logprobs([-0.5], [[8]], [[-0.5]]))
    msg = TokenEvents.of([plain, last, landed, lp])
    assert msg.tokens == ["a", [5, 6], "c", []] and msg.events == [last, lp]
    assert msgpack.unpackb(encode(msg))["tokens"] == ["a", [5, 6], "c", []]
    back = decode(encode(msg))
    assert back == msg and back.all() == [plain, landed, last, lp]


def test_a_step_with_two_events_of_one_request_travels_whole():
    evs = [TokenEvent("a", [5]), TokenEvent("b", [6]), TokenEvent("a", [], FinishReason.ABORT)]
    msg = TokenEvents.of(evs)
    assert msg.tokens == [] and msg.all() == evs
