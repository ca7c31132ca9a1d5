"""The edges of the prefill -> decode handoff, end to end over zmq and over shm, on one stack per transport
(a prefill node, two decode nodes of 24 KV blocks each) serving `tiny` with a Qwen-style chat template:

1. the prefill node's first token ends the request (a stop string: the router's abort races the KV offer;
   a stop token id; EOS);
2. a decode node preempts requests whose KV it received, and recomputes them there (echo, logprobs; a
   grammar);
3. a chat template with list-of-parts content, and multi-byte text (CJK, emoji) streamed and as a stop string;
4. a decode node dies mid-stream: greedy, seeded and guided streams resume from what they streamed, and
   end exactly as their undisturbed twins on the other decode node;
5. clients hang up while KV is in flight: one request's pull is lost on the way (a fault injected on
   purpose, so it stays RECEIVING_KV), another waits for blocks behind it (WAITING_FOR_KV).

After each, every live node's KV pool and request tables are empty, as its stats report them once they
count the test's requests (a wait that times out fails with what it last saw).
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest
import torch
import transformers

from bench.systems import node_counters
from pdserve.checkpoint import resolve_model
from tests.helpers import Stream
from tests.stack import NO_LOCAL_PREFILL, Stack

DECODE_BLOCKS = 24  # x 16 tokens: two 216-token requests do not fit at once, so one is preempted
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
UNICODE = "你好🙂世界"


# ---- the model, its reference, the stack ------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """`tiny` with a Qwen-style chat template (a default system prompt, list-of-parts content) of its own."""
    folder = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(resolve_model("tiny"), folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.chat_template = QWEN_TEMPLATE
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module", params=["zmq", "shm"])
def stack(request, tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp(f"edges-{request.param}")
    s = Stack(
        tmp,
        str(model_dir),
        mode="disagg",
        transport=request.param,
        num_decode=2,
        decode_args=("--num-kv-blocks", str(DECODE_BLOCKS), "--kv-lease-s", "120"),
        router_args=("--node-timeout-s", "30", *NO_LOCAL_PREFILL),
    ).start()  # (starved is not dead)
    yield s
    s.close()


def logprobs_of(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the next token at each position of `ids`: [len(ids), V]."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def assert_greedy(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Every token of `output` is transformers' greedy choice after the prompt and the tokens before it (what
    `generate` would give, checked in one forward pass); returns the log-probabilities of the output's positions."""
    lp = logprobs_of(hf, prompt + output)[len(prompt) - 1 : -1]  # [len(output), V]
    want = lp.argmax(-1).tolist()
    first_bad = next((i for i, (a, b) in enumerate(zip(output, want, strict=True)) if a != b), None)
    assert first_bad is None, f"token {first_bad} is {output[first_bad]}, transformers' greedy choice {want[first_bad]}"
    return lp


# ---- what the nodes report --------------------------------------------------------------------------


def _gauge(text: str, name: str) -> dict[str, float]:
    """{node address: value} of a per-node gauge of the router's /metrics."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            out[line.split('node="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _read(stack: Stack) -> dict:
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    up = {n["addr"]: n["role"] for n in httpx.get(stack.url + "/health", timeout=10).json()["nodes"] if n["up"]}
    blocks, held = _gauge(text, "pdserve:kv_blocks_used"), _gauge(text, "pdserve:node_requests_held")
    return {
        "counters": node_counters(text),
        "preemptions": _gauge(text, "pdserve:num_preemptions_total"),
        "waiting": _gauge(text, "pdserve:num_requests_waiting"),
        "redispatched": _value(text, "pdserve:requests_redispatched_total"),
        "nodes": {a: (r, blocks.get(a), held.get(a)) for a, r in up.items()},
    }


def _value(text: str, name: str) -> float:
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def wait_for(stack: Stack, cond, what: str, timeout: float = 60.0) -> dict:
    """Poll the router's view of the nodes until `cond(reading)` holds; fail with the last reading if it does not."""
    deadline = time.monotonic() + timeout
    while True:
        seen = _read(stack)
        if cond(seen):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s; last seen {seen}")
        time.sleep(0.05)


def counted(seen: dict, least: dict[str, dict[str, float]]) -> bool:
    return all(seen["counters"].get(role, {}).get(k, 0) >= v for role, want in least.items() for k, v in want.items())


def wait_pools_empty(stack: Stack, least: dict[str, dict[str, float]]) -> dict:
    """Wait until the nodes' stats count at least `least` ({role: {counter: value}}: the prefill node's report the
    test's requests), the decode nodes have seen every KV offer the prefill node made (so their zeros are not stale
    ones either), and every live node holds no KV block and no request."""

    def empty(seen):
        offers = {role: seen["counters"].get(role, {}).get("kv_offers", 0) for role in ("prefill", "decode")}
        return (
            counted(seen, least)
            and offers["decode"] >= offers["prefill"]
            and all(b == 0 and h == 0 for _, b, h in seen["nodes"].values())
        )

    return wait_for(stack, empty, f"every pool empty once the nodes count {least}")


def plus(seen: dict, more: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {role: {k: seen["counters"].get(role, {}).get(k, 0) + v for k, v in m.items()} for role, m in more.items()}


def post_all(stack: Stack, path: str, bodies: list[dict]) -> list[httpx.Response]:
    out: list = [None] * len(bodies)

    def one(i: int) -> None:
        out[i] = httpx.post(stack.url + path, json=bodies[i], timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in out), "a request did not come back"
    return out


def wait_tokens(streams: list[Stream], n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(len(s.token_ids) >= n or s.error or s.done for s in streams):
        assert time.monotonic() < deadline, f"streams did not reach {n} tokens: {[len(s.token_ids) for s in streams]}"
        time.sleep(0.01)
    assert not any(s.error or s.done for s in streams), [(s.error, s.done, len(s.token_ids)) for s in streams]


# ---- 1. the first token ends the request ---------------------------------------------------------------


@pytest.fixture(scope="module")
def first_token(hf, tok):
    """A prompt whose greedy first token is printable text of its own (a stop string that it alone matches)."""
    for start in range(1, 200):
        prompt = list(range(start, start + 12))
        t0 = int(logprobs_of(hf, prompt)[-1].argmax())
        text = tok.decode([t0])
        if text.isascii() and text.strip() == text and text.isprintable() and text:
            return prompt, t0, text
    raise AssertionError("no prompt of tiny's starts with a printable token")


def test_a_first_token_that_ends_the_request_frees_both_pools(stack, model_dir, tok, first_token):
    prompt, t0, text0 = first_token
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    base = {"model": str(model_dir), "prompt": prompt, "max_tokens": 360, "temperature": 0, "return_token_ids": True}
    cases = {
        "stop string": ({**base, "stop": [text0], "ignore_eos": True}, [t0], ""),  # the router's abort vs the offer
        "stop token": ({**base, "stop_token_ids": [t0], "ignore_eos": True}, [t0], text0),  # the prefill node ends it
        "EOS": ({**base, "logit_bias": {str(eos): 100}}, [eos], ""),  # the prefill node ends it
    }
    before = _read(stack)
    bodies = [body for body, _, _ in cases.values() for _ in range(4)]
    responses = post_all(stack, "/v1/completions", bodies)
    for (name, (_, ids, text)), rs in zip(cases.items(), [responses[i : i + 4] for i in (0, 4, 8)], strict=True):
        assert [r.status_code for r in rs] == [200] * 4, (name, rs[0].text)
        got = [(c["finish_reason"], c["token_ids"], c["text"]) for c in (r.json()["choices"][0] for r in rs)]
        assert got == [("stop", ids, text)] * 4, (name, got)
    seen = wait_pools_empty(stack, plus(before, {"prefill": {"requests": 12}}))
    decoded = seen["counters"]["decode"]["tokens_out"] - before["counters"].get("decode", {}).get("tokens_out", 0)
    assert decoded < 4 * 360 / 2, f"the decode nodes generated {decoded} tokens for requests the router had stopped"


# ---- 2. preemption on the decode node -----------------------------------------------------------------


# 9 blocks a request on arrival, 14 at its end: one whole beside another's arrival fits (23 of 24), two do not (28)
PREEMPT_PROMPT, PREEMPT_OUT = 136, 80


def preempting_prompts(start: int) -> list[list[int]]:
    """Four prompts, two a decode node: the newer arrives while the older decodes (however late, it fits), both
    grow until the pool runs dry, and the newer is preempted (some tokens in) and recomputed there once the older
    ends. Their first blocks are their own (`start`..., 50 apart): no other test's cached prefix shortens them."""
    return [[1 + (start + 50 * i + j) % 499 for j in range(PREEMPT_PROMPT)] for i in range(4)]


def preemptions(before: dict, seen: dict) -> dict[str, float]:
    """The preemptions of each decode node between two readings."""
    nodes = [a for a, (role, _, _) in before["nodes"].items() if role == "decode"]
    return {a: seen["preemptions"].get(a, 0) - before["preemptions"].get(a, 0) for a in nodes}


def test_decode_node_preempts_received_requests_and_recomputes_them_exactly(stack, model_dir, hf):
    """Four prompts dispatched together: two to each decode node, whose 24 blocks hold one of them whole, not two;
    the newer is preempted and recomputes there, and all four answers are transformers' greedy ones, with its
    log-probabilities, the prompt's (echo) included."""
    prompts = preempting_prompts(299)
    before = _read(stack)
    body = {
        "model": str(model_dir),
        "prompt": prompts,
        "max_tokens": PREEMPT_OUT,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "return_token_ids": True,
    }
    r = httpx.post(stack.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for prompt, c in zip(prompts, choices, strict=True):
        out = c["token_ids"][-PREEMPT_OUT:]
        assert len(out) == PREEMPT_OUT and c["finish_reason"] == "length"
        lp = assert_greedy(hf, prompt, out)
        got = c["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == len(prompt) + PREEMPT_OUT  # echo: the prompt's, then the output's
        want = logprobs_of(hf, prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
        want += lp.gather(1, torch.tensor(out)[:, None])[:, 0].tolist()
        assert max(abs(a - b) for a, b in zip(got[1:], want, strict=True)) < 1e-3
    wait_for(stack, lambda seen: all(preemptions(before, seen).values()), "a preemption on each decode node")
    wait_pools_empty(stack, plus(before, {"prefill": {"requests": 4}, "decode": {"kv_received": 4}}))


def test_decode_node_preempts_guided_requests_and_recomputes_them_exactly(stack, model_dir):
    """The same with a grammar (a JSON string of at least 2000 characters: no end within the answers): the newer
    request on each decode node is preempted and recomputed with its grammar state; each answer equals that of
    the same request sent alone afterwards, which no decode node preempts."""
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "minLength": 2000}}}
    prompts = preempting_prompts(324)
    body = {
        "model": str(model_dir),
        "max_tokens": PREEMPT_OUT,
        "temperature": 0,
        "response_format": fmt,
        "return_token_ids": True,
    }
    before = _read(stack)
    r = httpx.post(stack.url + "/v1/completions", json={**body, "prompt": prompts}, timeout=300)
    assert r.status_code == 200, r.text
    crowded = sorted(r.json()["choices"], key=lambda c: c["index"])
    # the reading once the pools are empty is each node's report after its last step: its preemptions are final
    mid = wait_pools_empty(stack, plus(before, {"prefill": {"requests": 4}, "decode": {"kv_received": 4}}))
    assert all(preemptions(before, mid).values()), f"a decode node preempted nothing: {preemptions(before, mid)}"
    alone = [httpx.post(stack.url + "/v1/completions", json={**body, "prompt": p}, timeout=300) for p in prompts]
    assert [a.status_code for a in alone] == [200] * 4, [a.text for a in alone]
    after = wait_pools_empty(stack, plus(mid, {"prefill": {"requests": 4}}))
    assert not any(preemptions(mid, after).values()), "a request sent alone was preempted: the twins prove nothing"
    for c, a in zip(crowded, (a.json()["choices"][0] for a in alone), strict=True):
        assert c["finish_reason"] == "length" and len(c["token_ids"]) == PREEMPT_OUT and c["text"][0] == '"', c
        assert (c["token_ids"], c["text"]) == (a["token_ids"], a["text"])


# ---- 3. a chat template, multi-byte text ---------------------------------------------------------------


def test_a_chat_template_with_list_of_parts_content(stack, model_dir, hf, tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again?"},
    ]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nHello world<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    body = {
        "model": str(model_dir),
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert c["token_ids"] == want and c["message"]["content"] == tok.decode(want)


def test_multi_byte_text_streams_whole_and_stops(stack, model_dir):
    """A grammar makes tiny write CJK and an emoji, a byte a token: no chunk carries half a character, and an
    emoji as a stop string ends the text before it."""
    fmt = {"type": "json_schema", "json_schema": {"name": "u", "schema": {"type": "string", "const": UNICODE}}}
    body = {"model": str(model_dir), "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0, "response_format": fmt}
    before = _read(stack)
    whole, stopped = Stream(stack.url, body), Stream(stack.url, {**body, "stop": ["🙂"]})
    for s in (whole, stopped):
        s.start()
    for s in (whole, stopped):
        s.join(timeout=120)
    assert whole.done and not whole.error and whole.finish == "stop", (whole.error, whole.finish)
    assert "".join(whole.texts) == json.dumps(UNICODE, ensure_ascii=False)
    assert len(whole.token_ids) > len(UNICODE) + 2, "the characters did not span several tokens"
    assert not any("\ufffd" in t for t in whole.texts), whole.texts
    assert stopped.done and stopped.finish == "stop" and "".join(stopped.texts) == '"你好', stopped.texts
    wait_pools_empty(stack, plus(before, {"prefill": {"requests": 2}}))


# ---- 4. a decode node dies mid-stream ------------------------------------------------------------------


def test_streams_resume_exactly_when_a_decode_node_dies(stack, model_dir, hf):
    """Six streams started one after another go to decode0, decode1, decode0, ... in turn: a greedy, a seeded and a
    guided one on each. decode0 is killed once every stream has some tokens; its three resume on decode1 from what
    they streamed and must end as their twins that decode1 served throughout."""
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "minLength": 2000}}}
    common = {"model": str(model_dir), "prompt": [9, 8, 7, 6], "max_tokens": 120}
    kinds = [
        {**common, "temperature": 0, "ignore_eos": True},
        {**common, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True},
        {**common, "temperature": 0, "response_format": fmt},
    ]
    before = _read(stack)
    streams = []
    for body in [kinds[0], kinds[0], kinds[1], kinds[1], kinds[2], kinds[2]]:
        streams.append(Stream(stack.url, body))
        streams[-1].start()
        wait_tokens(streams[-1:], 1)  # dispatched before the next one is sent
    wait_tokens(streams, 4)
    health = httpx.get(stack.url + "/health", timeout=10).json()["nodes"]
    assert [n["in_flight"] for n in health if n["role"] == "decode"] == [3, 3], health
    dead = stack.infos["decode0"]["listen"]
    stack.kill("decode0")
    for s in streams:
        s.join(timeout=120)
    assert all(s.done and not s.error and len(s.token_ids) == 120 for s in streams), [
        (s.error, s.done, len(s.token_ids)) for s in streams
    ]
    seen = wait_for(stack, lambda r: r["redispatched"] >= before["redispatched"] + 3, "three streams dispatched again")
    assert seen["redispatched"] == before["redispatched"] + 3
    resumed, twins = streams[0::2], streams[1::2]  # decode0's, decode1's
    assert [s.token_ids for s in resumed] == [s.token_ids for s in twins]
    assert ["".join(s.texts) for s in resumed] == ["".join(s.texts) for s in twins]
    assert_greedy(hf, common["prompt"], resumed[0].token_ids)
    assert resumed[1].token_ids != resumed[0].token_ids, "the seeded stream did not sample"
    assert "".join(resumed[2].texts).startswith('"'), "the guided stream is not a JSON string"
    # decode0's counters stay as its last report left them (an offer it got after that is never counted), so the
    # offers check of wait_pools_empty does not apply: zeros are trusted from reports sent after the streams ended
    stack.wait_kv_free(dead=(dead,))
    wait_for(stack, lambda r: all(b == 0 and h == 0 for _, b, h in r["nodes"].values()), "no live node holds KV")


# ---- 5. clients hang up while KV is in flight ----------------------------------------------------------


def test_hanging_up_while_kv_is_in_flight_frees_both_pools(stack, model_dir):
    """With decode1 the only decode node (decode0 died above, or is killed here), the prefill node is restarted to
    lose one message of every transfer it sends (the decode node then waits for the rest: the lease is long), so
    a 350-token prompt's KV stays RECEIVING_KV in 22 of decode1's 24 blocks, and a 100-token prompt's offer waits
    for blocks behind it (WAITING_FOR_KV). The client hangs up: everything is freed on both nodes."""
    for name in ("decode0", "prefill0"):
        if stack.procs[name].poll() is None:
            stack.kill(name)
    stack.restart_node(
        "prefill0", "prefill", ("--kv-fault-rate", "1", "--kv-fault-kinds", "drop", "--kv-lease-s", "300")
    )
    prefill = stack.infos["prefill0"]["listen"]
    fresh = wait_for(
        stack,
        lambda r: prefill in r["nodes"] and r["counters"].get("prefill", {}).get("requests") == 0,
        "the new prefill node up",
    )  # (its counters start from zero)
    before = fresh
    decode = next(a for a, (role, _, _) in before["nodes"].items() if role == "decode")
    body = {
        "model": str(model_dir),
        "prompt": [list(range(1, 351)), list(range(7, 107))],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=120) as r:
        firsts = set()
        lines = r.iter_lines()
        while len(firsts) < 2:  # both prompts' first tokens are out: both KV offers are made
            line = next(lines)
            if line.startswith("data: {"):
                firsts.add(json.loads(line[6:])["choices"][0]["index"])

        def in_flight(seen):
            _, blocks, _ = seen["nodes"][decode]
            return (
                counted(seen, plus(before, {"prefill": {"kv_faults_injected": 1}, "decode": {"kv_offers": 2}}))
                and blocks == 22
                and seen["waiting"].get(decode) == 1
            )

        wait_for(stack, in_flight, "one request receiving its KV, one waiting for blocks")
    after = wait_pools_empty(stack, plus(before, {"prefill": {"requests": 2}}))
    for k in ("kv_received", "kv_bad", "kv_refused"):
        assert after["counters"]["decode"].get(k, 0) == before["counters"]["decode"].get(k, 0), k
