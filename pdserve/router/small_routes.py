"""/tokenize, /detokenize (vLLM's request and response shapes) and /version."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

import pdserve
from pdserve.router.errors import ApiError
from pdserve.router.jobs import check_messages_text, check_text
from pdserve.router.limits import messages_size
from pdserve.router.text import NoTokenizerError, chat_prompt_ids

router = APIRouter()


class TokenizeBody(BaseModel):
    """Either `prompt` (a completion's text) or `messages` (a chat, through the chat template)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = False  # what /v1/completions does with a text prompt
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def check_model(request: Request, model: str | None) -> None:
    """404 unless `model` (when given) is a name this server serves."""
    check_served(request.app.state.served, model)


def check_served(served: set[str], model: str | None) -> None:
    if model is not None and model not in served:
        raise ApiError(
            404, f"model {model!r} does not exist; this server serves {sorted(served)[0]!r}", "model", "model_not_found"
        )


def _tokenize(info, body: TokenizeBody) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        check_text(body.prompt, "prompt")
        try:
            return info.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except NoTokenizerError as e:
            raise ApiError(400, str(e), "prompt") from None
    check_messages_text(body.messages)
    try:
        return chat_prompt_ids(info.tokenizer, body.messages, body.add_generation_prompt)
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request) -> dict:
    check_model(request, body.model)
    info = request.app.state.info
    size = len(body.prompt or "") + messages_size(body.messages or [])
    ids = await request.app.state.offload.run(size, _tokenize, info, body)  # a large input off the event loop
    strs = info.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request) -> dict:
    check_model(request, body.model)
    info = request.app.state.info
    bad = [t for t in body.tokens if not 0 <= t < info.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})", "tokens")
    return {"prompt": await request.app.state.offload.run(len(body.tokens), info.tokenizer.decode, body.tokens)}


@router.get("/version")
async def version() -> dict:
    return {"version": pdserve.__version__}
