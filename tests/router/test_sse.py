"""A streamed chunk built from its choice's template is the JSON of the chunk's dict, key for key and in order."""

from __future__ import annotations

import json

import pytest

from pdserve.router.sse import ChunkFormat
from pdserve.wire.params import FinishReason

TEXTS = ["", "plain", 'quo"te \\ back', "tab\tnew\nline", "héllo ✓ 😀", "\x00\x1f"]


def _reference(envelope: dict, index: int, chat: bool, text: str, ids: list[int], reason, stop, with_ids: bool) -> dict:
    if chat:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": text},
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
            expected = json.dumps(_reference(envelope, 3, chat, text, ids, reason, stop, with_ids))
            assert out[len("data: ") : -2] == expected
