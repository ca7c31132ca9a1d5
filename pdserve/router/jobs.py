"""A request's jobs: the body it arrived with (checked by pydantic), and one `Job` per prompt and choice, with its
token ids, sampling parameters and what its response needs (`make_job`, `expand`). Bad input raises ApiError here,
before anything is dispatched."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, replace

from pydantic import BaseModel, ConfigDict

from pdserve.router.choices import derive_seed
from pdserve.router.errors import ApiError
from pdserve.router.limits import Offload, content_chars, message_strings, messages_size, stop_problem
from pdserve.router.logprobs import ChoiceExtras
from pdserve.router.text import ModelInfo, NoTokenizerError, chat_prompt_ids
from pdserve.wire.params import InvalidField, SamplingParams

log = logging.getLogger("pdserve.router")

# ---- request bodies ------------------------------------------------------------------------------


class BodyFields(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False
    n: int = 1
    return_token_ids: bool = False
    presence_penalty: float | None = None  # null: the default (0, 0, 1, 0, none, 0, false, true)
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    response_format: dict | None = None  # text, json_object or json_schema (guided decoding)


class CompletionBody(BodyFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list | None = None


class ChatBody(BodyFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None


@dataclass
class Job:
    """A validated request: what the router dispatches and how the answer is shaped."""

    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    index: int = 0  # the choice's index in the response
    sample: int = 0  # which of its prompt's n samples it is
    chat: bool = False
    logprobs: int | None = None  # alternatives per token when log-probabilities are asked for
    echo: bool = False  # the prompt goes in front of the completion
    show_tokens: bool = True  # False for max_tokens 0 (echo): the one token the nodes generate is dropped
    include_stop: bool = False  # include_stop_str_in_output
    skip_special: bool = True  # skip_special_tokens

    def extras(self, tokenizer) -> ChoiceExtras | None:
        if self.logprobs is None and not self.echo:
            return None
        return ChoiceExtras(tokenizer, self.chat, self.logprobs, self.prompt_ids, self.echo)


# ---- validation ----------------------------------------------------------------------------------


def _batch(body: BodyFields) -> list[str | list[int]]:
    """Each prompt of the request: a completion's string or list of ids, or each of a batch of either; a chat's one."""
    prompt = getattr(body, "prompt", None)
    return prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]


def check_choices(body: BodyFields, max_n: int, max_choices: int) -> None:
    """Refuse, before any prompt is tokenized, an `n` out of range, or more choices (prompts times n) than the router
    lets wait at once (--max-queued-requests): such a request could never be admitted, and would cost a job each."""
    if not 1 <= body.n <= max_n:
        raise ApiError(400, f"n must be between 1 and {max_n} (--max-n)", "n")
    prompts = len(_batch(body))
    if prompts * body.n > max_choices:
        raise ApiError(
            400,
            f"the request asks for {prompts * body.n} choices ({prompts} prompts, n {body.n}); at most {max_choices} "
            "can wait at once (--max-queued-requests)",
            "prompt" if prompts > 1 else "n",
        )


def _prompts(body: CompletionBody, info: ModelInfo) -> list[str | list[int]]:
    """Each prompt of the request (a string, a list of ids, or a batch of either), strings checked to be short
    enough to fit and ids to be in the vocabulary."""
    return [_one_prompt(p, info) for p in _batch(body)]


def _one_prompt(prompt: str | list[int], info: ModelInfo) -> str | list[int]:
    if isinstance(prompt, str):
        _check_chars(len(prompt), info, "prompt")
        check_text(prompt, "prompt")
        return prompt
    _check_prompt_len(len(prompt), info)
    if prompt and not 0 <= min(prompt) <= max(prompt) < info.vocab_size:  # checked in C; then the culprit found
        bad = next(t for t in prompt if not 0 <= t < info.vocab_size)
        raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {info.vocab_size})", "prompt")
    return list(prompt)


def _check_chars(n: int, info: ModelInfo, param: str) -> None:
    """Refuse, before tokenizing, text too long to fit the context whatever its tokens."""
    if n > info.max_prompt_chars:
        raise ApiError(
            400,
            f"the {param} has {n} characters, more than this model's context of "
            f"{info.max_model_len} tokens can hold (at most {info.max_prompt_chars})",
            param,
        )


def check_text(text: str, param: str) -> None:
    """Refuse text that no UTF-8 encodes, so no tokenizer takes: a lone surrogate, which JSON's \\ud800 escape
    can carry."""
    if text.isascii():
        return
    try:
        text.encode()
    except UnicodeEncodeError as e:
        where = f"{text[e.start]!r} at character {e.start}"
        raise ApiError(400, f"the {param} is not valid Unicode: a lone surrogate ({where})", param) from None


def _check_prompt_len(n: int, info: ModelInfo) -> None:
    if n >= info.max_model_len:
        raise ApiError(400, f"the prompt has {n} tokens; this model's context is {info.max_model_len} tokens", "prompt")


async def prompt_ids(body: CompletionBody, info: ModelInfo, offload: Offload) -> list[list[int]]:
    """The token ids of each prompt; long strings are tokenized off the event loop."""
    return [
        p if isinstance(p, list) else await offload.run(len(p), _encode, info.tokenizer, p)
        for p in _prompts(body, info)
    ]


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except NoTokenizerError as e:
        raise ApiError(400, str(e), "prompt") from None


async def chat_ids(body: ChatBody, info: ModelInfo, offload: Offload) -> list[int]:
    if not body.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    chars = sum(content_chars(m.content) for m in body.messages)
    _check_chars(chars, info, "messages")
    messages = [m.model_dump() for m in body.messages]
    check_messages_text(messages)
    return await offload.run(messages_size(messages), _apply_template, messages, info)


def check_messages_text(messages: list[dict]) -> None:
    """`check_text` on every string of every message, named as "messages[2].content"."""
    for i, m in enumerate(messages):
        for where, text in message_strings(m):
            check_text(text, f"messages[{i}].{where}")


def _apply_template(messages: list[dict], info: ModelInfo) -> list[int]:
    try:
        return chat_prompt_ids(info.tokenizer, messages)
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None


def _asked_logprobs(body: BodyFields) -> tuple[int | None, bool]:
    """(alternatives per token, or None when no log-probabilities are asked for; echo)."""
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None, False
    return getattr(body, "logprobs", None), bool(getattr(body, "echo", False))


def _logit_bias(body: BodyFields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs, ids checked against the vocabulary."""
    pairs = []
    for key, bias in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:  # isdigit alone: '²', '١' too
            raise ApiError(400, f"logit_bias: {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        pairs.append((int(key), bias))
    return tuple(pairs)


STREAM_OPTIONS = ("include_usage", "include_obfuscation")  # honoured; accepted and ignored (no padding is sent)


def _stream_options(opts: dict | None) -> dict:
    """stream_options, refusing any key that asks for something pdserve does not do (vLLM's continuous usage)."""
    asks = [k for k, v in (opts or {}).items() if k not in STREAM_OPTIONS and v not in (None, False)]
    if asks:
        raise ApiError(400, f"stream_options.{asks[0]} is not supported by pdserve", "stream_options")
    return opts or {}


def _field_error(e: InvalidField, body: BodyFields, chat: bool) -> ApiError:
    """A sampling parameter out of range, named as the request named it (`param`, and in the message)."""
    names = {"grammar": "response_format", "prompt_logprobs": "logprobs", "logprobs": "logprobs"}
    if chat:
        names["logprobs"] = "top_logprobs"
    if body.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    param = names.get(e.field, e.field)
    message = str(e) if e.field == "grammar" else str(e).replace(e.field, param, 1)
    return ApiError(400, message, param)


def make_job(
    body: BodyFields,
    prompt_ids: list[int],
    info: ModelInfo,
    chat_default: bool = False,
    kv_capacity: int | None = None,
    grammar: str = "",
) -> Job:
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    top, echo = _asked_logprobs(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    show_tokens = not (echo and max_tokens == 0)  # echo alone: the prompt (and its logprobs), nothing generated
    max_tokens = max_tokens if show_tokens else 1
    if max_tokens is None:  # OpenAI: 16 for completions; chat goes on until EOS or the context's end
        room = min(info.max_model_len, kv_capacity or info.max_model_len) - len(prompt_ids)
        max_tokens = max(1, room if chat_default else min(16, room))
    for name, value in (("seed", body.seed), ("top_k", body.top_k), ("max_tokens", max_tokens)):
        if value is not None and not -(2**63) <= value < 2**63:
            raise ApiError(400, f"{name} is out of range", name)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    problem = stop_problem(stops, body.stop_token_ids)
    if problem:
        raise ApiError(400, *problem)
    bad = [t for t in body.stop_token_ids or () if not 0 <= t < info.vocab_size]
    if bad:
        raise ApiError(
            400, f"stop token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})", "stop_token_ids"
        )
    _check_prompt_len(len(prompt_ids), info)
    if max_tokens >= 1 and len(prompt_ids) + max_tokens > info.max_model_len:
        raise ApiError(
            400,
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"model's context of {info.max_model_len} tokens",
            "max_tokens",
        )
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            eos_token_ids=info.eos_token_ids,
            logprobs=top,
            prompt_logprobs=top if echo else None,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_p=body.min_p or 0.0,
            logit_bias=_logit_bias(body, info.vocab_size),
            min_tokens=body.min_tokens or 0,
            grammar=grammar,
        )
    except InvalidField as e:
        raise _field_error(e, body, chat_default) from None
    if not show_tokens:
        params = _hidden_token(params)
    opts = _stream_options(body.stream_options)
    return Job(
        prompt_ids,
        params,
        [s for s in stops if s],
        body.stream,
        bool(opts.get("include_usage")),
        body.return_token_ids,
        body.model,
        chat=chat_default,
        logprobs=top,
        echo=echo,
        show_tokens=show_tokens,
        include_stop=bool(body.include_stop_str_in_output),
        skip_special=body.skip_special_tokens is not False,
    )


def _hidden_token(params: SamplingParams) -> SamplingParams:
    """Echo with max_tokens 0: the nodes still compute one token, which the client never sees. It is drawn
    greedily with EOS and stop tokens ignored, so that the request ends by length whatever the client's sampling
    parameters (which were checked all the same); the prompt's log-probabilities are those of the raw model."""
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,
        eos_token_ids=params.eos_token_ids,
        prompt_logprobs=params.prompt_logprobs,
    )


# ---- running a job -------------------------------------------------------------------------------


def expand(jobs: list[Job], n: int) -> list[Job]:
    """One job per choice: prompt i's sample j is choice i * n + j, with its own seed; one id for the response."""
    if n == 1 and len(jobs) == 1:
        return jobs  # choice 0, sample 0, its own seed and id already
    first = jobs[0]
    return [
        replace(
            job,
            id=first.id,
            created=first.created,
            index=i * n + j,
            sample=j,
            params=replace(job.params, seed=derive_seed(job.params.seed, j)),
        )
        for i, job in enumerate(jobs)
        for j in range(n)
    ]
