"""The wire's codec, torch-free. A message travels as one msgpack map (`use_bin_type=True`) with its type tag under
"t". Decoding looks the tag up in `MESSAGES` only, refuses unknown or missing fields, checks every field against the
type its message declares (nested messages included; token ids, block ids and shapes are `Id`s, non-negative), and
bounds what a peer can make us allocate. No pickle anywhere."""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

import msgpack

from pdserve.wire.messages import EVENT_DEFAULTS, MESSAGES, TokenEvent, TokenEvents
from pdserve.wire.params import Id

MAX_HEADER_BYTES = 64 * 1024 * 1024  # one control message; tensor frames are bounded separately
MAX_LIST_LEN = 4 * 1024 * 1024


class ProtocolError(ValueError):
    """A peer sent something we refuse to decode."""


def _wire_map(value: Any) -> dict:
    """A message (or nested part) as msgpack takes it, called by msgpack for each dataclass it meets, so that lists of
    ids and strings are packed in C, not visited here. A field at its plain default is left out (the decoder fills it
    in), so that a token event is two fields, not seven. Enums are StrEnums, which msgpack packs as their value."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        raise TypeError(f"cannot encode a {type(value).__name__}")
    out = {}
    for name, default in _wire_fields(type(value)):
        v = getattr(value, name)
        if type(v) is not type(default) or v != default:
            out[name] = v
    return out


@functools.cache
def _wire_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each field of a message class; dataclasses.MISSING where the default is none or a
    factory's (a field that is always sent)."""
    return tuple((f.name, f.default) for f in dataclasses.fields(cls))


def encode(msg: Any) -> bytes:
    tag = type(msg).__name__
    if MESSAGES.get(tag) is not type(msg):
        raise TypeError(f"{tag} is not a registered message type")
    body = _wire_map(msg)
    body["t"] = tag
    return msgpack.packb(body, use_bin_type=True, default=_wire_map)


def _build(cls: type, body: Any) -> Any:
    """A message (or nested part) of type `cls` from its decoded map, every field checked against its type."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__}: expected a map, got {type(body).__name__}")
    if cls is TokenEvent and (plain := _plain_token_event(body)) is not None:
        return plain
    if cls is TokenEvents:  # one a step and node: the hot path
        if not body.keys() <= {"events", "tokens"} or type(body.get("events")) is not list:
            raise ProtocolError(f"TokenEvents: expected events (a list) and tokens, got {sorted(body)}")
        return TokenEvents([_build(TokenEvent, e) for e in body["events"]], _flat_tokens(body.get("tokens", [])))
    checkers = _field_checkers(cls)
    unknown = body.keys() - checkers.keys()
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    kwargs = {name: checkers[name](value) for name, value in body.items()}
    try:
        return cls(**kwargs)
    except Exception as e:  # a missing field, or a value its __post_init__ refuses
        raise ProtocolError(f"{cls.__name__}: {e}") from e


def _plain_token_event(body: dict) -> TokenEvent | None:
    """The commonest message part, a request's new tokens and nothing else (its other fields at their defaults, so
    left out by `encode`), checked in a few steps: one arrives per request and step. None for any other event,
    which the general checks take."""
    rid, ids = body.get("request_id"), body.get("token_ids")
    if len(body) != 2 or type(rid) is not str or type(ids) is not list:
        return None
    for t in ids:
        if type(t) is not int or t < 0:
            return None
    ev = object.__new__(TokenEvent)  # what TokenEvent(rid, ids) gives, without a frozen dataclass's slow __init__
    ev.__dict__.update(EVENT_DEFAULTS, request_id=rid, token_ids=ids)
    return ev


def _flat_tokens(tokens: Any) -> list:
    """TokenEvents.tokens checked: request ids (strings) and lists of token ids (non-negative integers), in turn."""
    if type(tokens) is not list or len(tokens) % 2:
        raise ProtocolError("TokenEvents.tokens must be a list of request ids and token id lists, in turn")
    for k in range(0, len(tokens), 2):
        rid, ids = tokens[k], tokens[k + 1]
        if type(rid) is not str or type(ids) is not list:
            raise ProtocolError("TokenEvents.tokens must be a list of request ids and token id lists, in turn")
        for t in ids:
            if type(t) is not int or t < 0:
                raise ProtocolError("TokenEvents.tokens[] must be non-negative integers")
    return tokens


@functools.cache
def _field_checkers(cls: type) -> dict[str, Any]:
    """Per field of a message class, a function that returns the value as declared or raises (built once)."""
    hints = typing.get_type_hints(cls)
    return {f.name: _checker(hints[f.name], f"{cls.__name__}.{f.name}") for f in dataclasses.fields(cls)}


def _checker(hint: Any, where: str):
    """A function checking a value against the declared type `hint`: nested messages built, lists to tuples
    where declared, ints accepted as floats."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = _checker(next(a for a in args if a is not type(None)), where)
        return lambda v: None if v is None else inner(v)
    if dataclasses.is_dataclass(hint):
        return lambda v: _build(hint, v)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_checker(hint, where)
    if origin is tuple and args and args[-1] is not Ellipsis:  # a fixed-length tuple: one type per place
        places = [_checker(a, f"{where}[{i}]") for i, a in enumerate(args)]

        def fixed(v):
            if not isinstance(v, (list, tuple)) or len(v) != len(places):
                raise ProtocolError(f"{where} must be a list of {len(places)}")
            return tuple(check(x) for check, x in zip(places, v, strict=True))

        return fixed
    if origin in (list, tuple):
        item, as_tuple = _checker(args[0], f"{where}[]"), origin is tuple
        plain = _SCALARS.get(args[0], (None, ""))[0] if args[0] is not float else None  # kept as they are

        def sequence(v):
            if not isinstance(v, (list, tuple)):
                raise ProtocolError(f"{where} must be a list")
            if plain is not None and all(map(plain, v)):
                items = v
            else:
                items = [item(x) for x in v]
            return tuple(items) if as_tuple else list(items)

        return sequence
    ok, name = _SCALARS[hint]

    def scalar(v):
        if not ok(v):
            raise ProtocolError(f"{where} must be {name}")
        return float(v) if hint is float else v

    return scalar


def _enum_checker(cls: type[enum.Enum], where: str):
    values = {m.value: m for m in cls}

    def member(v):
        if type(v) is not str or v not in values:
            raise ProtocolError(f"{where} must be one of {', '.join(values)}")
        return values[v]

    return member


_SCALARS = {
    Id: (lambda v: type(v) is int and v >= 0, "a non-negative integer"),
    int: (lambda v: type(v) is int, "an integer"),
    float: (lambda v: type(v) in (int, float), "a number"),
    str: (lambda v: type(v) is str, "a string"),
    bool: (lambda v: type(v) is bool, "true or false"),
    dict: (lambda v: type(v) is dict, "a map"),
}


def decode(data: bytes) -> Any:
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=MAX_LIST_LEN, max_map_len=1024)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {e}") from e
    if not isinstance(body, dict) or not isinstance(body.get("t"), str):
        raise ProtocolError("message without a type tag")
    cls = MESSAGES.get(body.pop("t"))
    if cls is None:
        raise ProtocolError("unknown message type")
    return _build(cls, body)
