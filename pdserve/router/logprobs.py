"""Log-probabilities in OpenAI's shapes, built piece by piece as a choice's tokens arrive.

Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per token; each
`top_logprobs` entry maps token text to log-probability for the most likely tokens, plus the chosen
one (as vLLM does); where ids decode to the same text the higher value is kept, and the chosen token's
text always carries its own value (the one in `token_logprobs`); `text_offset` counts characters from
the start of the choice's text (the prompt's, with echo). An echoed prompt's first token has no
log-probability: `null` in both lists.
Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
The values come from the nodes (the raw model distribution, see runner/sampling.py); `-inf` is sent
as -9999.0, since JSON has no infinity.
"""

from __future__ import annotations

from pdserve.wire.messages import Logprobs, TokenEvent

FLOOR = -9999.0

Entry = tuple[int, float | None, list[tuple[int, float]] | None]  # (token id, its log-prob, the top ones)


def _finite(x: float) -> float:
    return x if x > FLOOR else FLOOR  # -inf and NaN too


def entries(token_ids: list[int], lps: Logprobs) -> list[Entry]:
    """Tokens and their scores from the wire (one score per token)."""
    rows = zip(token_ids, lps.logprobs, lps.top_ids, lps.top_logprobs, strict=True)
    return [(t, lp, list(zip(ids, vals, strict=True))) for t, lp, ids, vals in rows]


def prompt_entries(prompt_ids: list[int], lps: Logprobs) -> list[Entry]:
    """An echoed prompt's tokens: the first has no score, the others theirs."""
    return [(prompt_ids[0], None, None), *entries(prompt_ids[1:], lps)]


class LogprobFormatter:
    """One choice's log-probabilities in the shape of its endpoint."""

    def __init__(self, tokenizer, chat: bool, top: int) -> None:
        self.tokenizer, self.chat, self.top = tokenizer, chat, top
        self.offset = 0  # text_offset of the next token (completions)

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def piece(self, items: list[Entry]) -> dict:
        return self._chat(items) if self.chat else self._completion(items)

    def _completion(self, items: list[Entry]) -> dict:
        tokens = [self.text(t) for t, _, _ in items]
        offsets = []
        for tok in tokens:
            offsets.append(self.offset)
            self.offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else _finite(lp) for _, lp, _ in items],
            "top_logprobs": [self._top_map(t, lp, top) for t, lp, top in items],
            "text_offset": offsets,
        }

    def _top_map(self, token_id: int, lp: float | None, top: list[tuple[int, float]] | None) -> dict | None:
        if lp is None or top is None:
            return None
        best: dict[str, float] = {}
        for i, v in top:  # ids whose texts collide (byte pieces as "\ufffd") share a key: the higher value stays
            text = self.text(i)
            best[text] = max(best.get(text, _finite(v)), _finite(v))
        best[self.text(token_id)] = _finite(lp)  # the chosen token's own value, as in token_logprobs
        return best

    def _chat(self, items: list[Entry]) -> dict:
        return {
            "content": [
                {**self._chat_token(t, lp), "top_logprobs": [self._chat_token(i, v) for i, v in top or ()]}
                for t, lp, top in items
            ]
        }

    def _chat_token(self, token_id: int, lp: float | None) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": _finite(lp if lp is not None else FLOOR), "bytes": list(text.encode("utf-8"))}


def merge_pieces(pieces: list[dict]) -> dict | None:
    """The pieces of one choice as one object (unstreamed answers): every list concatenated."""
    if not pieces:
        return None
    return {key: [x for p in pieces for x in p[key]] for key in pieces[0]}


class ChoiceExtras:
    """What one choice adds to its tokens: the echoed prompt in front, and log-probabilities when asked for."""

    def __init__(self, tokenizer, chat: bool, top: int | None, prompt_ids: list[int], echo: bool) -> None:
        self.fmt = LogprobFormatter(tokenizer, chat, top or 0)
        self.top, self.prompt_ids = top, prompt_ids
        self.echo_text = tokenizer.decode(prompt_ids) if echo else None
        self.started = False

    def event(self, ev: TokenEvent, shown: list[int]) -> tuple[str, dict | None]:
        """(text to put in front of this event's, its log-probabilities or None) for an event whose tokens the
        client sees are `shown` (none when max_tokens is 0)."""
        prefix, items = "", []
        if not self.started:
            self.started = True
            if self.echo_text is not None:
                prefix = self.echo_text
                if ev.prompt_logprobs is not None:
                    items = prompt_entries(self.prompt_ids, ev.prompt_logprobs)
        if shown and ev.logprobs is not None:
            items += entries(shown, ev.logprobs)
        return prefix, None if self.top is None else self.fmt.piece(items)
