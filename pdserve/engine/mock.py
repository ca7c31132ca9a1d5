"""The mock engine (`--engine mock`): the real engine, scheduler and KV block accounting with no model and no torch.

A mock node speaks the real node protocol and runs the real loop; only the parts an engine runs on are stand-ins:
- the model's facts (layers, KV heads, head size, vocabulary, context) come from the built-in spec or the
  checkpoint's config.json, so the KV a transfer carries has the real size; no weights are read;
- the pool is block ids only (the allocator), with no memory behind them; KV checksums are not computed;
- a step takes a modelled time, `a + b*tokens + c*requests + d*attended`, where `attended` is the sum over the
  batch's chunks of `n * (past + n / 2)` (a decode token: its context). The numbers come from --mock-step-s, or from
  a bench.costs JSON (--mock-costs): a prefill node takes its prefill costs (a, b, d), a decode or colocated node
  its decode costs (a, c, d). The step is launched and waited out like a GPU's (`overlapped`): the node reads its
  sockets and sends the previous step's tokens meanwhile, and sleeps, using no CPU, for the rest;
- the tokens are made up, deterministically, as a greedy model's are: the next token is a function of the sequence
  so far (its last token and its length), so a request dispatched again with its streamed tokens appended to its
  prompt goes on exactly as before, whichever node draws it (`mock_tokens`). They are ids 256..508, which a built-in
  model's byte-level tokenizer decodes as two printable characters (a router given `tiny` streams text). No EOS is
  drawn: max_tokens, stop token ids and the context end a request. Log-probabilities are made up too (the drawn
  token first, at -1.0). Guided decoding is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from types import SimpleNamespace

from pdserve.checkpoint import BUILTIN_MODELS, resolve_model
from pdserve.config import EngineConfig, max_model_len, read_mock_costs
from pdserve.engine.draws import Drawn, TokenLogprob
from pdserve.engine.parts import EngineParts
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Batch
from pdserve.kv.block_allocator import BlockAllocator
from pdserve.kv.layout import KVLayout

log = logging.getLogger("pdserve.engine")
MOCK_TOKENS = range(256, 509)  # two printable ASCII characters each in a built-in tokenizer of 512+ ids
_GOLDEN = 0x9E3779B1


def mock_tokens(prompt: list[int], n: int) -> list[int]:
    """The first `n` tokens a mock engine generates after `prompt` (tests compare streams against this)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(mock_token(seq[-1], len(seq)))
    return seq[len(prompt) :]


def mock_token(last: int, length: int) -> int:
    """The token after a sequence of `length` tokens that ends in `last`: a cheap 32-bit mix of the two."""
    h = ((last * _GOLDEN) ^ (length * 0x85EBCA6B)) & 0xFFFFFFFF
    h = (h ^ (h >> 15)) * 0x2C1B3C6D & 0xFFFFFFFF
    return MOCK_TOKENS[(h ^ (h >> 13)) % len(MOCK_TOKENS)]


@dataclass(frozen=True)
class StepCost:
    """A step's modelled seconds: base + per_token * tokens + per_request * requests + per_attended * attended."""

    base: float
    per_token: float
    per_request: float
    per_attended: float = 0.0

    def seconds(self, batch: Batch) -> float:
        _, lens, _, pasts = batch.arrays  # [R] each, at once
        tokens, attended = float(lens.sum()), float((lens * (pasts + lens / 2)).sum())
        requests = len(lens)
        return self.base + self.per_token * tokens + self.per_request * requests + self.per_attended * attended


def step_cost(cfg: EngineConfig, prefill_only: bool) -> StepCost:
    """--mock-step-s, or the role's costs in a bench.costs file."""
    if not cfg.mock_costs:
        return StepCost(*cfg.mock_step_s)
    c = read_mock_costs(cfg.mock_costs)
    if prefill_only:
        return StepCost(c["prefill_base_s"], c["prefill_per_token_s"], 0.0, c["prefill_per_token_ctx_s"])
    return StepCost(c["decode_base_s"], 0.0, c["decode_per_seq_s"], c["decode_per_ctx_token_s"])


def model_facts(model: str) -> SimpleNamespace:
    """The config of a built-in model (from its spec: nothing is written) or of a checkpoint folder."""
    spec = BUILTIN_MODELS.get(model)
    if spec is not None:
        return SimpleNamespace(
            vocab_size=spec.vocab_size,
            num_hidden_layers=spec.num_layers,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=spec.max_position_embeddings,
        )
    config = SimpleNamespace(**json.loads((resolve_model(model) / "config.json").read_text()))
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def mock_layout(cfg: EngineConfig, config: SimpleNamespace) -> KVLayout:
    """The model's KV layout; its fingerprint marks it as a mock's, so a mock never pairs with a model node."""
    facts = [config.vocab_size, config.num_hidden_layers, config.num_key_value_heads, config.head_dim]
    fingerprint = "mock-" + hashlib.sha256(json.dumps([cfg.model, *facts]).encode()).hexdigest()[:11]
    return KVLayout(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, cfg.block_size, cfg.dtype, fingerprint
    )


def mock_parts(cfg: EngineConfig, prefill_only: bool) -> EngineParts:
    config = model_facts(cfg.model)
    if config.vocab_size < MOCK_TOKENS.stop:
        raise ValueError(
            f"--engine mock draws token ids up to {MOCK_TOKENS.stop - 1}: the model's vocabulary of "
            f"{config.vocab_size} is too small"
        )
    layout = mock_layout(cfg, config)
    pool = MockPool(layout, cfg.num_blocks_for(layout.bytes_per_token()))
    runner = MockRunner(step_cost(cfg, prefill_only))
    log.info(
        "mock engine: %s's KV layout, %d blocks of %d tokens, a step of %s",
        cfg.model,
        pool.num_blocks,
        cfg.block_size,
        runner.cost,
    )
    return EngineParts(MockGuides(), layout, pool, runner, MockSampler(), max_model_len(config), overlapped=True)


class MockPool:
    """Block ids and their allocator; no memory behind them."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout, self.block_size, self.num_blocks = layout, layout.block_size, num_blocks
        self.allocator = BlockAllocator(num_blocks, layout.block_size)

    def checksums(self, block_ids: list[int], num_tokens: int, layers: list[int] | None = None) -> list[int]:
        """No KV, so no checksums ([]: the receiver checks none)."""
        return []


class MockGuides:
    def prepare(self) -> None:
        pass

    def attach(self, req: Request) -> None:
        if req.params.grammar:
            raise ValueError("guided decoding needs a model: this node runs --engine mock")


class MockRunner:
    graph_captures = 0  # no CUDA graphs: every step counts as eager

    def __init__(self, cost: StepCost) -> None:
        self.cost = cost

    def run(self, batch: Batch) -> tuple[float, bool]:
        """Start a step: when it will be done (time.monotonic()), and that no graph ran it."""
        return time.monotonic() + self.cost.seconds(batch), False


@dataclass
class MockDraw:
    done_at: float
    drawn: Drawn

    def wait(self) -> Drawn:
        """Sleep out the rest of the step's modelled time."""
        left = self.done_at - time.monotonic()
        if left > 0:
            time.sleep(left)
        return self.drawn


class MockSampler:
    def launch(
        self, done_at: float, requests: list[Request], prompt_rows: list[tuple[Request, int]] = (), _rows=None
    ) -> MockDraw:
        tokens = [mock_token(_last(r), r.num_tokens) for r in requests]
        logprobs = [made_up_logprob(t, r.params.logprobs) for t, r in zip(tokens, requests, strict=True)]
        scored = [made_up_logprob(token, req.params.prompt_logprobs) for req, token in prompt_rows]
        return MockDraw(done_at, Drawn(tokens, logprobs, scored))


def _last(req: Request) -> int:
    return req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]


def made_up_logprob(token: int, k: int | None) -> TokenLogprob | None:
    """The token at -1.0 and `k` alternatives (itself first, then the ids after it): None when none were asked."""
    if k is None:
        return None
    top = [token, *(MOCK_TOKENS[(token - MOCK_TOKENS.start + i) % len(MOCK_TOKENS)] for i in range(1, k))][:k]
    return TokenLogprob(-1.0, top, [-1.0 - i for i in range(len(top))])
