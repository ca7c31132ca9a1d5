"""Incremental detokenizing and stop strings, against decoding the whole answer at once."""

from __future__ import annotations

import random

import pytest
import transformers

from pdserve.engine.checkpoint import resolve_model
from pdserve.router.text import ByteTable, Detokenizer, backend_decoder


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
