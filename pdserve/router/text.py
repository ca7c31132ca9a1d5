"""Tokenizer-side helpers of the router: model facts it validates against, and incremental text."""

from __future__ import annotations

import json
import random
from codecs import utf_8_decode
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from pdserve.checkpoint import resolve_model
from pdserve.router.limits import max_prompt_chars, max_token_chars


@dataclass(frozen=True)
class ModelInfo:
    tokenizer: object
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    max_prompt_chars: int  # longer prompts cannot fit the context, whatever they say
    byte_table: ByteTable | None = None  # a byte-level tokenizer's fast detokenizing (Detokenizer)


class NoTokenizer:
    """The tokenizer of a router started with --skip-tokenizer: prompts come as token ids, and answers go out as
    token ids (`return_token_ids`); text prompts and chat are refused, and every text field is empty."""

    WHY = "this server has no tokenizer (--skip-tokenizer): send the prompt as token ids"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise NoTokenizerError(self.WHY)

    def apply_chat_template(self, *_, **__) -> list[int]:
        raise ValueError(
            "this server has no tokenizer (--skip-tokenizer), hence no chat template: use "
            "/v1/completions with token ids"
        )

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
    return ModelInfo(tokenizer, config.vocab_size, context, eos_ids, limit, ByteTable.of(tokenizer))


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

    Incremental, O(n) over an answer: with a byte-level tokenizer's `ByteTable`, each token's bytes are looked up
    and decoded as UTF-8 incrementally (ByteText); otherwise each new token decodes only a short window of ids
    (WindowText). Text that ends in an incomplete UTF-8 sequence, or that could be the start of a stop string, is
    held back until the next tokens settle it.
    """

    def __init__(
        self,
        tokenizer,
        stops: list[str],
        include_stop: bool = False,
        skip_special: bool = True,
        table: ByteTable | None = None,
    ) -> None:
        self.source = ByteText(table, skip_special) if table is not None else WindowText(tokenizer, skip_special)
        self.stops = stops
        self.include_stop = include_stop  # the text ends with the stop string rather than before it
        self.held = ""  # settled text not yet returned: it may be the start of a stop string
        self.matched: str | None = None  # the stop string that ended the text

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Return (new text, stopped). After a stop the text ends before the stop string (after it, with
        include_stop). Only the text held back is kept, so a token costs the same late in a long answer as early."""
        new = self.source.add(token_ids)
        if not self.stops:
            return new, False
        text = self.held + new  # no stop string can begin in text already returned: its start would have been held
        for stop in self.stops:
            at = text.find(stop)
            if at != -1:
                self.held, self.matched = "", stop
                return text[: at + (len(stop) if self.include_stop else 0)], True
        hold = len(text)
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = min(hold, len(text) - k)
                    break
        self.held = text[hold:]
        return text[:hold], False

    def flush(self) -> str:
        """Everything not yet returned, unsettled bytes included (the answer is over)."""
        out, self.held = self.held + self.source.flush(), ""
        return out


class WindowText:
    """The settled text of a growing list of ids, for any tokenizer: each new token decodes a short window (the
    tokens since the last settled point, plus those before it for context); text ending in U+FFFD (an incomplete
    UTF-8 sequence) waits for the next tokens."""

    def __init__(self, tokenizer, skip_special: bool) -> None:
        self.tokenizer = tokenizer
        self._backend = backend_decoder(tokenizer)
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] give the context of the next decode
        self.read_offset = 0

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        settled = self._decode(self.ids[self.prefix_offset : self.read_offset])
        tail = self._decode(self.ids[self.prefix_offset :])[len(settled) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        return tail

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)


class ByteText:
    """The settled text of a growing list of ids, for a byte-level tokenizer: each token's bytes from its table,
    through an incremental UTF-8 decoder (which holds an incomplete sequence back, as decoding all the ids at once
    would replace it only at the end)."""

    __slots__ = ("table", "skip_special", "known", "pending")

    def __init__(self, table: ByteTable, skip_special: bool) -> None:
        self.table, self.skip_special = table, skip_special
        self.known = table.skipping if skip_special else table.plain
        self.pending = b""  # the start of a UTF-8 sequence that the next token's bytes may complete

    def add(self, token_ids: list[int]) -> str:
        """What codecs' incremental UTF-8 decoder does (its buffer, then `utf_8_decode`), one Python call the less."""
        known = self.known
        if len(token_ids) == 1:  # a decode step's one token: no list to build and join
            t = token_ids[0]
            data = self.pending + (known[t] if t in known else self.table.learn(t, self.skip_special))
        else:
            data = self.pending + b"".join(
                [known[t] if t in known else self.table.learn(t, self.skip_special) for t in token_ids]
            )
        text, used = utf_8_decode(data, "replace", False)
        self.pending = data[used:]
        return text

    def flush(self) -> str:
        data, self.pending = self.pending, b""
        return utf_8_decode(data, "replace", True)[0]


class ByteTable:
    """Each token's bytes, for a tokenizer whose decoder is byte-level BPE's (GPT-2's, Qwen's): decoding ids is then
    joining their bytes and reading them as UTF-8 (invalid bytes replaced), which a table and Python's UTF-8 decoder
    do in a fraction of the time a call to the tokenizer takes. Filled as tokens first appear (a large vocabulary
    costs nothing at start-up); `of` checks it against the tokenizer."""

    def __init__(self, backend, special: set[int]) -> None:
        self.backend, self.special = backend, special
        self.alphabet = _ByteAlphabet()
        self.plain: dict[int, bytes] = {}  # special tokens as their text
        self.skipping: dict[int, bytes] = {}  # special tokens skipped

    @classmethod
    def of(cls, tokenizer) -> ByteTable | None:
        """The table of `tokenizer`, or None where its decoder is not byte-level or the table decodes otherwise."""
        backend = backend_decoder(tokenizer)
        if backend is None or type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
            return None
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        table = cls(backend, special)
        return table if table.decodes_as_backend() else None

    def learn(self, token_id: int, skip_special: bool) -> bytes:
        """A token's bytes (none for an id without a token), remembered."""
        token = self.backend.id_to_token(token_id) if token_id >= 0 else None
        skipped = token is None or (skip_special and token_id in self.special)
        data = b"" if skipped else self.alphabet.bytes_of(token)
        (self.skipping if skip_special else self.plain)[token_id] = data
        return data

    def decodes_as_backend(self) -> bool:
        """Whether the table decodes a random sample of ids (every special token among them) as the tokenizer does."""
        rng = random.Random(0)
        size = self.backend.get_vocab_size(True)
        ids = [rng.randrange(size) for _ in range(4000)] + sorted(self.special)
        rng.shuffle(ids)
        for skip in (True, False):
            text = ByteText(self, skip)
            mine = "".join(text.add(ids[k : k + 3]) for k in range(0, len(ids), 3)) + text.flush()
            if mine != self.backend.decode(ids, skip_special_tokens=skip):
                return False
        return True


class _ByteAlphabet:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for the characters from U+0100
    on, in order. A token's bytes are its characters read back through it; a token with a character outside it (an
    added token's) is its characters' own UTF-8, as in the tokenizers library."""

    def __init__(self) -> None:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        others = [b for b in range(256) if b not in printable]
        self.to_byte = {**{b: b for b in printable}, **{256 + k: b for k, b in enumerate(others)}}  # code point -> byte
        self.chars = frozenset(map(chr, self.to_byte))

    def bytes_of(self, token: str) -> bytes:
        if self.chars.issuperset(token):
            return token.translate(self.to_byte).encode("latin-1")
        return token.encode()


def backend_decoder(tokenizer) -> object | None:
    """The `tokenizers.Tokenizer` under a fast tokenizer, when its decode gives what the tokenizer's own does (no
    clean-up of spaces afterwards): called directly, it skips transformers' argument conversions, most of the cost
    of decoding a token or two. None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend
