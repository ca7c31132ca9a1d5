"""The OpenAI-compatible API through the official client, and bad input."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

import pdserve
from pdserve.checkpoint import resolve_model
from pdserve.wire.params import SamplingParams
from tests.helpers import hf_greedy, optional, wait_until
from tests.stack import Stack


@pytest.fixture(scope="module", params=["colocated", "disagg"])
def stack(request, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp(request.param), "tiny", mode=request.param, router_log=True)
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
    chunks = list(
        client.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    roles = [c.choices[0].delta.role for c in chunks if c.choices]
    assert roles[0] == "assistant" and len(roles) > 1 and not any(roles[1:])  # the first delta names it, only
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="tiny", prompt="seed me", max_tokens=8, temperature=0.8, top_p=0.9, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_stop_string_cuts_the_text(client, stack):
    free = client.completions.create(model="tiny", prompt="stop test", max_tokens=12, temperature=0).choices[0].text
    stop = free[3:5]
    if not stop.strip("\ufffd"):
        pytest.fail(f"the tiny model's answer {free!r} has no usable stop string at [3:5]")
    kw = dict(model="tiny", prompt="stop test", max_tokens=12, temperature=0)
    cut = client.completions.create(stop=["never \u2603", stop], **kw)
    assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].stop_reason == stop  # vLLM's field: which stop string ended it
    chunks = list(client.completions.create(stop=["never \u2603", stop], stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text
    assert [(c.choices[0].finish_reason, c.choices[0].stop_reason) for c in chunks][-1] == ("stop", stop)
    assert all(c.choices[0].stop_reason is None for c in chunks[:-1])
    chat = dict(model="tiny", messages=[{"role": "user", "content": "stop test"}], max_tokens=12, temperature=0)
    said = client.chat.completions.create(**chat).choices[0].message.content
    if said[3:5].strip("\ufffd"):
        ended = client.chat.completions.create(stop=[said[3:5]], **chat).choices[0]
        assert (ended.finish_reason, ended.stop_reason) == ("stop", said[3:5])
    long = client.completions.create(**kw).choices[0]
    assert (long.finish_reason, long.stop_reason) == ("length", None)
    stack.wait_kv_free()


# ---- log-probabilities and echo ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tiny():
    import torch
    import transformers

    from pdserve.checkpoint import resolve_model

    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:  # [len(ids), V]: teacher-forced
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return log_softmax


PROMPT = [17, 250, 3, 99, 41, 7, 300, 12]


def test_completion_logprobs_equal_transformers(client, hf_tiny):
    c = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, extra_body={"return_token_ids": True}
    )
    choice = c.choices[0]
    ids, lp = choice.token_ids, choice.logprobs
    ref = hf_tiny(PROMPT + ids)[len(PROMPT) - 1 : -1]  # [5, V]: the rows that predicted each token
    assert ids == ref.argmax(-1).tolist()
    assert lp.token_logprobs == pytest.approx(ref.max(-1).values.tolist(), abs=1e-4)
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for row, top in zip(ref, lp.top_logprobs, strict=True):  # keyed by text: byte tokens may share "\ufffd"
        assert 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(float(row.max()), abs=1e-4)


def _prompt_logprobs(hf_tiny) -> list[float]:
    """The teacher-forced log-probability of each of PROMPT's tokens after the first."""
    ref = hf_tiny(PROMPT)
    return [float(row[t]) for row, t in zip(ref[:-1], PROMPT[1:], strict=True)]


def _assert_echo_only(c, want: list[float]) -> None:
    """An echo with max_tokens 0: the prompt and its log-probabilities, nothing generated, ended by length."""
    choice = c.choices[0]
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert len(lp.tokens) == len(PROMPT) and "".join(lp.tokens) == choice.text
    assert c.usage.completion_tokens == 0 and choice.finish_reason == "length"


def test_echo_gives_the_prompt_and_its_teacher_forced_logprobs(client, hf_tiny):
    want = _prompt_logprobs(hf_tiny)
    c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    _assert_echo_only(c, want)
    choice = c.choices[0]
    both = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0)
    lp2 = both.choices[0].logprobs
    assert both.choices[0].text.startswith(choice.text) and len(lp2.tokens) == len(PROMPT) + 3
    assert lp2.token_logprobs[1 : len(PROMPT)] == pytest.approx(want, abs=1e-4)
    assert all(len(t) == 1 for t in lp2.top_logprobs[1:])  # logprobs=0: only the token itself


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0, "seed": 7},  # the client's sampler, which the hidden token must not use
        {"temperature": 1.0, "seed": 7, "logit_bias": {"EOS": 100}},  # a draw that can only be EOS
        {"temperature": 0, "stop_token_ids": ["GREEDY"]},  # the greedy token made a stop token
    ],
)
def test_echo_without_tokens_ends_by_length_whatever_the_sampling(client, stack, hf_tiny, sampling):
    """max_tokens 0 with echo: the token the nodes compute is nobody's business; EOS, a stop token or a bias in
    the client's parameters must not turn the answer's finish_reason into "stop"."""
    from pdserve.router.text import load_model_info

    (eos,) = load_model_info("tiny").eos_token_ids
    greedy = int(hf_tiny(PROMPT)[-1].argmax())
    body = dict(sampling)
    if "logit_bias" in body:
        body["logit_bias"] = {str(eos): 100}
    if "stop_token_ids" in body:
        body["stop_token_ids"] = [greedy]
    want = _prompt_logprobs(hf_tiny)
    c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, extra_body=body)
    _assert_echo_only(c, want)
    streamed = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, stream=True, extra_body=body
        )
    )
    assert "".join(p.choices[0].text for p in streamed if p.choices) == c.choices[0].text
    assert [p.choices[0].finish_reason for p in streamed if p.choices][-1] == "length"
    stack.wait_kv_free()


def test_streamed_logprobs_match_unstreamed(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.8, seed=5, logprobs=2, echo=True)
    whole = client.completions.create(**kw).choices[0].logprobs
    parts = [p.choices[0].logprobs for p in client.completions.create(stream=True, **kw) if p.choices]
    assert [t for p in parts if p for t in p.tokens] == whole.tokens
    assert [v for p in parts if p for v in p.token_logprobs] == whole.token_logprobs
    assert [v for p in parts if p for v in p.text_offset] == whole.text_offset
    msgs = [{"role": "user", "content": "hi"}]
    ckw = dict(model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=4)
    chat = client.chat.completions.create(**ckw)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 4 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-6) for c in content)  # greedy
    assert all(bytes(c.bytes).decode("utf-8", "replace") == c.token for c in content)
    streamed = [
        c
        for ch in client.chat.completions.create(stream=True, **ckw)
        if ch.choices and ch.choices[0].logprobs
        for c in ch.choices[0].logprobs.content
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
        ("completions", {"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "logprobs",
        ),
    ],
)
def test_bad_logprobs_are_400s(stack, path, body, param):
    r = httpx.post(f"{stack.url}/v1/{path}", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400 and param in r.json()["error"]["message"], r.text


# ---- logits processors -------------------------------------------------------------------------------------------


def test_penalties_change_greedy_as_defined(client, hf_tiny):
    """frequency f and presence p subtract f * count + p * (count > 0) from each generated token's logit: a
    reference loop over transformers' logits (log-softmax differs from them by a per-row constant)."""
    c = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    out: list[int] = []
    for _ in range(6):
        row = hf_tiny(PROMPT + out)[-1].clone()
        for t in set(out):
            row[t] -= 1.5 * out.count(t) + 0.5
        out.append(int(row.argmax()))
    assert c.choices[0].token_ids == out
    raw = hf_tiny(PROMPT + out)[len(PROMPT) - 1 : -1]
    want = [float(r[t]) for r, t in zip(raw, out, strict=True)]
    assert c.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-4)  # the raw distribution's


def test_logit_bias_min_tokens_and_stop_strings(client):
    kw = dict(model="tiny", prompt=PROMPT, temperature=0)
    forced = client.completions.create(
        max_tokens=4, logit_bias={"65": 100}, extra_body={"return_token_ids": True}, **kw
    )
    assert forced.choices[0].token_ids == [65] * 4
    free = client.completions.create(max_tokens=4, extra_body={"return_token_ids": True}, **kw).choices[0]
    first = free.token_ids[0]
    stopped = client.completions.create(max_tokens=4, extra_body={"stop_token_ids": [first]}, **kw)
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].stop_reason == first  # the stop token id
    streamed = list(client.completions.create(max_tokens=4, stream=True, extra_body={"stop_token_ids": [first]}, **kw))
    assert (streamed[-1].choices[0].finish_reason, streamed[-1].choices[0].stop_reason) == ("stop", first)
    held = client.completions.create(
        max_tokens=4, extra_body={"stop_token_ids": [first], "min_tokens": 3, "return_token_ids": True}, **kw
    )
    assert first not in held.choices[0].token_ids[:3] and held.usage.completion_tokens >= 3
    stop = free.text[1:3]
    if not stop.strip("\ufffd"):
        pytest.fail(f"the tiny model's answer {free.text!r} has no usable stop string at [1:3]")
    cut = client.completions.create(max_tokens=4, stop=[stop], extra_body={"include_stop_str_in_output": True}, **kw)
    assert cut.choices[0].text == free.text[: free.text.index(stop) + len(stop)]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": 99}, "min_tokens"),
    ],
)
def test_bad_processor_values_are_400s(stack, body, param):
    r = httpx.post(
        f"{stack.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4, **body}, timeout=30
    )
    assert r.status_code == 400 and param in r.json()["error"]["message"], r.text


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
    ({"model": "tiny", "prompt": "x", "n": 17}, 400, "n must be"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n must be"),
    ({"model": "tiny", "prompt": ["ok", ""]}, 400, "empty"),
    ({"model": "tiny", "prompt": [[1, 2], [3, 99999]]}, 400, "vocabulary"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "stop": ["a"] * 17}, 400, "stop strings"),
    ({"model": "tiny", "prompt": "x", "stop": "a" * 500}, 400, "stop string"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [1] * 1000}, 400, "stop token ids"),
    ({"model": "tiny", "prompt": "x" * 200_000}, 400, "characters"),
    ({"model": "tiny", "prompt": list(range(1, 5000))}, 400, "context"),
]


CHAT = {"messages": [{"role": "user", "content": "x"}]}
ONE_FIELD = [
    ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "top_k": 0}, "top_k"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
    ("completions", {"prompt": "x", "response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format"),
    ("chat/completions", {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "max_tokens": -1}, "max_tokens"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {**CHAT, "temperature": -0.5}, "temperature"),
]


@pytest.mark.parametrize("path,body,param", ONE_FIELD, ids=[f"{p}-{pa}-{i}" for i, (p, _, pa) in enumerate(ONE_FIELD)])
def test_a_bad_field_is_named_as_param_and_code_is_a_string_or_null(stack, path, body, param):
    r = httpx.post(f"{stack.url}/v1/{path}", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["code"] is None, err


def test_error_codes_are_strings_and_the_router_logs_each_error(stack):
    r = httpx.post(stack.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(stack.url + "/no/such/route", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] is None
    r = httpx.post(stack.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "top_p": 7}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    lines = (
        "POST /v1/completions -> 404 code=model_not_found param=model: model 'nope' does not exist",
        "GET /no/such/route -> 404: Not Found",
        "POST /v1/completions -> 400 param=top_p: top_p must be in (0, 1]",
    )
    logged = lambda: stack.router_log.read_text(errors="replace")  # noqa: E731
    assert wait_until(lambda: all(line in logged() for line in lines), 10), logged()[-3000:]


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
    r = httpx.post(
        stack.url + "/v1/completions", content=b"{not json", timeout=30, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    ok = {"model": "tiny", "prompt": "ok", "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(stack.url + "/v1/completions", json=ok, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_health_and_metrics(stack):
    h = httpx.get(stack.url + "/health", timeout=10).json()
    assert h["status"] == "ok" and all(n["up"] for n in h["nodes"])
    before = scrape(stack)
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "ignore_eos": True}  # sampled: EOS may come early
    c = httpx.post(stack.url + "/v1/completions", json=body, timeout=30)
    after = scrape(stack)
    grew = {k: after[k] - before.get(k, 0) for k in after}
    prompt_len = c.json()["usage"]["prompt_tokens"]
    assert grew["pdserve:prompt_tokens_total"] == prompt_len and grew["pdserve:generation_tokens_total"] == 4
    assert grew['pdserve:request_success_total{finished_reason="length"}'] == 1
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_decode_time_seconds",
        "request_time_per_output_token_seconds",
    ):
        assert grew[f"pdserve:{name}_count"] == 1 and grew[f'pdserve:{name}_bucket{{le="+Inf"}}'] == 1, name
    assert grew["pdserve:inter_token_latency_seconds_count"] == 3
    assert grew["pdserve:request_handoff_time_seconds_count"] == (stack.mode == "disagg")
    assert any(k.startswith("pdserve:kv_blocks_free{") for k in after)
    assert any(k.startswith("pdserve:num_requests_waiting{") for k in after)
    assert any(k.startswith("pdserve:num_preemptions_total{") for k in after)
    reports = {k: v for k, v in after.items() if k.startswith("pdserve:stats_reports_total{")}
    assert len(reports) == len(h["nodes"]), reports  # every node's heartbeats are counted, and keep coming:
    assert wait_until(lambda: all(scrape(stack)[k] > v for k, v in reports.items()), 30), reports
    # how the nodes ran their steps: every step counted once, eager or replayed; on the CPU no CUDA graph replays
    decoded = sum(node_counter(before, "eager_decode_tokens").values()) + 3  # the 3 tokens after the first
    assert wait_until(lambda: sum(node_counter(scrape(stack), "eager_decode_tokens").values()) >= decoded, 30)
    now = scrape(stack)
    steps, eager = node_counter(now, "steps"), node_counter(now, "eager_steps")
    assert steps == eager and len(steps) == len(h["nodes"]), (steps, eager)
    for key in ("graph_steps", "graph_tokens", "graph_decode_tokens", "graph_captures"):
        assert set(node_counter(now, key).values()) == {0}, key


def node_counter(samples: dict[str, float], key: str) -> dict[str, float]:
    """A node counter of one /metrics reading: {its labels: value}."""
    prefix = f"pdserve:node_{key}_total{{"
    return {k[len(prefix) :]: v for k, v in samples.items() if k.startswith(prefix)}


def scrape(stack) -> dict[str, float]:
    """Every sample of /metrics, by its name and labels."""
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


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
    r = httpx.post(
        stack.url + "/v1/completions", content=payload, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert httpx.get(stack.url + "/health", timeout=10).status_code == 200


def test_tiny_temperatures_give_the_greedy_tokens_on_both_paths(client):
    """1e-30 takes the greedy branch (below 1e-5: dividing by it would overflow); 1e-4 really samples (seeded), its
    logits divided by the temperature, which leaves all but the most likely token with no chance here: both give
    transformers' greedy tokens, and neither a NaN nor an overflow."""
    assert SamplingParams(temperature=1e-30).greedy and not SamplingParams(temperature=1e-4).greedy
    want = hf_greedy(resolve_model("tiny"), [PROMPT], [6])[0]
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True, "return_token_ids": True})
    for temperature in (1e-30, 1e-4):
        got = client.completions.create(temperature=temperature, seed=11, **kw).choices[0].token_ids
        assert got == want, temperature


def _chat_tokens(stack, content: str) -> int:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
    return httpx.post(stack.url + "/tokenize", json=body, timeout=30).json()["count"]


def test_chat_without_max_tokens_runs_to_the_end(stack, client):
    """Without max_tokens a chat may run to the end of the context: a prompt that leaves about 24 tokens of it."""
    empty, hundred = _chat_tokens(stack, ""), _chat_tokens(stack, "hi " * 100)
    content = "hi " * int(100 * (2048 - 24 - empty) / (hundred - empty))
    prompt_len = _chat_tokens(stack, content)
    assert 2048 - 48 < prompt_len < 2048
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], temperature=0)
    assert chat.usage.prompt_tokens == prompt_len
    if chat.choices[0].finish_reason == "length":
        assert chat.usage.completion_tokens == 2048 - prompt_len
    else:
        assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens < 2048 - prompt_len


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


def test_streams_one_after_another_on_one_kept_open_connection(stack):
    """A client that keeps its connection open (the OpenAI SDK's does, and `bench.router --keep-alive`): streamed
    answers, whose bodies the router writes past h11, one after another on one connection, each whole."""
    from bench.http_client import Connections, HttpTarget, send
    from bench.workloads import BenchRequest

    async def three(conns: Connections) -> list:
        try:
            return [
                await send(
                    stack.url + "/v1/completions",
                    "tiny",
                    BenchRequest((5, 6, 7), n),
                    HttpTarget(stack.url),
                    conns=conns,
                )
                for n in (3, 40, 7)
            ]
        finally:
            conns.close()

    conns = Connections(keep_alive=True)
    records = asyncio.run(three(conns))
    assert [(r.error, len(r.output_token_ids)) for r in records] == [("", 3), ("", 40), ("", 7)]
    assert conns.opened == 1, f"{conns.opened} connections for three requests"


REFUSED = [
    ("best_of", 3),
    ("suffix", "tail"),
    ("top_logprobs", 2),
    ("prompt_logprobs", 1),
    ("use_beam_search", True),
    ("response_format", {"type": "grammar"}),
    ("tools", [{"type": "function"}]),
    ("tool_choice", "auto"),
    ("audio", {"voice": "x"}),
    ("guided_json", {"type": "object"}),
    ("stream_options", {"include_usage": True, "continuous_usage_stats": True}),
]


@pytest.mark.parametrize("name,value", REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_field_is_a_400_naming_it(stack, name, value):
    r = httpx.post(stack.url + "/v1/completions", json={"model": "tiny", "prompt": "x", name: value}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and name in err["message"]


def test_harmless_and_neutral_fields_are_accepted(client):
    extra = {
        "user": "u1",
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "store": False,
        "best_of": 1,
        "echo": False,
        "logprobs": None,
        "presence_penalty": 0,
        "tool_choice": "none",
        "unknown_but_null": None,
        "ignore_eos": True,
    }
    c = client.completions.create(model="tiny", prompt="abc", max_tokens=2, extra_body=extra)
    assert c.usage.completion_tokens == 2
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        temperature=0,
        user="u1",
        store=False,
        logprobs=False,
        tool_choice="none",
    )
    assert chat.usage.completion_tokens == 2
    r = httpx.post(
        stack_url(client) + "/chat/completions",
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "echo": True},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def stack_url(client) -> str:
    return str(client.base_url).rstrip("/")


def test_tokenize_detokenize_version(stack):
    r = httpx.post(stack.url + "/tokenize", json={"model": "tiny", "prompt": "Hello", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0
    assert body["max_model_len"] == 2048
    back = httpx.post(stack.url + "/detokenize", json={"model": "tiny", "tokens": body["tokens"]}).json()
    assert back == {"prompt": "Hello"}
    chat = httpx.post(stack.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    c = httpx.post(
        stack.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ).json()
    assert chat["count"] == c["usage"]["prompt_tokens"]  # the same template as the chat endpoint
    assert httpx.post(stack.url + "/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert httpx.post(stack.url + "/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert httpx.get(stack.url + "/version").json()["version"] == pdserve.__version__


def test_api_key_guards_every_route_but_health(stack):
    """A router of its own with PDSERVE_API_KEY set, over the module's nodes."""
    keyed = stack.with_router(api_key="s3cret")
    try:
        routes = [
            ("GET", "/v1/models", None),
            ("GET", "/metrics", None),
            ("GET", "/version", None),
            ("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}),
            (
                "POST",
                "/v1/chat/completions",
                {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
            ),
            ("POST", "/tokenize", {"prompt": "x"}),
            ("POST", "/detokenize", {"tokens": [1]}),
        ]
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = httpx.request(method, keyed.url + path, json=body, headers=headers, timeout=30)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
            r = httpx.request(method, keyed.url + path, json=body, headers=keyed.headers, timeout=30)
            assert r.status_code == 200, (path, r.text)
        assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200
        good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        keyed.close()


def test_n_with_a_seed_gives_different_reproducible_choices(client):
    kw = dict(model="tiny", prompt="seed me", max_tokens=8, temperature=1.0, seed=7)
    four = client.completions.create(n=4, **kw)
    texts = [c.text for c in sorted(four.choices, key=lambda c: c.index)]
    assert [c.index for c in four.choices] == [0, 1, 2, 3] and len(set(texts)) == 4, texts
    assert [c.text for c in client.completions.create(n=4, **kw).choices] == texts
    assert client.completions.create(**kw).choices[0].text == texts[0]  # n=1 is sample 0
    assert four.usage.completion_tokens == 32 and four.usage.prompt_tokens == len("seed me")
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], n=3, max_tokens=6, seed=3
    )
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 3


def test_batched_prompts_match_one_at_a_time(client):
    prompts = ["Hello there", "abc", "a longer prompt than the others"]
    kw = dict(model="tiny", max_tokens=5, temperature=0)
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [t for t in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(len(p) for p in prompts) and batch.usage.completion_tokens == 30
    ids = [[72, 101, 108], [97, 98]]
    by_ids = client.completions.create(prompt=ids, extra_body={"return_token_ids": True}, **kw)
    assert [c.token_ids for c in by_ids.choices] == [
        client.completions.create(prompt=p, extra_body={"return_token_ids": True}, **kw).choices[0].token_ids
        for p in ids
    ]


def test_streamed_batch_and_n_reassemble_by_index(client):
    kw = dict(model="tiny", prompt=["one", "two"], n=2, max_tokens=6, temperature=0.9, seed=11)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, reasons = {}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    assert texts == {c.index: c.text for c in whole.choices} and set(reasons.values()) == {"length"}
    assert chunks[-1].usage.completion_tokens == 24 and len({c.id for c in chunks}) == 1


PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "colors"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "colors": {"type": "array", "maxItems": 2, "items": {"enum": ["red", "green"]}},
    },
}


JSON_SEED = 3  # the random tiny model, sampled with this seed, closes its JSON object within max_tokens


def test_response_format_json_schema_and_json_object(client):
    """Greedy, n=3 sampled and streamed, and json_object: every answer parses, and is an instance of its schema."""
    jsonschema = optional("jsonschema")
    optional("llguidance")
    kw = dict(model="tiny", messages=[{"role": "user", "content": "a person, as JSON"}], max_tokens=120)
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    greedy = client.chat.completions.create(response_format=schema, temperature=0, **kw)
    answers = [greedy.choices[0]]
    streamed = client.chat.completions.create(response_format=schema, n=3, temperature=1.0, seed=4, stream=True, **kw)
    texts, reasons = {}, {}
    for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    assert sorted(texts) == [0, 1, 2] and set(reasons.values()) == {"stop"}
    assert greedy.choices[0].finish_reason == "stop"
    for text in [a.message.content for a in answers] + list(texts.values()):
        jsonschema.validate(json.loads(text), PERSON)
    obj = client.chat.completions.create(response_format={"type": "json_object"}, temperature=1.0, seed=JSON_SEED, **kw)
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    done = client.completions.create(
        model="tiny",
        prompt="[",
        max_tokens=60,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "list",
                    "schema": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                },
            }
        },
    )
    assert all(type(x) is bool for x in json.loads(done.choices[0].text))


def test_bad_schema_is_a_clear_400(client):
    optional("llguidance")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], response_format=bad)
    err = e.value.body
    assert err["param"] == "response_format" and "JSON schema" in err["message"], err
