"""Tokenizer-side helpers of the router: model facts it validates against, and incremental text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from pdserve.engine.checkpoint import resolve_model
from pdserve.router.limits import max_prompt_chars, max_token_chars


@dataclass(frozen=True)
class ModelInfo:
    tokenizer: object
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    max_prompt_chars: int  # longer prompts cannot fit the context, whatever they say


class NoTokenizer:
    """The tokenizer of a router started with --skip-tokenizer: prompts come as token ids, and answers go out as
    token ids (`return_token_ids`); text prompts and chat are refused, and every text field is empty."""

    WHY = "this server has no tokenizer (--skip-tokenizer): send the prompt as token ids"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise NoTokenizerError(self.WHY)

    def apply_chat_template(self, *_, **__) -> list[int]:
        raise ValueError("this server has no tokenizer (--skip-tokenizer), hence no chat template: use "
                         "/v1/completions with token ids")  # fmt: skip

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [""] * len(ids)

    def get_vocab(self) -> dict[str, int]:
        return {}


class NoTokenizerError(ValueError):
    """A text prompt sent to a router without a tokenizer."""


def load_model_info(model: str, tokenizer: bool = True) -> ModelInfo:
    """Tokenizer and config only: the router never loads weights, nor torch. The config is read as JSON
    and a checkpoint's tokenizer.json through the generic fast tokenizer (transformers' Auto classes
    import torch); a checkpoint without one falls back to AutoTokenizer. tokenizer=False: NoTokenizer."""
    from pdserve.config import eos_token_ids, max_model_len

    path = resolve_model(model)
    config = SimpleNamespace(**json.loads((path / "config.json").read_text()))
    tokenizer = _load_tokenizer(path) if tokenizer else NoTokenizer()
    eos_ids = eos_token_ids(config)
    context = max_model_len(config)
    limit = max_prompt_chars(context, max_token_chars(tokenizer))
    return ModelInfo(tokenizer, config.vocab_size, context, eos_ids, limit)


def _load_tokenizer(path: Path):
    import transformers

    if (path / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The token ids of `messages` through the tokenizer's chat template; ValueError when it cannot render them."""
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as e:  # the template raises whatever jinja raises
        raise ValueError(f"cannot apply the chat template: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


class Detokenizer:
    """Turns a growing list of token ids into text deltas, and watches for stop strings.

    Incremental: each new token decodes only a short window (the tokens since the last settled
    point, plus the few before it for context), so a long answer costs O(n), not O(n^2). Text that
    ends in an incomplete UTF-8 sequence, or that could be the start of a stop string, is held back
    until the next tokens settle it.
    """

    def __init__(self, tokenizer, stops: list[str], include_stop: bool = False, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self._backend = backend_decoder(tokenizer)
        self.stops = stops
        self.include_stop = include_stop  # the text ends with the stop string rather than before it
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.text = ""  # settled text so far
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] give the context of the next decode
        self.read_offset = 0
        self.sent = 0  # characters of self.text already returned

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Return (new text, stopped). After a stop the text ends before the stop string (after it, with
        include_stop)."""
        self.ids.extend(token_ids)
        self._settle()
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.sent - len(stop)))
            if at != -1:
                return self._take(at + (len(stop) if self.include_stop else 0)), True
        hold = len(self.text)
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    hold = min(hold, len(self.text) - k)
                    break
        return self._take(hold), False

    def flush(self) -> str:
        """Everything not yet returned, unsettled bytes included (the answer is over)."""
        tail = self._decode(self.ids[self.prefix_offset :])[len(self._decode(self._window())) :]
        self.text += tail
        self.prefix_offset = self.read_offset = len(self.ids)
        return self._take(len(self.text))

    def _settle(self) -> None:
        before = self._decode(self._window())
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _window(self) -> list[int]:
        return self.ids[self.prefix_offset : self.read_offset]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out


def backend_decoder(tokenizer) -> object | None:
    """The `tokenizers.Tokenizer` under a fast tokenizer, when its decode gives what the tokenizer's own does (no
    clean-up of spaces afterwards): called directly, it skips transformers' argument conversions, most of the cost
    of decoding a token or two. None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend
