"""Guided decoding in the engine: outputs are instances of their schema on a random-weight model, batched with
unguided requests (whose tokens do not change), through chunking and preemption, and replayed on a new engine."""

from __future__ import annotations

import json

import pytest
import transformers

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.request import Request
from pdserve.nodes.parts import build_engine
from pdserve.router.errors import ApiError
from pdserve.router.response_format import compile_schema, grammar_for
from pdserve.runner.grammar import GrammarError
from pdserve.wire.params import SamplingParams
from tests.helpers import optional

jsonschema = optional("jsonschema")
optional("llguidance")

SCHEMAS = [
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age", "ok"],
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
        },
    },
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["point", "tag"],
        "properties": {
            "point": {
                "type": "object",
                "required": ["x", "y"],
                "additionalProperties": False,
                "properties": {
                    "x": {"type": "integer", "minimum": -50, "maximum": 50},
                    "y": {"anyOf": [{"type": "null"}, {"type": "integer", "maximum": 9}]},
                },
            },
            "tag": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        },
    },
]
EOS = 511  # the tiny checkpoints' config.eos_token_id


def guided(rid: str, prompt: list[int], schema: dict, **kw) -> Request:
    params = SamplingParams(max_tokens=80, eos_token_ids=(EOS,), grammar=compile_schema(schema), **kw)
    return Request(rid, prompt, params)


def run(engine: Engine, reqs: list[Request]) -> dict[str, list[int]]:
    for r in reqs:
        engine.add(r)
    while engine.has_work():
        engine.step()
    return {r.request_id: r.output_token_ids for r in reqs}


def instance(tokenizer, ids: list[int], schema: dict):
    """The JSON the tokens spell, checked against the schema; they end with EOS (the grammar was complete)."""
    assert ids[-1] == EOS, tokenizer.decode(ids)
    value = json.loads(tokenizer.decode(ids[:-1]))
    jsonschema.validate(value, schema)
    return value


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return transformers.PreTrainedTokenizerFast.from_pretrained(tiny_models["qwen3"])


def workload() -> list[Request]:
    """Each schema greedy and seeded-sampled, and two unguided requests, in one batch."""
    prompts = [[5, 6, 7, 8, 9] * 6, [40, 41, 42], list(range(100, 137))]
    reqs = [guided(f"g{i}", prompts[i], s, temperature=0) for i, s in enumerate(SCHEMAS)]
    reqs += [guided(f"s{i}", prompts[i], s, temperature=1.0, seed=7 + i) for i, s in enumerate(SCHEMAS)]
    free = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
    ]
    return reqs + [Request(f"u{i}", [1, 2, 3, 4] * (i + 3), p) for i, p in enumerate(free)]


@pytest.mark.parametrize("budget,num_blocks", [(512, None), (16, 7)], ids=["roomy", "chunked-preempting"])
def test_guided_outputs_are_instances_and_others_unchanged(tiny_models, tokenizer, budget, num_blocks):
    path = str(tiny_models["qwen3"])
    reqs = workload()
    engine = build_engine(EngineConfig(model=path, max_num_batched_tokens=budget, num_kv_blocks=num_blocks))
    got = run(engine, reqs)
    for key in ("g", "s"):
        for i, schema in enumerate(SCHEMAS):
            instance(tokenizer, got[f"{key}{i}"], schema)
    alone = run(build_engine(EngineConfig(model=path)), [r for r in workload() if r.request_id.startswith("u")])
    assert {k: got[k] for k in alone} == alone  # unguided rows draw what they draw without guided neighbours
    if num_blocks is not None:
        assert engine.num_preemptions() > 0, "the small pool should have forced a preemption"
        roomy = run(build_engine(EngineConfig(model=path)), workload())
        assert got == roomy  # preempted and recomputed, guided requests draw the same tokens


def test_a_request_resumed_elsewhere_replays_its_tokens(tiny_models, tokenizer):
    """A decode node's request arrives with the prefill node's first token; a re-dispatched one with the streamed
    tokens as its prompt's tail (`grammar_prefix`): either way the grammar goes on from there."""
    path = str(tiny_models["qwen3"])
    schema = SCHEMAS[0]
    (whole,) = run(build_engine(EngineConfig(model=path)), [guided("a", [3, 4, 5], schema, temperature=0)]).values()
    first = Request("b", [3, 4, 5], guided("b", [], schema, temperature=0).params, output_token_ids=whole[:1])
    (rest,) = run(build_engine(EngineConfig(model=path)), [first]).values()
    assert rest == whole  # greedy: the same tokens as if the engine had drawn the first itself
    k = 6
    params = SamplingParams(
        max_tokens=80, eos_token_ids=(EOS,), grammar=compile_schema(schema), temperature=1.0, seed=5, grammar_prefix=k
    )
    (tail,) = run(build_engine(EngineConfig(model=path)), [Request("c", [3, 4, 5] + whole[:k], params)]).values()
    instance(tokenizer, whole[:k] + tail, schema)


def test_tokens_the_grammar_refuses_are_a_grammar_error(tiny_models, tokenizer):
    engine = build_engine(EngineConfig(model=str(tiny_models["qwen3"])))
    bad = tokenizer.encode("nope", add_special_tokens=False)
    req = guided("x", [1, 2], SCHEMAS[1], temperature=0)
    req.output_token_ids = bad
    with pytest.raises(GrammarError):
        engine.add(req)
    assert not engine.has_work()


@pytest.mark.parametrize(
    "response_format,words",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "nonsense"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "no-such"}}},
            "no-such",
        ),
        ({"type": "json_schema", "json_schema": "not a map"}, "json_schema"),
        ({"type": "xml"}, "json_object"),
    ],
)
def test_bad_response_formats_are_400s(response_format, words):
    with pytest.raises(ApiError) as e:
        grammar_for(response_format)
    assert e.value.status == 400 and e.value.param == "response_format" and words in e.value.message


def test_text_asks_for_no_grammar():
    assert grammar_for(None) == grammar_for({"type": "text"}) == ""
    assert grammar_for({"type": "json_object"})


def test_a_grammar_cannot_go_with_ignore_eos_or_min_tokens():
    for kw in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(ValueError, match="grammar"):
            SamplingParams(grammar=compile_schema({"type": "object"}), **kw)


def test_a_redispatched_guided_request_replays_what_was_streamed():
    """The router sends a request again as prompt + streamed tokens: its grammar must take those as matched."""
    from pdserve.router.core import RouterCore
    from pdserve.router.flight import Flight

    grammar = compile_schema({"type": "object"})
    flight = Flight("", [1, 2], SamplingParams(max_tokens=10, grammar=grammar), None, output=[5, 6, 7])
    assert RouterCore._resumed_params(flight).grammar_prefix == 3
    plain = Flight("", [1, 2], SamplingParams(max_tokens=10), None, output=[5, 6, 7])
    assert RouterCore._resumed_params(plain).grammar_prefix == 0


def test_prepare_builds_the_tokenizer_once_for_the_requests_to_come(tiny_models, monkeypatch):
    """What a node does before it reports ready (`Guides.prepare`): the grammar tokenizer is built then, and the
    guided requests that come later use it rather than building one on the engine's loop."""
    from pdserve.runner.grammar import Guides

    guides = Guides(tiny_models["qwen3"], 512, (EOS,))
    builds: list[int] = []
    build = guides._build
    monkeypatch.setattr(guides, "_build", lambda: builds.append(1) or build())
    guides.prepare()
    assert builds == [1]
    for rid, schema in (("g", SCHEMAS[1]), ("h", SCHEMAS[0])):
        req = guided(rid, [5, 6, 7], schema)
        guides.attach(req)
        assert req.guide is not None
    assert builds == [1]


# ---- the tokenizer llguidance gets, without transformers -----------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_a_plain_tokenizer_json_is_what_transformers_gives_llguidance(tiny_models, arch):
    """tokenizer.json read by `tokenizers` is, as JSON, the very tokenizer transformers' fast tokenizer hands
    llguidance (llguidance.hf.from_tokenizer serialises its backend, padding and truncation off)."""
    from copy import copy

    from pdserve.runner.grammar import plain_tokenizer

    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tiny_models[arch])
    backend = copy(hf.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    plain = plain_tokenizer(tiny_models[arch])
    assert plain.to_str() == backend.to_str() and plain.get_vocab_size(with_added_tokens=True) == len(hf)


def test_a_tokenizer_transformers_would_reshape_goes_through_transformers(tiny_models, tmp_path):
    import shutil

    from pdserve.runner.grammar import plain_tokenizer

    for change in (
        {"tokenizer_class": "LlamaTokenizer"},
        {"add_bos_token": True},
        {"added_tokens_decoder": {"9999": {"content": "<x>"}}},
    ):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(tiny_models["qwen3"], folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert plain_tokenizer(folder) is None, change


def test_a_node_start_imports_no_transformers(tiny_models):
    """The mechanism: the model, its config and the grammar tokenizer of a built-in-like checkpoint are loaded
    without importing transformers at all."""
    import subprocess
    import sys

    optional("llguidance")
    code = (
        "import sys\n"
        "from pdserve.config import EngineConfig\n"
        "from pdserve.nodes.parts import build_engine\n"
        f"engine = build_engine(EngineConfig(model={str(tiny_models['qwen3'])!r}, num_kv_blocks=16))\n"
        "engine.guides.prepare()\n"
        "print(engine.guides._tokenizer is not None, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]
