"""A streamed chunk built from its choice's template is the JSON of the chunk's dict, key for key and in order; a chat
choice names its role in its first delta only, on either path."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pdserve.router.sse import ChunkFormat
from pdserve.router.stream import Delta, chunk, envelope
from pdserve.wire.params import FinishReason

TEXTS = ["", "plain", 'quo"te \\ back', "tab\tnew\nline", "héllo ✓ 😀", "\x00\x1f"]


def _reference(
    envelope: dict, index: int, chat: bool, text: str, ids: list[int], reason, stop, with_ids: bool, first: bool
) -> dict:
    if chat:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": text} if first else {"content": text},
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": stop,
        }
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": stop}
    if with_ids:
        choice["token_ids"] = ids
    return {**envelope, "choices": [choice]}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("with_ids", [False, True])
def test_template_chunks_are_the_dicts_json(chat: bool, with_ids: bool):
    envelope = {
        "id": 'cmpl-ab\\"c',
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1700000000,
        "model": "tiny ✓",
    }
    fmt = ChunkFormat(envelope, 3, chat, with_ids)
    first = True
    for text in TEXTS:
        for ids, reason, stop in (
            ([], None, None),
            ([7], None, None),
            ([1, 22, 333], FinishReason.LENGTH, None),
            ([5], FinishReason.STOP, None),
            ([5], FinishReason.STOP, 5),
            ([5], FinishReason.STOP, 'a "stop" ✓'),
        ):
            out = fmt.event(text, ids, reason, stop)
            assert out.startswith("data: ") and out.endswith("\n\n")
            expected = json.dumps(_reference(envelope, 3, chat, text, ids, reason, stop, with_ids, first))
            assert out[len("data: ") : -2] == expected
            first = False


def test_a_chat_choice_names_its_role_in_its_first_delta_only_with_or_without_logprobs():
    job = SimpleNamespace(id="x", index=0, created=1, model="m", return_token_ids=False)
    for logprobs in (None, {"content": []}):
        fmt = ChunkFormat(envelope(job, True, stream=True), 0, True, False)
        deltas = [Delta("a", [1], None, logprobs), Delta("b", [2], None, logprobs), Delta("", [3], FinishReason.STOP)]
        sent = [json.loads(chunk(job, True, fmt, d)[len("data: ") :])["choices"][0]["delta"] for d in deltas]
        assert sent == [{"role": "assistant", "content": "a"}, {"content": "b"}, {"content": ""}]
    fmt = ChunkFormat(envelope(job, False, stream=True), 0, False, False)
    assert [json.loads(chunk(job, False, fmt, d)[6:])["choices"][0]["text"] for d in deltas] == ["a", "b", ""]
