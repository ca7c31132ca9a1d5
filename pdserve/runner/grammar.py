"""Guided decoding: a request with a grammar (`SamplingParams.grammar`, llguidance's JSON form, built by the
router from `response_format`) only draws tokens its grammar allows.

1. The engine builds the request's matcher when the request joins it (`Guides.attach`), from the
   tokenizer files of the checkpoint it loaded, and replays the tokens the request already has: the first
   token a prefill node drew (disaggregated), or the prompt's tail a router re-dispatched (`grammar_prefix`).
2. Before each draw, the rows of guided requests get every token the grammar forbids set to -inf
   (`mask_rows`): one bitmask per row, filled by llguidance, expanded on the logits' device.
   EOS is allowed only where the grammar is complete.
3. Each drawn token advances the matcher (`advance`). A preempted request keeps its matcher: its tokens
   are recomputed, not drawn again.

Requests without a grammar cost one attribute test per row per step. llguidance is imported on the first
guided request (a dependency of pdserve), or when a node starts: it builds the tokenizer before it reports
ready (`Guides.prepare`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from pdserve.engine.request import Request
from pdserve.kv.block_allocator import cdiv
from pdserve.runner.copies import to_device

log = logging.getLogger("pdserve.engine")


class GrammarError(ValueError):
    """A request's grammar cannot be used here (no llguidance, or a grammar it refuses)."""


class Guides:
    """The llguidance tokenizer of one engine (built by `prepare`, else on first use) and the matchers of its
    requests."""

    def __init__(self, checkpoint: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.checkpoint, self.vocab_size, self.eos_token_ids = checkpoint, vocab_size, eos_token_ids
        self._tokenizer = None

    def prepare(self) -> None:
        """Build the tokenizer now if llguidance is installed: a node does so before it reports ready, so that its
        first guided request does not stall its loop for it (about a second for a large vocabulary). A failure
        is left for the first guided request to raise."""
        try:
            self.tokenizer()
        except GrammarError as e:
            log.debug("%s", e)

    def attach(self, req: Request) -> None:
        """Give a guided request its matcher, advanced over the tokens it already has (GrammarError if it can't)."""
        if not req.params.grammar:
            return
        prompt, prefix = req.prompt_token_ids, req.params.grammar_prefix
        if prefix > len(prompt):
            raise GrammarError(f"guided decoding: grammar_prefix {prefix} is longer than the prompt")
        tokenizer = self.tokenizer()
        matcher = _llguidance().LLMatcher(tokenizer, req.params.grammar, log_level=0)
        replay = prompt[len(prompt) - prefix :] + req.output_token_ids
        if matcher.is_error() or (replay and not matcher.consume_tokens(replay)):
            raise GrammarError(f"guided decoding: {matcher.get_error().splitlines()[0]}")
        req.guide = Guide(req.request_id, matcher, tokenizer.vocab_size)

    def tokenizer(self):
        """llguidance's view of the checkpoint's (fast) tokenizer, built once: about a second for 150k ids."""
        if self._tokenizer is None:
            self._tokenizer = self._build()
        return self._tokenizer

    def _build(self):
        ll = _llguidance()
        try:
            plain = plain_tokenizer(self.checkpoint) if self.eos_token_ids else None
            if plain is not None:
                n_vocab = max(self.vocab_size, plain.get_vocab_size(with_added_tokens=True))
                return ll.LLTokenizer(plain.to_str(), n_vocab=n_vocab, eos_token=list(self.eos_token_ids))
            import llguidance.hf

            hf = _hf_tokenizer(self.checkpoint)
            eos = list(self.eos_token_ids) or hf.eos_token_id
            return llguidance.hf.from_tokenizer(hf, n_vocab=max(self.vocab_size, len(hf)), eos_token=eos)
        except Exception as e:  # noqa: BLE001 - whatever the tokenizer files raise, the request gets it
            raise GrammarError(f"guided decoding: cannot load this model's tokenizer: {e}") from None


GENERIC_TOKENIZERS = (None, "PreTrainedTokenizerFast", "TokenizersBackend")  # transformers' own fast tokenizer
RESHAPING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space")  # settings a tokenizer class applies on load


def plain_tokenizer(checkpoint: Path):
    """The checkpoint's tokenizer.json as a `tokenizers` tokenizer (no padding, no truncation), where transformers'
    generic fast tokenizer would load that file as it is: no tokenizer class of its own, no setting that reshapes
    it, every added token of tokenizer_config.json already in it. The same JSON llguidance gets from transformers,
    without importing transformers (about 0.7 s of a node's start). None: ask transformers."""
    file, config_file = checkpoint / "tokenizer.json", checkpoint / "tokenizer_config.json"
    if not file.is_file():
        return None
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("tokenizer_class") not in GENERIC_TOKENIZERS or any(config.get(k) for k in RESHAPING_KEYS):
        return None
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(file))
    have = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
    if any(have.get(t.get("content")) != int(i) for i, t in config.get("added_tokens_decoder", {}).items()):
        return None
    tok.no_padding()
    tok.no_truncation()
    return tok


def _hf_tokenizer(checkpoint: Path):
    """The checkpoint's fast tokenizer, as the router loads it."""
    import transformers

    if (checkpoint / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(checkpoint, local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)


class Guide:
    """One request's grammar state: an llguidance matcher, over a tokenizer of `n_vocab` ids."""

    def __init__(self, request_id: str, matcher, n_vocab: int) -> None:
        self.request_id, self.matcher, self.n_vocab = request_id, matcher, n_vocab

    def advance(self, token: int) -> None:
        """The request drew `token`: the matcher takes it (a refusal leaves it where only EOS is allowed)."""
        if not self.matcher.is_error() and not self.matcher.consume_token(token):
            why = self.matcher.get_error().splitlines()[0]
            log.warning("request %s: the grammar refused token %d: %s", self.request_id, token, why)

    def allowed(self, V: int) -> torch.Tensor:
        """The tokens the grammar allows next: [V] bool (ids beyond the tokenizer's vocabulary never)."""
        words = torch.zeros(cdiv(self.n_vocab, 32), dtype=torch.int32)  # [W]: bit b of word w is token 32w + b
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
        allowed = torch.zeros(V, dtype=torch.bool)
        n = min(V, self.n_vocab)
        allowed[:n] = bits.flatten()[:n].bool()
        return allowed


def mask_rows(logits: torch.Tensor, requests: list[Request], rows: list[int] | None = None) -> torch.Tensor:
    """logits [S, V] with the tokens each guided row's grammar (rows `rows`, if known) forbids set to -inf (a copy;
    the input is kept)."""
    if rows is None:
        rows = [i for i, req in enumerate(requests) if req.guide is not None]
    if not rows:
        return logits
    S, V = logits.shape
    forbid = torch.zeros(S, V, dtype=torch.bool)  # [S, V]; unguided rows stay all False
    for i in rows:
        forbid[i] = ~requests[i].guide.allowed(V)
    return logits.masked_fill(to_device(forbid, logits.device), float("-inf"))  # pinned: no wait for the stream


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("guided decoding needs llguidance, a pdserve dependency: pip install llguidance") from None
    return llguidance
