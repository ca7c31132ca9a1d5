"""The OpenAI-compatible API through the official client, and bad input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from stack import Stack


@pytest.fixture(scope="module", params=["colocated", "disagg"])
def stack(request, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp(request.param), "tiny", mode=request.param)
    yield s.start()
    s.close()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_completion_and_chat(client):
    c = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, temperature=0)
    assert c.object == "text_completion" and c.usage.completion_tokens == 5
    assert c.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    assert chat.usage.prompt_tokens > 4  # the chat template wraps the message
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_streamed_completion_and_chat_match_unstreamed(client):
    kw = dict(model="tiny", max_tokens=6, temperature=0)
    whole = client.completions.create(prompt="abc", **kw).choices[0].text
    parts = client.completions.create(prompt="abc", stream=True, **kw)
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole
    msgs = [{"role": "user", "content": "xyz"}]
    whole = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    chunks = list(client.chat.completions.create(messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}, **kw))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="tiny", prompt="seed me", max_tokens=8, temperature=0.8, top_p=0.9, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_stop_string_cuts_the_text(client, stack):
    free = client.completions.create(model="tiny", prompt="stop test", max_tokens=12, temperature=0).choices[0].text
    stop = free[3:5]
    if not stop.strip("\ufffd"):
        pytest.fail(f"the tiny model's answer {free!r} has no usable stop string at [3:5]")
    cut = client.completions.create(model="tiny", prompt="stop test", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"
    used = stack.wait_kv_free()
    assert not any(used.values()), used


BAD = [
    ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ({"model": "tiny", "prompt": "x" * 3000}, 400, "context"),
    ({"model": "tiny", "prompt": [1, 2, 99999]}, 400, "vocabulary"),
    ({"model": "tiny", "prompt": [1, -1]}, 400, "vocabulary"),
    ({"model": "tiny", "prompt": ""}, 400, "empty"),
    ({"model": "tiny", "prompt": []}, 400, "empty"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 5000}, 400, "context"),
    ({"model": "tiny", "prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "top_k": 0}, 400, "top_k"),
    ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n=1"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "stop": ["a"] * 17}, 400, "stop strings"),
    ({"model": "tiny", "prompt": "x", "stop": "a" * 500}, 400, "stop string"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [1] * 1000}, 400, "stop token ids"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x" * 200_000}, 400, "characters"),
    ({"model": "tiny", "prompt": list(range(1, 5000))}, 400, "context"),
]


@pytest.mark.parametrize("body,status,words", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_a_4xx_openai_error(stack, body, status, words):
    r = httpx.post(stack.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"


def test_request_larger_than_the_kv_pool_is_a_400(tmp_path):
    stack = Stack(tmp_path, "tiny", mode="colocated", engine_args=("--num-kv-blocks", "8")).start()  # 128 tokens
    try:
        body = {"model": "tiny", "prompt": list(range(1, 100)), "max_tokens": 50}
        r = httpx.post(stack.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and "pool holds" in r.json()["error"]["message"]
        body["max_tokens"] = 20
        assert httpx.post(stack.url + "/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        stack.close()


def test_malformed_json_and_bad_chat_then_still_serving(stack):
    r = httpx.post(stack.url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(stack.url + "/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_health_and_metrics(stack):
    h = httpx.get(stack.url + "/health", timeout=10).json()
    assert h["status"] == "ok" and all(n["up"] for n in h["nodes"])
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    for name in ("pdserve_time_to_first_token_seconds_count", "pdserve_kv_blocks_free", "pdserve_num_waiting"):
        assert name in text


@pytest.mark.parametrize(
    "body,words",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seed": 2**70}, "seed"),
        ({"stop_token_ids": [10**9]}, "vocabulary"),
    ],
    ids=["nan-temperature", "nan-top-p", "huge-seed", "stop-id"],
)
def test_numbers_a_node_cannot_take_are_refused(stack, body, words):
    payload = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2, **body}, allow_nan=True)
    r = httpx.post(stack.url + "/v1/completions", content=payload, headers={"content-type": "application/json"},
                   timeout=30)  # fmt: skip
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert httpx.get(stack.url + "/health", timeout=10).status_code == 200


def test_tiny_temperature_is_greedy(client):
    kw = dict(model="tiny", prompt="abc", max_tokens=6)
    assert (
        client.completions.create(temperature=1e-30, **kw).choices[0].text
        == client.completions.create(temperature=0, **kw).choices[0].text
    )


def test_chat_without_max_tokens_runs_to_the_end(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0)
    assert chat.usage.completion_tokens > 16 or chat.choices[0].finish_reason == "stop"


def test_bench_load_generator_reads_every_token(stack):
    """bench/'s own HTTP client: every streamed token is counted, and an HTTP error becomes the record's error."""
    from bench.http_client import HttpTarget, run_http
    from bench.workloads import make_workload

    workload = make_workload("short_long_mix", vocab_size=512, max_model_len=2048, quick=True)
    _, records = run_http(HttpTarget(stack.url), workload, progress=False)
    assert [r.error for r in records] == [""] * len(records)
    assert [len(r.output_token_ids) for r in records] == [r.output_len for r in workload.requests]
    assert all(len(r.token_times) == r.expected_output_len for r in records)
    _, refused = run_http(HttpTarget(stack.url, model="no-such-model"), workload, progress=False)
    assert all("HTTP 404" in r.error and "no-such-model" in r.error for r in refused), refused[0].error
