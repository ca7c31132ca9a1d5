"""Token sampling and stop conditions, batched on the logits' device.

Rows that set a logits processor (`min_tokens`, `logit_bias`, repetition, frequency and presence
penalties, as vLLM defines them) have their logits changed first, together, on the device: greedy
rows too; then the rows of guided requests lose every token their grammar forbids (runner/grammar.py).
Greedy rows are then one argmax over the batch. The rows that sample (temperature, top-k, top-p) are drawn
together: temperature scaling, the min-p mask, top-k and top-p masks in one sort, then the Gumbel-max trick
(`argmax(log p - log E)` with `E` exponential noise), which draws exactly from the masked
distribution. The noise comes from a counter-based hash of (request key, token index, vocabulary
id), computed on the device: a seeded request draws its i-th token from (seed, i) alone, so it
samples the same tokens whatever it is batched with, after a preemption, on whichever node and
device draws it, and after the router dispatched it again (its i-th token then counts the
`SamplingParams.resumed` tokens it streamed before); no per-request generator or host round trip
is needed. An unseeded request's key is its id hashed with a per-process random salt.

Log-probabilities, for the rows that ask (`logprobs`, and the prompt rows of `echo` with logprobs), are
those of the raw model distribution: a log-softmax of the logits before temperature, top-k/top-p and
any logits processor, as vLLM v1 returns by default. They are computed in the same batch on the
device: the requested rows' log-softmax, the drawn or prompt token's value, and one top-k for the
largest number of alternatives asked, all packed with the sampled ids into one host copy.

When no row asks for log-probabilities, the sampled ids are the step's only device-to-host copy.
`Sampler.launch` queues all of it on the device and starts that copy (into pinned memory) without
waiting; its `PendingDraw.wait()` returns the tokens once they are on the host. The small host
inputs (row indices, the rows' parameters, penalties' counts) go to the device through pinned memory
without waiting either (`copies.py`), so launching a step never waits for the device.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.draws import Drawn, TokenLogprob
from pdserve.engine.request import Request
from pdserve.engine.rows import DrawRows
from pdserve.runner.copies import HostCopy, to_device
from pdserve.runner.grammar import mask_rows

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
# odd multipliers below 2**31, so that a 32-bit value times one stays below 2**63 in int64 arithmetic
_K1, _K2 = 0x7FEB352D, 0x2C1B3C6D


@dataclass
class PendingDraw:
    """A step's sampling, queued on the device: `wait()` gives its result once the host copy has landed."""

    copy: HostCopy  # [S] token ids; or, when any row is scored, `_pack_scores`'s float64 vector
    num_tokens: int  # S
    asked: list[int]  # the sampling rows that asked for log-probabilities
    ks: list[int]  # alternatives of each scored row: the asked rows, then the prompt rows
    ids: torch.Tensor | None = None  # [S] the sampled ids on the device (the next step's inputs read them there)

    def wait(self) -> Drawn:
        host = self.copy.wait().tolist()
        S = self.num_tokens
        if not self.ks:
            return Drawn(host, [None] * S, [])
        scored = _unpack_scores(host[S:], self.ks)
        logprobs: list[TokenLogprob | None] = [None] * S
        for i, lp in zip(self.asked, scored[: len(self.asked)], strict=True):
            logprobs[i] = lp
        return Drawn([int(t) for t in host[:S]], logprobs, scored[len(self.asked) :])


class Sampler:
    def __init__(self) -> None:
        self._salt = random.SystemRandom().getrandbits(64)
        self._vocab_hash: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(
        self, logits: torch.Tensor, requests: list[Request], prompt_rows: list[tuple[Request, int]] = ()
    ) -> Drawn:
        """`launch`, then wait for its result."""
        return self.launch(logits, requests, prompt_rows).wait()

    def launch(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        prompt_rows: list[tuple[Request, int]] = (),
        rows: DrawRows | None = None,
    ) -> PendingDraw:
        """logits: [S + P, V], the S sampling requests' rows then P prompt rows, each given as (request, the prompt
        token its logits score) -> one token id per request, and the log-probabilities asked for, queued on the
        logits' device with their one copy to the host. `rows`: where the requests' parameters are kept, if any."""
        S = len(requests)
        tokens = self.draw(logits[:S], requests, rows)  # [S]
        asked = self.asked(requests, rows)
        if not asked and not prompt_rows:
            return PendingDraw(HostCopy.of(tokens), S, [], [], tokens)
        ks = [requests[i].params.logprobs for i in asked] + [req.params.prompt_logprobs for req, _ in prompt_rows]
        dev = logits.device
        rows = to_device(asked + list(range(S, S + len(prompt_rows))), dev, torch.long)  # [A + P]
        prompt_targets = to_device([t for _, t in prompt_rows], dev, torch.long)
        targets = torch.cat((tokens.index_select(0, rows[: len(asked)]), prompt_targets))  # [A + P]
        packed = _pack_scores(tokens, logits.index_select(0, rows), targets, max(ks))
        return PendingDraw(HostCopy.of(packed), S, asked, ks, tokens)  # the one copy

    def draw(self, logits: torch.Tensor, requests: list[Request], rows: DrawRows | None = None) -> torch.Tensor:
        """logits: [S, V] -> one token id per request, [S] on the device. Only the rows with logits processors or
        a grammar are looked at one by one."""
        greedy, processed, guided = self.flags(requests, rows)  # [S] bool each
        if processed.any():
            logits = process_rows(logits, requests, np.flatnonzero(processed).tolist())
        if guided.any():  # guided rows: what their grammar allows
            logits = mask_rows(logits, requests, np.flatnonzero(guided).tolist())
        tokens = logits.argmax(dim=-1)  # [S]
        pick = np.flatnonzero(~greedy)  # [R] the rows that sample
        if len(pick):
            host, min_p_on, ranked_on = self.host_params(requests, rows, pick, logits.shape[1])
            packed = to_device(host, logits.device)  # one copy
            idx = packed[:, 5]
            drawn = self.sample(logits.index_select(0, idx), packed, min_p_on, ranked_on)
            tokens = tokens.index_copy(0, idx, drawn)
        return tokens

    def host_params(
        self, requests: list[Request], rows: DrawRows | None, pick: np.ndarray, V: int
    ) -> tuple[np.ndarray, bool, bool]:
        """The sampling rows `pick`'s parameters as `_packed`'s [R, 6] host array (gathered from the rows, or request
        by request), and whether any sets min-p, and top-k or top-p: the draw's whole host side."""
        t, k, p, key, m = params = (
            self.gather(requests, rows, pick) if rows is not None else self.params(requests, pick)
        )
        ranked_on = bool(((k > 0) & (k < V)).any() or (p < 1.0).any())
        return _packed(params, pick, V), bool((m > 0).any()), ranked_on

    @staticmethod
    def asked(requests: list[Request], rows: DrawRows | None) -> list[int]:
        """The requests that ask for log-probabilities."""
        if rows is not None:
            return np.flatnonzero(rows.table.asks[rows.rows]).tolist()
        return [i for i, req in enumerate(requests) if req.params.logprobs is not None]

    @staticmethod
    def flags(requests: list[Request], rows: DrawRows | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(greedy, processed, guided) of each request: [S] bool each."""
        if rows is not None:
            t, r = rows.table, rows.rows
            return t.greedy[r], t.processed[r], t.guided[r]
        ps = [req.params for req in requests]
        return (
            np.array([p.greedy for p in ps], dtype=bool),
            np.array([p.processed for p in ps], dtype=bool),
            np.array([req.guide is not None for req in requests], dtype=bool),
        )

    def row_params(self, req: Request) -> tuple[float, int, float, int, float]:
        """(temperature, top_k, top_p, noise key, min_p) of a request's next draw."""
        p = req.params
        step = p.resumed + req.num_output_tokens  # a resumed request's streamed tokens are its prompt's tail
        base = p.seed if p.seed is not None else (hash(req.request_id) ^ self._salt)
        return p.temperature, p.top_k, p.top_p, draw_key(base, step), p.min_p

    def params(self, requests: list[Request], pick: np.ndarray) -> tuple[np.ndarray, ...]:
        """(temperature, top_k, top_p, key, min_p) of requests `pick`'s next draws, one by one: [R] each."""
        t, k, p, key, m = zip(*(self.row_params(requests[i]) for i in pick), strict=True)
        f32 = functools.partial(np.array, dtype=np.float32)
        return f32(t), np.array(k, dtype=np.int64), f32(p), np.array(key, dtype=np.int64), f32(m)

    def gather(self, requests: list[Request], rows: DrawRows, pick: np.ndarray) -> tuple[np.ndarray, ...]:
        """`params`, gathered from the persistent rows at once: the same values."""
        t, r = rows.table, rows.rows[pick]
        base = t.key_base[r] ^ np.where(t.seeded[r], np.uint64(0), np.uint64(self._salt))  # [R] uint64
        keys = draw_keys(base, (rows.num_tokens[pick] - t.draw_base[r]).astype(np.uint64))
        return t.temperature[r], t.top_k[r], t.top_p[r], keys, t.min_p[r]

    def sample(self, logits: torch.Tensor, packed: torch.Tensor, min_p_on: bool, ranked_on: bool) -> torch.Tensor:
        """logits [R, V]; packed [R, 5+] (`_packed`: temperature, top_k, top_p, key, min_p) -> token ids [R] (on the
        device). `min_p_on`, `ranked_on`: whether any row sets min-p, and top-k or top-p (known on the host)."""
        R, V = logits.shape
        as_f32 = packed.to(torch.int32).view(torch.float32)  # temperature, top_p, min_p travelled as their bits
        temperature, top_p, min_p = as_f32[:, 0], as_f32[:, 2], as_f32[:, 4]
        top_k, keys = packed[:, 1], packed[:, 3]
        scores = logits.float() / temperature[:, None]  # [R, V]
        if min_p_on:  # min-p: p < min_p * p_max  <=>  score < max score + log(min_p)
            floor = scores.max(-1, keepdim=True).values + torch.log(min_p)[:, None]  # [R, 1]; log 0 = -inf
            scores = scores.masked_fill(scores < floor, float("-inf"))
        noise = self.log_exponential(keys, V, logits.device)  # [R, V]: log E
        # argmax(log p - log E): log p is the scores less a per-row constant, which the argmax ignores
        if not ranked_on:
            return (scores - noise).argmax(-1)
        ranked, order = scores.sort(dim=-1, descending=True)  # [R, V]
        rank = torch.arange(V, device=logits.device)
        ranked = ranked.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))  # top-k
        probs = ranked.softmax(-1)
        ranked = ranked.masked_fill(probs.cumsum(-1) - probs > top_p[:, None], float("-inf"))  # top-p
        pick = (ranked - noise.gather(1, order)).argmax(-1)  # [R], in ranked order
        return order.gather(1, pick[:, None])[:, 0]

    def log_exponential(self, keys: torch.Tensor, V: int, device: torch.device) -> torch.Tensor:
        """log E for E ~ Exp(1), one per (row key, vocabulary id): [R, V] float32."""
        vh = self._vocab_hash.get((V, device))
        if vh is None:
            vh = self._vocab_hash[(V, device)] = _mix32(torch.arange(V, dtype=torch.int64, device=device) + _K2)
        h = _mix32(keys[:, None] ^ vh[None, :])  # [R, V] in [0, 2**32)
        u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1), never 0 or 1
        return torch.log(-torch.log(u))


def _packed(params: tuple[np.ndarray, ...], pick: np.ndarray, V: int) -> np.ndarray:
    """(temperature, top_k, top_p, key, min_p) of rows `pick`, [R] each -> [R, 6] int64: the floats as their float32
    bits (signed 32-bit, so that int64 -> int32 keeps them), top_k 0 (off) as V, then the rows themselves."""
    t, k, p, key, m = params
    out = np.empty((len(pick), 6), dtype=np.int64)
    for col, x in ((0, t), (2, p), (4, m)):
        out[:, col] = np.asarray(x, dtype=np.float32).view(np.int32)  # int32 bits, sign-extended
    out[:, 1], out[:, 3], out[:, 5] = np.where(k > 0, k, V), key, pick
    return out


def draw_keys(base: np.ndarray, step: np.ndarray) -> np.ndarray:
    """`draw_key` of uint64 arrays, elementwise: [R] int64 in [0, 2**32)."""
    with np.errstate(over="ignore"):
        return (_splitmix64_np(base ^ _splitmix64_np(step)) & np.uint64(_M32)).astype(np.int64)


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)  # uint64 arithmetic wraps modulo 2**64; in place from here on
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def process_rows(logits: torch.Tensor, requests: list[Request], rows: list[int] | None = None) -> torch.Tensor:
    """logits [S, V] with the processors of the rows that set any (`rows`, if known) applied (a copy; the input is
    left as is)."""
    if rows is None:
        rows = [i for i, req in enumerate(requests) if req.params.processed]
    if not rows:
        return logits
    idx = to_device(rows, logits.device, torch.long)
    done = apply_processors(logits.index_select(0, idx).float(), [requests[i] for i in rows])  # [R, V]
    return logits.float().index_copy(0, idx, done)


def apply_processors(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """vLLM's processors, in its order, on logits [R, V] (changed in place and returned): min_tokens masks EOS
    and the stop token ids while too few tokens are out; logit_bias adds; the repetition penalty divides positive
    (multiplies negative) logits of every token in the prompt or output; frequency and presence penalties
    subtract count * f and (count > 0) * p for the generated tokens (a resumed request's streamed ones
    included)."""
    R, V = logits.shape
    dev, params = logits.device, [r.params for r in requests]
    bans = [
        (r, t)
        for r, req in enumerate(requests)
        if len(req.output_token_ids) < req.params.min_tokens
        for t in (*req.params.stop_token_ids, *(() if req.params.ignore_eos else req.params.eos_token_ids))
    ]
    bias = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias if t < V]
    if bans:
        logits[tuple(to_device(bans, dev, torch.long).T)] = float("-inf")
    if bias:
        at = to_device([(r, t) for r, t, _ in bias], dev, torch.long).T
        logits.index_put_(tuple(at), to_device([b for *_, b in bias], dev, torch.float32), accumulate=True)
    counts = _token_counts([_generated(r) for r in requests], V, dev)  # [R, V]
    scale = to_device(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params], dev, torch.float32
    )  # [R, 3]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = (counts + _token_counts([r.prompt_token_ids for r in requests], V, dev)) > 0  # [R, V]
        rep = scale[:, :1]  # [R, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - scale[:, 1:2] * counts - scale[:, 2:3] * (counts > 0).float()


def _generated(req: Request) -> list[int]:
    """Every token the request generated: a resumed request's streamed tokens (its prompt's tail), then its output."""
    resumed = req.params.resumed
    return (req.prompt_token_ids[-resumed:] if resumed else []) + req.output_token_ids


def _token_counts(id_lists: list[list[int]], V: int, device: torch.device) -> torch.Tensor:
    """How often each vocabulary id occurs in each row's list: [R, V] float32 (one padded copy to the device)."""
    width = max((len(ids) for ids in id_lists), default=0)
    padded = to_device([ids + [V] * (width - len(ids)) for ids in id_lists], device, torch.long)
    counts = torch.zeros(len(id_lists), V + 1, device=device)  # [R, V + 1]: column V counts the padding
    return counts.scatter_add_(1, padded.view(len(id_lists), width), torch.ones(padded.shape, device=device))[:, :V]


def _pack_scores(tokens: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """tokens [S]; logits [R, V] of the scored rows and the token each scores, [R] -> one float64 vector: the
    tokens, then per row its target's log-probability, then k top ids and k top log-probabilities per row.
    float64 holds every token id and float32 value exactly."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    parts = [tokens.double(), logp.gather(1, targets[:, None])[:, 0].double()]  # [S], [R]
    if k:
        top_lp, top_ids = logp.topk(k, dim=-1)  # [R, k] each, most likely first
        parts += [top_ids.double().flatten(), top_lp.double().flatten()]
    return torch.cat(parts)


def _unpack_scores(host: list[float], ks: list[int]) -> list[TokenLogprob]:
    """The host copy of `_pack_scores` after the tokens -> one TokenLogprob per row, with its own k alternatives."""
    R, k = len(ks), max(ks)
    ids, lps = host[R : R + R * k], host[R + R * k :]
    return [
        TokenLogprob(host[r], [int(t) for t in ids[r * k : r * k + kr]], lps[r * k : r * k + kr])
        for r, kr in enumerate(ks)
    ]


def draw_key(base: int, step: int) -> int:
    """A 32-bit key for the `step`-th draw of a request keyed `base` (any int): splitmix64 of both."""
    return _splitmix64((base & _M64) ^ _splitmix64(step)) & _M32


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 tensors holding values in [0, 2**32): no product exceeds 2**63."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * _K1) & _M32
    x = ((x ^ (x >> 15)) * _K2) & _M32
    return x ^ (x >> 16)
