"""What a client sees of its choices' events: text deltas, and for a streamed answer, events pushed as they come.

A streamed response attaches itself to its requests' inboxes (`flight.Inbox.attach`), so the node reader that
delivers an event calls it: it detokenizes, builds the choice's chunk and writes it to the connection
(`http.RawChunks`) in that same call, with no task, queue or ASGI send per token. Each token event is one SSE event
(a node sends one per request per step), then the usage chunk when asked for, then `data: [DONE]`.

A streamed response's life:
1. the handler dispatches every choice (a refusal is still an HTTP error, not a 200 stream) and returns an
   SseResponse;
2. the response sends its status and headers through ASGI and attaches: events that came meanwhile are replayed,
   the others pushed as they come;
3. a choice ends with its last event, or with a stop string in its text (its request is then aborted on the nodes);
   once every choice has ended: the usage chunk, [DONE], and the body's end (through ASGI);
4. an error event ends the stream at once with an error event (no [DONE]), the other choices aborted; a client that
   leaves ends it too, every choice aborted; either way the usage goes to the request's state (the access log).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from starlette.responses import Response

from pdserve.router import sse
from pdserve.router.core import RouterCore
from pdserve.router.errors import HTTP_STATUS, ApiError, api_error_body
from pdserve.router.flight import Flight
from pdserve.router.http import RAW_CHUNKS
from pdserve.router.sse import ChunkFormat
from pdserve.router.text import Detokenizer, ModelInfo
from pdserve.wire.messages import TokenEvent
from pdserve.wire.params import FinishReason

if TYPE_CHECKING:
    from pdserve.router.jobs import Job

log = logging.getLogger("pdserve.router")
ERROR, STOP = FinishReason.ERROR, FinishReason.STOP  # looked up once: they are used once a token


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: dict | None = None
    stop_reason: str | int | None = None  # the stop string, or stop token id, that ended the choice


class ChoiceView:
    """What the client sees of one choice's events: text (stop strings cut), shown tokens, log-probabilities."""

    def __init__(self, info: ModelInfo, job: Job) -> None:
        self.job = job
        self.detok = Detokenizer(info.tokenizer, job.stops, job.include_stop, job.skip_special, info.byte_table)
        self.extras = job.extras(info.tokenizer)
        self.reason: FinishReason | None = None  # set by the last event the client sees
        self.stop_reason: str | int | None = None  # with it: the stop string or stop token id that ended the choice
        # a plain choice (its tokens shown, no stop strings, no log-probabilities or echo): an event before its end is
        # only its tokens' text, which SseStream takes straight from here
        plain = job.show_tokens and not job.stops and self.extras is None
        self.plain_text: Callable[[list[int]], str] | None = self.detok.source.add if plain else None

    def deltas(self, events: list[TokenEvent]) -> tuple[list[Delta], ApiError | None]:
        """The deltas of `events` up to the choice's end, and the error that ended it, if one did."""
        out = []
        for ev in events:
            delta = self.delta(ev)
            if isinstance(delta, ApiError):
                return out, delta
            out.append(delta)
            if self.reason is not None:
                break
        return out, None

    def delta(self, ev: TokenEvent) -> Delta | ApiError:
        """What the client sees of one event: its delta, or the error that ends the choice."""
        if ev.finish_reason is ERROR:
            self.reason = ev.finish_reason
            status, code = HTTP_STATUS[ev.error_code], ev.error_code.value
            return ApiError(status, f"request failed: {ev.error}", code=code)
        return self._delta(ev)

    def _delta(self, ev: TokenEvent) -> Delta:
        shown = ev.token_ids if self.job.show_tokens else []
        text, stopped = self.detok.add(shown)
        reason = STOP if stopped else ev.finish_reason
        if reason is not None:
            text += "" if stopped else self.detok.flush()
            self.reason, self.stop_reason = reason, self.detok.matched or self._stop_token(ev, reason)
        prefix, logprobs = self.extras.event(ev, shown) if self.extras else ("", None)
        return Delta(prefix + text, shown, reason, logprobs, self.stop_reason)

    def _stop_token(self, ev: TokenEvent, reason: FinishReason | None) -> int | None:
        """The stop token id (of the request's `stop_token_ids`) that ended it; None for an end-of-sequence token,
        which ends a request before its stop token ids are looked at unless `ignore_eos` (as vLLM reports it)."""
        p = self.job.params
        last = ev.token_ids[-1] if reason is STOP and ev.token_ids else None  # no id: not in stop_token_ids
        if last not in p.stop_token_ids or (not p.ignore_eos and last in p.eos_token_ids):
            return None
        return last


# ---- response shapes -----------------------------------------------------------------------------


def usage(jobs: list[Job], completion_tokens: int) -> dict:
    prompt_tokens = sum(len(j.prompt_ids) for j in jobs if j.sample == 0)  # a prompt counts once, whatever n
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def choice(
    job: Job,
    chat: bool,
    text: str,
    token_ids: list[int] | None,
    reason,
    stream: bool,
    logprobs: dict | None = None,
    stop_reason: str | int | None = None,
    role: bool = True,
) -> dict:
    """A choice as OpenAI shapes it, with vLLM's `stop_reason` (the stop string or stop token id that ended it).
    `role`: whether a chat choice names its role (a message does; of a stream's deltas, only the first)."""
    if chat:
        key = "delta" if stream else "message"
        value = {"role": "assistant", "content": text} if role else {"content": text}
    else:
        key, value = "text", text
    out = {"index": job.index, key: value, "logprobs": logprobs, "finish_reason": reason, "stop_reason": stop_reason}
    if job.return_token_ids and token_ids is not None:
        out["token_ids"] = token_ids
    return out


def envelope(job: Job, chat: bool, stream: bool) -> dict:
    obj = ("chat.completion" if chat else "text_completion") + (".chunk" if stream and chat else "")
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + job.id,
        "object": obj,
        "created": job.created,
        "model": job.model,
    }


def chunk(job: Job, chat: bool, fmt: ChunkFormat, d: Delta) -> str:
    """One delta's SSE event: from the choice's template, or (with log-probabilities) a dict serialized whole."""
    if d.logprobs is None:
        return fmt.event(d.text, d.token_ids, d.finish_reason, d.stop_reason)
    out = envelope(job, chat, stream=True)
    out["choices"] = [
        choice(
            job,
            chat,
            d.text,
            d.token_ids,
            d.finish_reason,
            stream=True,
            logprobs=d.logprobs,
            stop_reason=d.stop_reason,
            role=fmt.take_role(),
        )
    ]
    return sse.event(out)


# ---- a streamed answer ---------------------------------------------------------------------------


class Outbox:
    """The writes of every stream, held until the event loop's next pass and then sent one per stream: the node
    messages that came together (one per node and step, each with a token for many streams) cost each stream one
    write, not one a message."""

    def __init__(self) -> None:
        self.held: list[SseStream] = []

    def hold(self, stream: SseStream) -> None:
        if not self.held:
            asyncio.get_running_loop().call_soon(self._flush)
        self.held.append(stream)

    def _flush(self) -> None:
        held, self.held = self.held, []
        for stream in held:
            stream.flush()


class SseStream:
    """The choices of one streamed response, written as SSE events as their events come (the module's doc)."""

    def __init__(
        self,
        core: RouterCore,
        info: ModelInfo,
        jobs: list[Job],
        chat: bool,
        flights: list[Flight],
        state,
        where: str,
        outbox: Outbox,
    ) -> None:
        self.core, self.jobs, self.chat, self.flights, self.outbox = core, jobs, chat, flights, outbox
        self.parts: list[bytes] = []  # written, held in the outbox
        self.state, self.where = state, where  # the request's state (its usage goes there); "stream of POST ..."
        self.views = [ChoiceView(info, j) for j in jobs]
        self.formats = [ChunkFormat(envelope(j, chat, stream=True), j.index, chat, j.return_token_ids) for j in jobs]
        self.open = len(jobs)  # choices not ended yet
        self.tokens = 0  # completion tokens streamed
        self.done = asyncio.get_running_loop().create_future()
        self.write: Callable[[bytes], object] = _nowhere
        self.last: Callable[[bytes], object] = _nowhere  # the stream's last write

    def attach(self, write: Callable[[bytes], object], last: Callable[[bytes], object] | None = None) -> None:
        """Write every event from now on (those that came already first) with `write`; the stream's last bytes with
        `last`, where given (it ends the body in the same write)."""
        self.write, self.last = write, last or write
        for i, flight in enumerate(self.flights):
            plain = self.views[i].plain_text is not None
            flight.inbox.attach(partial(self._on_event, i), partial(self._on_tokens, i) if plain else None)

    def flush(self, write: Callable[[bytes], object] | None = None) -> None:
        """Send what is held (with `write`, where given)."""
        if self.parts:
            data, self.parts = b"".join(self.parts), []
            (write or self.write)(data)

    def close(self) -> None:
        """End the stream where it stands (an error, or the client left): every choice still running is aborted."""
        self.flush()
        if self.done.done():
            return
        for flight in self.flights:
            self.core.abort(flight.request_id)  # nothing for those that ended
        self.state.usage = usage(self.jobs, self.tokens)
        self.done.set_result(None)

    def _on_event(self, i: int, ev: TokenEvent) -> None:
        if ev.finish_reason is None and self.views[i].plain_text is not None:
            self._on_tokens(i, ev.token_ids)
            return
        if self.done.done():
            return
        try:
            self._show(i, ev)
        except Exception:  # a fault of this stream must not stop the node reader that called it
            self._fault(i)

    def _on_tokens(self, i: int, token_ids: list[int]) -> None:
        """A plain choice's event before its end (the commonest by far): its tokens' text, its chunk; no Delta."""
        if self.done.done():
            return
        try:
            self.tokens += len(token_ids)
            self._hold(self.formats[i].event(self.views[i].plain_text(token_ids), token_ids, None).encode())
        except Exception:
            self._fault(i)

    def _fault(self, i: int, error: BaseException | None = None) -> None:
        """End the stream on a fault of its own (`error`: the exception; None: the one being handled)."""
        log.error("streaming request %s failed", self.flights[i].request_id, exc_info=error or True)
        self._end_with(ApiError(500, "internal error while streaming the answer"))

    def _show(self, i: int, ev: TokenEvent) -> None:
        view = self.views[i]
        delta = view.delta(ev)
        if isinstance(delta, ApiError):
            self._end_with(delta)
            return
        self.tokens += len(delta.token_ids)
        self._hold(chunk(self.jobs[i], self.chat, self.formats[i], delta).encode())
        if view.reason is not None:
            self.core.abort(self.flights[i].request_id, view.reason)  # a stop string: the nodes still run it
            self.open -= 1
            if not self.open:
                self._finish()

    def _finish(self) -> None:
        self.state.usage = usage(self.jobs, self.tokens)
        tail = "data: [DONE]\n\n"
        if self.jobs[0].include_usage:
            last = envelope(self.jobs[0], self.chat, stream=True)
            last["choices"], last["usage"] = [], self.state.usage
            tail = sse.event(last) + tail
        self._hold(tail.encode())
        self.flush(self.last)
        self.done.set_result(None)

    def _end_with(self, error: ApiError) -> None:
        self._hold(sse.event(api_error_body(self.where, error)).encode())
        self.close()

    def _hold(self, data: bytes) -> None:
        if not self.parts:
            self.outbox.hold(self)
        self.parts.append(data)


def _nowhere(data: bytes) -> bool:
    return False


SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"),)  # a streamed answer's, either path


class SseResponse(Response):
    """Streams an SseStream: status, headers and the body's end through ASGI; the body on RawChunks where the server
    offers them, else through ASGI too (one send per batch of writes)."""

    def __init__(self, stream: SseStream) -> None:
        self.stream, self.status_code, self.background = stream, 200, None
        self.raw_headers = list(SSE_HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        left = asyncio.ensure_future(_disconnect(receive))
        body = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            raw = scope.get("extensions", {}).get(RAW_CHUNKS)
            body = None if raw is not None else _AsgiBody(send, self.stream.done)
            self.stream.attach(raw.write if body is None else body.write)
            ends = self.stream.done if body is None else body.task
            await asyncio.wait({ends, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if body is not None:
                body.task.cancel()
            self.stream.close()  # aborts whatever still runs: the client left, or the server stops
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _AsgiBody:
    """A streamed body sent through ASGI (a server without RawChunks): writes gather here, one task sends them."""

    def __init__(self, send, done: asyncio.Future) -> None:
        self.parts: list[bytes] = []
        self.ready = asyncio.Event()
        self.task = asyncio.ensure_future(self._pump(send, done))

    def write(self, data: bytes) -> bool:
        self.parts.append(data)
        self.ready.set()
        return True

    async def _pump(self, send, done: asyncio.Future) -> None:
        while not (done.done() and not self.parts):
            await self.ready.wait()
            self.ready.clear()
            parts, self.parts = self.parts, []
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
