"""Bad input the router's validation must answer with a 400 naming the field at fault where there is one, never a
crash of the handler (a 500): JSON nested deeper than the parser recurses, text that is no Unicode (a lone
surrogate, which JSON's \\ud800 escape can carry), and logit_bias keys that are digits to str.isdigit but no ASCII
decimal number; malformed JSON names no field on every route; and large input (many choices, many messages) is
refused or moved off the event loop before it costs the router's loop its time."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from pdserve.config import RouterConfig
from pdserve.router import api, small_routes
from pdserve.router.core import Overloaded
from pdserve.router.errors import ApiError
from pdserve.router.jobs import ChatBody, CompletionBody, chat_ids, make_job, prompt_ids
from pdserve.router.limits import OFFLOAD_CHARS, Offload
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


@pytest.mark.parametrize("prompt", ["\ud800", "ab\udfffc", ["ok", "x\udc00"]])
def test_a_prompt_with_a_lone_surrogate_is_refused(info, prompt):
    body = CompletionBody(model="tiny", prompt=prompt)
    e = _refused(prompt_ids, body, info, Offload())
    assert e.param == "prompt" and "surrogate" in e.message


SURROGATE_MESSAGES = [  # (the second message, where its lone surrogate is)
    ({"role": "user", "content": "\ud800"}, "content"),
    ({"role": "user", "content": [{"type": "text", "text": "a\udbff"}]}, "content[0].text"),
    ({"role": "user\ud800", "content": "hi"}, "role"),
    ({"role": "user", "content": "hi", "name": "a\udc00"}, "name"),
    (
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "\ud800"}}]},
        "tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize("message,where", SURROGATE_MESSAGES)
def test_a_message_with_a_lone_surrogate_is_refused_naming_where(info, message, where):
    body = ChatBody(model="tiny", messages=[{"role": "system", "content": "ok"}, message])
    e = _refused(chat_ids, body, info, Offload())
    assert e.param == f"messages[1].{where}" and "surrogate" in e.message and e.param in e.message


@pytest.mark.parametrize("message,where", SURROGATE_MESSAGES)
def test_tokenize_refuses_a_message_with_a_lone_surrogate(info, message, where):
    body = small_routes.TokenizeBody(messages=[message])
    e = _refused(small_routes._tokenize, info, body)
    assert e.param == f"messages[0].{where}" and "surrogate" in e.message


def test_tokenize_refuses_a_lone_surrogate(info):
    e = _refused(small_routes._tokenize, info, small_routes.TokenizeBody(prompt="x\ud800"))
    assert e.param == "prompt" and "surrogate" in e.message


def test_text_with_a_surrogate_pair_written_as_two_escapes_is_fine(info):
    body = CompletionBody(**json.loads('{"model": "tiny", "prompt": "\\ud83d\\ude00"}'))
    assert asyncio.run(prompt_ids(body, info, Offload()))[0]


@pytest.mark.parametrize("key", ["²", "¹", "١", "٣", "𝟙", "1²"])
def test_a_logit_bias_key_that_is_no_ascii_decimal_is_refused(info, key):
    body = CompletionBody(model="tiny", prompt=[1, 2], max_tokens=2, logit_bias={key: 1.0})
    e = _refused(make_job, body, [1, 2], info)
    assert e.param == "logit_bias" and repr(key) in e.message


def test_a_logit_bias_key_of_ascii_digits_is_its_token_id(info):
    body = CompletionBody(model="tiny", prompt=[1, 2], max_tokens=2, logit_bias={"7": 2.5, "011": -1.0})
    assert make_job(body, [1, 2], info).params.logit_bias == ((7, 2.5), (11, -1.0))


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
@pytest.mark.parametrize("raw", [b"{", b'{"tokens": [1,'])
def test_malformed_json_on_a_small_route_names_no_param(path, raw):
    from fastapi.testclient import TestClient

    from pdserve.config import RouterConfig

    app = api.create_app(RouterConfig(colocated=("tcp://127.0.0.1:1",), access_log=False))
    r = TestClient(app).post(path, content=raw, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None and "malformed JSON" in err["message"], err


class _CountingCore:
    """A router core that counts what is dispatched and refuses past --max-queued-requests, as RouterCore does."""

    def __init__(self, limit: int) -> None:
        self.limit, self.submitted, self.aborted = limit, 0, 0

    def kv_capacity_tokens(self, role) -> None:
        return None

    def check_admission(self) -> None:
        if self.submitted - self.aborted >= self.limit:
            raise Overloaded("full", 1)

    def submit(self, prompt_ids, params) -> SimpleNamespace:
        self.check_admission()
        self.submitted += 1
        return SimpleNamespace(request_id=str(self.submitted))

    def abort(self, request_id, reason=None) -> None:
        self.aborted += 1


def _state(info, core: _CountingCore) -> SimpleNamespace:
    cfg = RouterConfig(colocated=("tcp://127.0.0.1:1",), max_queued_requests=core.limit, max_n=4)
    return SimpleNamespace(offload=Offload(), served={"tiny"}, info=info, cfg=cfg, core=core, outbox=None)


def _call() -> api.Call:
    async def connected() -> bool:
        return False

    return api.Call("POST /v1/completions", SimpleNamespace(usage=None), connected)


@pytest.mark.parametrize(("prompts", "n"), [(9, 1), (3, 3), (200_000, 4)])
def test_more_choices_than_can_ever_wait_are_refused_before_any_is_built(info, prompts, n):
    """A batch of prompts times n choices beyond --max-queued-requests could never be admitted: it is a 400 naming
    the prompt, before any prompt is tokenized or dispatched (a 2 MB body of 500k prompts once held the router)."""
    core = _CountingCore(limit=8)
    raw = json.dumps({"model": "tiny", "prompt": [[1, 2]] * prompts, "n": n, "max_tokens": 1, "stream": True})
    e = _refused(api.answer, _state(info, core), _call(), raw.encode(), False)
    assert e.param == "prompt" and f"{prompts * n} choices" in e.message and "--max-queued-requests" in e.message
    assert core.submitted == 0


def test_as_many_choices_as_can_wait_are_dispatched(info):
    core = _CountingCore(limit=8)
    raw = json.dumps({"model": "tiny", "prompt": [[1, 2]] * 4, "n": 2, "max_tokens": 1, "stream": True})
    asyncio.run(api.answer(_state(info, core), _call(), raw.encode(), False))
    assert core.submitted == 8 and core.aborted == 0


class _RecordingOffload(Offload):
    """Offload that records the size each call was judged by."""

    def __init__(self) -> None:
        super().__init__(workers=1)
        self.sizes: list[int] = []

    async def run(self, size, fn, *args):
        self.sizes.append(size)
        return await super().run(size, fn, *args)


def test_many_empty_messages_are_templated_off_the_event_loop(info):
    """A chat's template costs per message as well as per character (about 10 us a message, the cost of some 23
    characters, on tiny): 20000 empty messages (0.3 s of templating) go to the pool, not the event loop."""
    offload = _RecordingOffload()
    body = ChatBody(model="tiny", messages=[{"role": "user", "content": ""}] * 20_000)
    asyncio.run(chat_ids(body, info, offload))
    assert offload.sizes[-1] > OFFLOAD_CHARS
    small = ChatBody(model="tiny", messages=[{"role": "user", "content": "hi"}] * 4)
    asyncio.run(chat_ids(small, info, offload))
    assert offload.sizes[-1] <= OFFLOAD_CHARS, "a short chat stays inline"


@pytest.mark.parametrize("field", ["name", "tool_call_id"])
def test_a_long_string_in_any_field_of_a_message_is_templated_off_the_event_loop(info, field):
    """Every string a message carries counts toward its templating cost, not only its content."""
    offload = _RecordingOffload()
    body = ChatBody(model="tiny", messages=[{"role": "user", "content": "hi", field: "x" * (2 * OFFLOAD_CHARS)}])
    asyncio.run(chat_ids(body, info, offload))
    assert offload.sizes[-1] > 2 * OFFLOAD_CHARS
