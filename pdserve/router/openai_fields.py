"""Which OpenAI request fields pdserve honours, which it accepts because they change nothing, and which it refuses.

A client that sends a field must be able to trust that it was honoured: a field pdserve does not
implement gets a 400 naming it, unless its value asks for nothing (the default, or null). Fields the
request models declare are the supported ones; this module judges everything else in the body.
"""

from __future__ import annotations

from collections.abc import Callable

# Accepted and ignored: they label or route a request in OpenAI's service, and change no output.
HARMLESS = frozenset({"user", "metadata", "service_tier", "store", "parallel_tool_calls"})


def _empty(value: object, body: dict) -> bool:
    return not value  # null, false, 0, "", [], {}


def _is(*neutral: object) -> Callable[[object, dict], bool]:
    return lambda value, body: value is None or any(value == v and type(value) is type(v) for v in neutral)


def _best_of(value: object, body: dict) -> bool:
    return value is None or value == body.get("n", 1)


# Known fields pdserve does not implement, each with the test that its value asks for nothing.
NOT_IMPLEMENTED: dict[str, Callable[[object, dict], bool]] = {
    "best_of": _best_of,
    "suffix": _empty,
    "echo": _empty,  # chat (completions declare it)
    "top_logprobs": _empty,  # completions (chat declares it)
    "prompt_logprobs": _is(),
    "tools": _empty,
    "tool_choice": _is("none"),
    "functions": _empty,
    "function_call": _is("none"),
    "audio": _is(),
    "modalities": lambda value, body: value is None or value == ["text"],
    "prediction": _is(),
    "reasoning_effort": _is(),
    "web_search_options": _is(),
    "use_beam_search": _is(False),
    "length_penalty": _is(1, 1.0),
}


class UnsupportedField(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_fields(extra: dict, body: dict) -> None:
    """Raise UnsupportedField for the first field of `extra` (fields no request model declares) that would change
    the output. `body` is the whole request, for fields judged together (best_of against n)."""
    for name, value in extra.items():
        if name in HARMLESS:
            continue
        if name in NOT_IMPLEMENTED:
            if not NOT_IMPLEMENTED[name](value, body):
                raise UnsupportedField(name, f"{name} is not supported by pdserve (got {_short(value)})")
        elif value is not None:
            raise UnsupportedField(name, f"unknown field {name!r}: pdserve does not implement it")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
