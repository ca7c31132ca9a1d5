"""Bounds on what a client can make the router spend, checked before the work they bound.

- `RequestLimits`: an ASGI middleware; a body over the limit is answered 413 before anything parses
  it (at once from Content-Length, or as soon as a chunked body's running count passes the limit);
  headers over MAX_HEADER_BYTES in all are answered 431 (uvicorn's own bound only covers a head
  that arrives in pieces).
- `Offload`: parsing, chat templating and tokenizing of large inputs run in a small thread pool,
  so that one large request never stalls the event loop that streams everyone's tokens.
- Caps on the parts of a body that cost per-token work later (stop strings, stop token ids).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pdserve.router.errors import logged_error

MAX_STOPS = 16  # stop strings a request may give (OpenAI allows 4)
MAX_STOP_CHARS = 128  # characters of one stop string: each is matched against every new token's text
MAX_STOP_TOKEN_IDS = 256
OFFLOAD_CHARS = 16 * 1024  # inputs above this size are parsed / tokenized off the event loop
MESSAGE_CHARS = 32  # a chat message's cost to the template, in characters' worth (tiny: 10 us, 0.4 us a char)
MAX_HEADER_BYTES = 16 * 1024  # all header names and values of a request together

T = TypeVar("T")


def _send_json(status: int, body: dict) -> Callable:
    data = json.dumps(body).encode()

    async def reply(send) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return reply


def too_large_body(where: str, limit: int) -> dict:
    return logged_error(where, 413, f"the request body exceeds {limit} bytes (--max-request-bytes)")


class RequestLimits:
    """Answer 413 for a body over `limit` bytes without buffering or parsing it; pass smaller ones on, whole.

    The rest of a refused body is read and dropped by the server (uvicorn discards a body whose
    response is complete), so the client gets its 413 instead of a reset connection.
    """

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        where = f"{scope['method']} {scope['path']}"
        if sum(len(k) + len(v) for k, v in scope.get("headers", ())) > MAX_HEADER_BYTES:
            body = logged_error(where, 431, f"the request headers exceed {MAX_HEADER_BYTES} bytes")
            return await _send_json(431, body)(send)
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            return await _send_json(413, too_large_body(where, self.limit))(send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _send_json(413, too_large_body(where, self.limit))(send)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses a malformed length before we see it
    return None


def _replay(body: bytes, receive) -> Callable:
    """A `receive` that hands the app the whole body once, then the real one (for disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class Offload:
    """Runs CPU-heavy input handling in a small thread pool when the input is large, inline when small."""

    def __init__(self, workers: int = 2) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pdserve-input")

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size <= OFFLOAD_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def max_token_chars(tokenizer) -> int:
    """The longest token's text: a prompt of n characters needs at least n / this many tokens.

    Vocabulary strings are byte-level (one character a byte) or SentencePiece pieces, so a
    token's string is never shorter than the text it stands for.
    """
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def max_prompt_chars(max_model_len: int, token_chars: int) -> int:
    """Characters beyond which a prompt cannot fit the context, whatever it says (2x for normalizers)."""
    return 2 * max_model_len * token_chars


def stop_problem(stops: list[str], stop_token_ids: list[int] | None) -> tuple[str, str] | None:
    """(message, param) when the stop conditions exceed their caps."""
    if len(stops) > MAX_STOPS:
        return f"at most {MAX_STOPS} stop strings are allowed, got {len(stops)}", "stop"
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        return f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop"
    if stop_token_ids and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed", "stop_token_ids"
    return None


def content_texts(content: Any) -> list[str]:
    """A chat message's texts: its content if a string, else the text of each of its parts."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def message_strings(message: Any) -> list[tuple[str, str]]:
    """(where, text) for every string a chat message (a dict) gives the template: its role, its content or the text
    of each of its parts, its name and any other field (a tool call's arguments), `where` as "content[0].text"."""
    out, todo = [], [("", message)]
    while todo:  # no recursion: a body may nest as deep as the JSON parser allows
        where, value = todo.pop()
        if isinstance(value, str):
            out.append((where, value))
        elif isinstance(value, dict):
            todo += [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            todo += [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    return out


def messages_size(messages: list[Any]) -> int:
    """What templating chat messages (dicts) costs, in characters: every string they carry, and a fixed cost a
    message."""
    return sum(len(text) for m in messages for _, text in message_strings(m)) + MESSAGE_CHARS * len(messages)


def content_chars(content: Any) -> int:
    """Characters of a chat message's text (a string, or the text of a list of parts): a lower bound of its prompt."""
    return sum(len(text) for text in content_texts(content))
