"""`response_format` as the grammar the nodes guide decoding with.

`{"type": "json_object"}` asks for any JSON object; `{"type": "json_schema", "json_schema": {"schema": {...}}}`
for an instance of that schema. The router compiles the schema with llguidance (no tokenizer needed), so
that a schema it cannot honour is a 400 here, and ships llguidance's grammar, JSON text, inside the
request's SamplingParams; each node builds the token-level matcher against its own tokenizer
(runner/grammar.py). The JSON is compact (no whitespace between its tokens): a model then cannot pad its
answer with whitespace until `max_tokens` runs out.
"""

from __future__ import annotations

import json

from pdserve.router.errors import ApiError

JSON_OPTIONS = {"whitespace_flexible": False}  # llguidance's JSON compile options
KINDS = ("text", "json_object", "json_schema")


def grammar_for(response_format: dict | None) -> str:
    """The llguidance grammar a response_format asks for ("" for none, or text); ApiError 400 when it is bad."""
    if response_format is None:
        return ""
    kind = response_format.get("type")
    if kind not in KINDS:
        raise ApiError(400, f"response_format.type must be one of {', '.join(KINDS)} (got {kind!r})", "response_format")
    if kind == "text":
        return ""
    return compile_schema(_schema(response_format) if kind == "json_schema" else {"type": "object"})


def _schema(response_format: dict) -> dict:
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ApiError(
            400, 'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}', "response_format"
        )
    return spec.get("schema", {})


def compile_schema(schema: dict) -> str:
    """llguidance's grammar for instances of `schema`, checked to compile; ApiError 400 if it does not."""
    try:
        import llguidance
    except ImportError:
        raise ApiError(
            400,
            "response_format json_object / json_schema needs llguidance, a dependency of "
            "pdserve, on the router: pip install llguidance",
            "response_format",
        ) from None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except ValueError as e:
        error = str(e)
    if error:
        raise ApiError(400, f"response_format: the JSON schema cannot be used: {error}", "response_format")
    return grammar


def schema_size(response_format: dict | None) -> int:
    """A cost estimate for compiling it (characters of its JSON): large ones are compiled off the event loop."""
    return 0 if response_format is None else len(json.dumps(response_format))
