"""What a step's sampling hands back, and when a request stops: torch-free, shared by the model and the mock."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.request import Request
from pdserve.wire.params import FinishReason, SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the raw model distribution, and the most likely ids there with theirs."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class Drawn:
    """One step's sampling: a token per sampling request, its log-probability where asked (else None), and the
    scores of the prompt rows (echo with logprobs), in the order they were given."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[TokenLogprob]


def finish_reason(req: Request, params: SamplingParams, max_model_len: int) -> FinishReason | None:
    """Why `req` stops after its newest token, or None to go on."""
    last = req.output_token_ids[-1]
    if last in params.stop_token_ids:
        return FinishReason.STOP
    if not params.ignore_eos and last in params.eos_token_ids:
        return FinishReason.STOP
    known = len(req.output_token_ids)  # a step scheduled ahead may hold one more on the device
    if known >= params.max_tokens or len(req.prompt_token_ids) + known >= max_model_len:
        return FinishReason.LENGTH
    return None
