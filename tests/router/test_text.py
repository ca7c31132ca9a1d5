"""Incremental detokenizing and stop strings, against decoding the whole answer at once."""

from __future__ import annotations

import codecs
import random

import pytest
import transformers

from pdserve.checkpoint import resolve_model
from pdserve.router.text import ByteTable, ByteText, Detokenizer, backend_decoder


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(resolve_model("tiny"))


@pytest.mark.parametrize("byte_level", [False, True], ids=["window", "byte-table"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_deltas_add_up_to_the_whole_text(tokenizer, byte_level, skip_special):
    assert backend_decoder(tokenizer) is not None, "the built-in models' tokenizers decode through the fast path"
    table = ByteTable.of(tokenizer) if byte_level else None
    assert table is not None or not byte_level, "the built-in models' tokenizers are byte-level"
    ids = tokenizer.encode("héllo wörld — ünïcode ✓ ok", add_special_tokens=False)
    ids += [random.Random(0).randrange(512) for _ in range(200)]  # bytes that are no UTF-8, and special tokens
    for step in (1, 3):
        d = Detokenizer(tokenizer, [], skip_special=skip_special, table=table)
        text = "".join(d.add(ids[i : i + step])[0] for i in range(0, len(ids), step)) + d.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=skip_special)
    if byte_level:
        assert len(table.skipping if skip_special else table.plain) > 100, "the table was used"


def test_byte_text_holds_back_what_codecs_incremental_decoder_holds_back(tokenizer):
    """Delta by delta, not only the whole: a stream's chunks carry what each step settled."""
    table, rng = ByteTable.of(tokenizer), random.Random(1)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(3000)]
    text, utf8 = ByteText(table, True), codecs.getincrementaldecoder("utf-8")("replace")
    k = 0
    while k < len(ids):
        step = rng.choice((1, 1, 1, 2, 5))
        ours = text.add(ids[k : k + step])
        assert ours == utf8.decode(b"".join(table.skipping[t] for t in ids[k : k + step])), k
        k += step
    assert text.flush() == utf8.decode(b"", final=True)
    assert any(table.skipping[t][:1] >= b"\x80" for t in ids), "byte fragments of multi-byte characters were met"


def test_stop_string_cuts_and_is_never_sent(tokenizer):
    ids = tokenizer.encode("one two STOP three", add_special_tokens=False)
    d = Detokenizer(tokenizer, ["STOP"])
    out, stopped = "", False
    for t in ids:
        delta, stopped = d.add([t])
        out += delta
        if stopped:
            break
    assert stopped and out == "one two "


@pytest.mark.parametrize("byte_level", [False, True], ids=["window", "byte-table"])
def test_stop_strings_after_a_long_answer_hold_back_only_what_may_start_one(tokenizer, byte_level):
    """Several stop strings, one a prefix of another, the stop split over tokens after 2,000 words: the text equals
    the whole answer's decoded text cut before the first stop string found, and what the detokenizer keeps between
    tokens is never more than the longest stop string's start (not the answer so far)."""
    table = ByteTable.of(tokenizer) if byte_level else None
    stops = ["STOP!", "ST", "never"]
    words = " ".join(random.Random(1).choice(["alpha", "beta", "gamma", "S", "T", "!"]) for _ in range(2000))
    ids = tokenizer.encode(words + " xSTOP! tail", add_special_tokens=False)
    d = Detokenizer(tokenizer, stops, table=table)
    out, stopped, most_held = "", False, 0
    for t in ids:
        delta, stopped = d.add([t])
        out += delta
        most_held = max(most_held, len(d.held))
        if stopped:
            break
    whole = tokenizer.decode(ids)
    first = min(at for at in (whole.find(s) for s in stops) if at != -1)
    assert stopped and out == whole[:first] and most_held <= max(map(len, stops)) - 1
