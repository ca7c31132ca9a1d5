"""Token sampling and stop conditions.

Greedy rows are one argmax over the batch. Other rows sample with temperature, top-k and top-p.
A seeded request draws its i-th token from a generator seeded by (seed, i) alone, so it samples the
same tokens whatever it is batched with, after a preemption, and on whichever node draws it.
"""

from __future__ import annotations

import torch

from pdserve.common.protocol import SamplingParams
from pdserve.common.request import Request


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits: [num_requests, V] -> one token id per request."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, req in enumerate(requests):
            if not req.params.greedy:
                tokens[i] = self._sample(logits[i], req)
        return tokens

    @staticmethod
    def _generator(req: Request) -> torch.Generator:
        gen = torch.Generator()
        if req.params.seed is None:
            gen.seed()
        else:  # the token index makes each draw independent of every earlier one
            gen.manual_seed((req.params.seed * 1_000_003 + len(req.output_token_ids)) % 2**63)
        return gen

    def _sample(self, logits: torch.Tensor, req: Request) -> int:
        p = req.params
        scores = logits.float() / p.temperature  # [V]
        if p.top_k > 0 and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = sorted_scores.softmax(-1)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self._generator(req)).item())


def finish_reason(req: Request, params: SamplingParams, max_model_len: int) -> str | None:
    """Why `req` stops after its newest token, or None to go on."""
    last = req.output_token_ids[-1]
    if last in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and last in params.eos_token_ids:
        return "stop"
    if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None
