"""A streamed choice's server-sent events, the JSON around its changing parts built once per choice.

A chunk whose choice carries log-probabilities is built as a dict and serialized whole; every other chunk
is the choice's fixed head (envelope, choice index, the text's key), the text as a JSON string, its finish
reason, and its token ids when asked for: the same JSON as serializing the dict, in the same key order.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii

from pdserve.wire.params import FinishReason

_REASONS = {None: "null", **{r: json.dumps(r.value) for r in FinishReason}}
_NO_STOP = ', "stop_reason": null'


def event(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


class ChunkFormat:
    """The events of one streamed choice (`envelope`: the chunk's id, object, created and model). A chat choice's
    first delta carries its role, the later ones its content only, as OpenAI and vLLM stream them."""

    def __init__(self, envelope: dict, index: int, chat: bool, with_token_ids: bool) -> None:
        start = f'data: {json.dumps(envelope)[:-1]}, "choices": [{{"index": {index}, '
        self.head = start + ('"delta": {"content": ' if chat else '"text": ')
        self.first_head = start + '"delta": {"role": "assistant", "content": ' if chat else self.head
        self.role_pending = chat  # the next delta is the choice's first, which names the role
        self.after_text = '}, "logprobs": null, "finish_reason": ' if chat else ', "logprobs": null, "finish_reason": '
        self.with_token_ids = with_token_ids

    def take_role(self) -> bool:
        """Whether this delta, the choice's first, carries the role (a chat choice's first only)."""
        pending, self.role_pending = self.role_pending, False
        return pending

    def event(self, text: str, token_ids: list[int], reason: FinishReason | None, stop_reason=None) -> str:
        """`stop_reason`: the stop string or stop token id that ended the choice (vLLM's field), else None."""
        ids = f', "token_ids": [{", ".join(map(str, token_ids))}]' if self.with_token_ids else ""
        stop = _NO_STOP if stop_reason is None else f', "stop_reason": {json.dumps(stop_reason)}'
        head = self.first_head if self.take_role() else self.head
        return f"{head}{encode_basestring_ascii(text)}{self.after_text}{_REASONS[reason]}{stop}{ids}}}]}}\n\n"
