"""The parameters the wire's messages carry, torch-free: who speaks (roles), how KV moves, why a request finished
or failed, a request's sampling parameters (checked as they are built: `InvalidField` names the field a client got
wrong), and the names of full KV blocks that prefix caching shares between nodes and the router."""

from __future__ import annotations

import array
import enum
import hashlib
import math
from dataclasses import dataclass
from typing import NewType

MAX_LOGPROBS = 20  # the most alternatives per position a request may ask for (OpenAI's limit)


class InvalidField(ValueError):
    """One field of a request's parameters is out of its range: `field` names it (the API's error `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


Id = NewType("Id", int)  # a token id, block id, count or size: an int >= 0


class Role(enum.StrEnum):
    """Who speaks on a connection: the router, or a node of one role (`pdserve <role>`)."""

    ROUTER = "router"
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


NODE_ROLES = (Role.COLOCATED, Role.PREFILL, Role.DECODE)


class KvTransport(enum.StrEnum):
    """How KV moves from a prefill node to a decode node (kv/transfer.py), as --kv-transport names it."""

    ZMQ = "zmq"
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"
    AUTO = "auto"  # shm / cuda_ipc with a decode node on the same host, zmq with the others


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token or EOS
    LENGTH = "length"  # max_tokens, or the model's context
    ABORT = "abort"  # the client left, or a stop string ended it in the router
    ERROR = "error"  # the event's error_code and error say why


class ErrorCode(enum.StrEnum):
    """Why a request failed, as the node or router that failed it knows it; the router maps it to an HTTP status
    (router/errors.py). The error text beside it is for people."""

    INVALID_REQUEST = "invalid_request"  # it can never be served as asked (e.g. larger than a node's KV pool)
    CAPACITY = "capacity"  # the server is overloaded: no first token within the queue timeout
    NODE_FAILED = "node_failed"  # a node it depended on was lost, and no other could take it over
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # its KV did not reach the decode node (refused, lease out, peer gone)
    DRAINING = "draining"  # the node or the router is shutting down
    INTERNAL = "internal"  # an engine error, or a message the node cannot act on


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: Id = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    seed: int | None = None
    stop_token_ids: tuple[Id, ...] = ()
    ignore_eos: bool = False
    eos_token_ids: tuple[Id, ...] = ()
    logprobs: int | None = None  # each sampled token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo), computed in its forward
    presence_penalty: float = 0.0  # minus this from the logit of each token already generated
    frequency_penalty: float = 0.0  # minus this times how often each token was generated
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: positive ones / it, negative * it
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (sampled rows)
    logit_bias: tuple[tuple[Id, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are generated
    grammar: str = ""  # guided decoding: an llguidance grammar (JSON text, never code) the output must match
    grammar_prefix: Id = 0  # how many of the prompt's last tokens the grammar has matched (a request resumed)
    resumed: Id = 0  # how many of the prompt's last tokens the request generated before it was dispatched again

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidField("max_tokens", "max_tokens must be at least 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (type(value) is int and 0 <= value <= MAX_LOGPROBS):
                raise InvalidField(name, f"{name} must be an integer from 0 to {MAX_LOGPROBS}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidField("temperature", "temperature must be a finite number >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidField("top_p", "top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidField("top_k", "top_k must be -1 (disabled) or a positive integer")
        self._check_processors()

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidField(name, f"{name} must be in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidField("repetition_penalty", "repetition_penalty must be a finite number > 0")
        if not 0 <= self.min_p <= 1:
            raise InvalidField("min_p", "min_p must be in [0, 1]")
        if any(type(t) is not int or t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias):
            raise InvalidField("logit_bias", "logit_bias maps token ids to biases in [-100, 100]")
        if type(self.min_tokens) is not int or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidField("min_tokens", "min_tokens must be an integer from 0 to max_tokens")
        if self.grammar and (self.ignore_eos or self.min_tokens):
            raise InvalidField(
                "grammar",
                "a grammar (response_format) ends the output at EOS: it cannot be combined "
                "with ignore_eos or min_tokens",
            )

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before the draw (penalties, bias, min_tokens); min_p acts in the draw."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy too (dividing logits by them would overflow)."""
        return self.temperature < 1e-5 or self.top_k == 1


def kv_tokens_needed(role: Role, num_prompt_tokens: int, max_tokens: int) -> int:
    """The most tokens of KV one request holds on a node of `role`: on a prefill node its prompt and first token,
    elsewhere every token it may reach. The router refuses what no node's pool holds; a node, what its own does not."""
    return num_prompt_tokens + (1 if role == Role.PREFILL else max_tokens)


# ---- prefix caching: the names of full KV blocks -------------------------------------------------
# A full block of KV is named by a 64-bit hash chained over its parent's name and its token ids, the chain
# seeded by the model's fingerprint: equal names mean equal KV (the same tokens at the same positions, after
# the same prefix, on the same weights). Every node and the router name blocks alike, so names travel.


def chain_seed(model_fingerprint: str) -> int:
    """The parent name of a sequence's first block."""
    return _hash64(model_fingerprint.encode())


def block_hashes(token_ids: list[int], block_size: int, parent: int) -> list[int]:
    """Names of the full blocks of `token_ids`, chained from `parent` (the chain seed, or the name of the block
    before the first of them). A partial last block has no name."""
    names = []
    for i in range(len(token_ids) // block_size):
        parent = block_name(parent, token_ids[i * block_size : (i + 1) * block_size])
        names.append(parent)
    return names


def block_name(parent: int, token_ids: list[int]) -> int:
    """The name of a full block holding `token_ids`, after the block named `parent`."""
    return _hash64(parent.to_bytes(8, "little") + array.array("q", token_ids).tobytes())


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
