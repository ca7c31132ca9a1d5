"""Tokenizer-side helpers of the router: model facts it validates against, and incremental text."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.checkpoint import resolve_model


@dataclass(frozen=True)
class ModelInfo:
    tokenizer: object
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]


def load_model_info(model: str) -> ModelInfo:
    """Tokenizer and config only: the router never loads weights."""
    import transformers

    from pdserve.common.model import max_model_len

    path = resolve_model(model)
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelInfo(tokenizer, config.vocab_size, max_model_len(config), eos_ids)


class Detokenizer:
    """Turns a growing list of token ids into text deltas, and watches for stop strings.

    Text that ends in an incomplete UTF-8 sequence, or that could be the start of a stop string,
    is held back until the next tokens settle it.
    """

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already returned

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Return (new text, stopped). After a stop the text ends before the stop string."""
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stops:
            at = text.find(stop, max(0, self.sent - len(stop)))
            if at != -1:
                return self._take(text, min(at, len(text)), force=True), True
        hold = len(text)
        if text.endswith("\ufffd"):
            hold = len(text.rstrip("\ufffd"))
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = min(hold, len(text) - k)
                    break
        return self._take(text, hold), False

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._take(text, len(text), force=True)

    def _take(self, text: str, upto: int, force: bool = False) -> str:
        if upto <= self.sent:
            return ""
        out = text[self.sent : upto]
        self.sent = upto
        return out
