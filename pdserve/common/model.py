"""Selective-batching forward over a Hugging Face causal LM's own modules.

One forward runs one iteration: the new tokens of every scheduled request (prompt chunks and
single decode tokens alike) are flattened to `[T, H]`. Embedding, norms, projections, MLP and the
LM head run on those flattened tokens (the LM head only where a token is sampled); attention runs
per request against that request's own KV in the paged pool: SDPA for each prompt chunk, and on
the CPU one kernel call per layer for all single-token decodes (`kernels.py`), each still reading
only its own request's blocks.

Supported families: Qwen3 (q/k norms), Qwen2 (qkv bias), Llama, Mistral — all share the layer
shape input_layernorm -> self_attn -> post_attention_layernorm -> mlp.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common import kernels
from pdserve.common.kv_cache import DTYPES, KVLayout, KVPool
from pdserve.common.scheduler import Batch

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")


@dataclass
class Span:
    """One request's slice of the flattened batch."""

    start: int  # first index in [T]
    length: int  # new tokens this iteration
    past: int  # tokens already in the KV before this iteration
    ctx_slots: torch.Tensor | slice  # its past + length slots; a slice when they are contiguous
    mask: torch.Tensor | None  # [length, past + length] bool, for a chunk after a past


@dataclass
class DecodeGroup:
    """The iteration's single-token decodes, attended in one kernel call per layer."""

    rows: slice | torch.Tensor  # their positions in [T]: a slice when they are adjacent
    block_tables: torch.Tensor  # [n, max_blocks] int32, padded with 0
    lens: torch.Tensor  # [n] int32: context length, the new token included


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    spans: list[Span]  # attended by SDPA, one call each
    sample_index: torch.Tensor  # [S] positions in [T] whose logits are sampled
    decode: DecodeGroup | None = None  # attended by the decode kernel


def load_model(path: Path, dtype: str, device: str = "cpu"):
    """Load a checkpoint folder through transformers (no network)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {config.model_type!r} is not supported ({', '.join(SUPPORTED_MODEL_TYPES)})")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], local_files_only=True, attn_implementation="sdpa"
    )
    return model.to(device).eval()


def fingerprint(model) -> str:
    """A short hash of the config and a sample of the weights: two nodes must load the same model."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for _, p in sorted(model.named_parameters())[:: max(1, len(list(model.parameters())) // 8)]:
            h.update(p.detach().flatten()[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def kv_layout(model, block_size: int, dtype: str) -> KVLayout:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVLayout(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        model_fingerprint=fingerprint(model),
    )


def max_model_len(config) -> int:
    """The longest sequence the model attends over exactly (a sliding window caps it)."""
    limit = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        limit = min(limit, window)
    return limit


class Linear:
    """`x @ W.T + b` over one or more HF `nn.Linear`s fused along the output dim (QKV, gate+up).

    On the CPU in float32 the weight is reordered once into oneDNN's blocked layout, which measured
    1.4-2.5x faster than `F.linear` at decode sizes (M = 1..40 rows, 2 threads) and the same at
    prefill sizes; elsewhere it is a plain `F.linear`.
    """

    def __init__(self, *modules: nn.Linear) -> None:
        weights = [m.weight.detach() for m in modules]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)  # [N, K]
        biases = [m.bias for m in modules]
        self.bias = None  # [N] or None
        if any(b is not None for b in biases):
            parts = [
                b.detach() if b is not None else m.weight.new_zeros(m.out_features)
                for m, b in zip(modules, biases, strict=True)
            ]
            self.bias = torch.cat(parts)
        self.splits = [m.out_features for m in modules]
        self.packed = (
            weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
        )
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm module applied as one `F.rms_norm` call in float32: bitwise the module's output
    (it runs the same ops in the same order), about 1.5-2x faster at decode sizes. Other dtypes, where
    the module upcasts, and norms of another shape run the module itself."""
    eps = getattr(norm, "variance_epsilon", None)
    if x.dtype != torch.float32 or eps is None:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, eps)


@dataclass
class LayerWeights:
    """One decoder layer's projections, fused where the HF modules allow it."""

    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear

    @classmethod
    def of(cls, layer) -> LayerWeights:
        """The layer's projections, taken over: the HF modules' own copies are released (set to None, so
        that calling them fails loudly), and every weight is held once."""
        attn, mlp = layer.self_attn, layer.mlp
        weights = cls(Linear(attn.q_proj, attn.k_proj, attn.v_proj), Linear(attn.o_proj),
                      Linear(mlp.gate_proj, mlp.up_proj), Linear(mlp.down_proj))  # fmt: skip
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            m.weight, m.bias = None, None
        return weights


class ModelRunner:
    def __init__(self, model, pool: KVPool, cpu_kernels: str = "auto") -> None:
        self.model = model
        self.pool = pool
        self.device = next(model.parameters()).device
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = Linear(model.lm_head)
        if model.lm_head.weight is not self.embed.weight and self.lm_head.weight is not model.lm_head.weight:
            model.lm_head.weight = None  # held once, as the reordered copy (a tied one is the embedding's)
        self.weights = [LayerWeights.of(layer) for layer in self.layers]
        attn = self.layers[0].self_attn
        self.apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.head_dim = pool.layout.head_dim
        self.scale = attn.scaling
        self.kernels = _cpu_kernels(cpu_kernels, self.device, pool.data.dtype)
        self.silu_gated = getattr(model.config, "hidden_act", None) == "silu"

    # ---- inputs ----------------------------------------------------------------------------------
    def prepare(self, batch: Batch) -> ForwardInputs:
        """The iteration's flat inputs, built in plain Python (one tensor each at the end)."""
        bs = self.pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[Span] = []
        decodes: list[tuple[int, list[int], int]] = []  # (row, block ids, context length)
        sample: list[int] = []
        for s in batch.scheduled:
            req, past, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            ids.extend(_token_ids(req, past, past + n))
            positions.extend(range(past, past + n))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(past, past + n))
            if self.kernels is not None and n == 1 and past > 0:
                decodes.append((len(ids) - 1, blocks, past + 1))
            else:
                ctx = self.pool.context_slots(blocks[: -(-(past + n) // bs)], past + n)
                spans.append(Span(len(ids) - n, n, past, ctx, _chunk_mask(past, n)))
            if s.samples:
                sample.append(len(ids) - 1)
        dev = self.device
        return ForwardInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            spans=[_span_to(sp, dev) for sp in spans],
            sample_index=torch.tensor(sample, dtype=torch.long, device=dev),
            decode=self._decode_group(decodes) if decodes else None,
        )

    def _decode_group(self, decodes: list[tuple[int, list[int], int]]) -> DecodeGroup:
        bs = self.pool.block_size
        width = max(-(-length // bs) for _, _, length in decodes)
        padded = [block_ids[: -(-length // bs)] for _, block_ids, length in decodes]
        tables = torch.tensor([b + [0] * (width - len(b)) for b in padded], dtype=torch.int32)  # [n, max_blocks]
        rows = [row for row, _, _ in decodes]
        adjacent = rows == list(range(rows[0], rows[0] + len(rows)))
        return DecodeGroup(
            rows=slice(rows[0], rows[0] + len(rows)) if adjacent else torch.tensor(rows, dtype=torch.long),
            block_tables=tables,
            lens=torch.tensor([length for _, _, length in decodes], dtype=torch.int32),
        )

    # ---- forward ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, inp: ForwardInputs) -> torch.Tensor:
        """Run one iteration; return the logits of the sampled positions, [S, V] in float32."""
        h = self.embed(inp.input_ids)  # [T, H]: the residual stream, updated in place
        cos, sin = self.rotary(h, inp.positions[None])  # [1, T, d]
        rope = (cos[0], sin[0])  # [T, d]
        x = self._norm(self.layers[0].input_layernorm, h)
        for i, (layer, w) in enumerate(zip(self.layers, self.weights, strict=True)):
            x = self._add_norm(h, self._attention(layer.self_attn, w, x, rope, i, inp), layer.post_attention_layernorm)
            out = self._mlp(layer.mlp, w, x)
            if i + 1 < len(self.layers):
                x = self._add_norm(h, out, self.layers[i + 1].input_layernorm)
            else:
                h += out
        h = self._norm(self.norm, h[inp.sample_index])  # [S, H]
        return self.lm_head(h).float()  # [S, V]

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is None:
            return rms_norm(norm, x)
        return self.kernels.rms_norm(x, norm.weight, norm.variance_epsilon)

    def _add_norm(self, h: torch.Tensor, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """h += x (the residual), then the next norm of h."""
        if self.kernels is None:
            h += x
            return rms_norm(norm, h)
        return self.kernels.add_rms_norm(h, x, norm.weight, norm.variance_epsilon)

    def _mlp(self, mlp, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate_up = w.gate_up(x)  # [T, 2I]
        if self.kernels is not None and self.silu_gated:
            return w.down(self.kernels.silu_mul(gate_up))  # [T, H]
        gate, up = gate_up.split(w.gate_up.splits, dim=-1)  # [T, I] each
        return w.down(mlp.act_fn(gate) * up)  # [T, H]

    def _attention(
        self, attn, w: LayerWeights, x: torch.Tensor, rope, layer_idx: int, inp: ForwardInputs
    ) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        q, k, v = w.qkv(x).split(w.qkv.splits, dim=-1)
        q = q.view(T, -1, d)  # [T, nh, d]
        k = k.view(T, -1, d)  # [T, nkv, d]
        v = v.view(T, -1, d)  # [T, nkv, d]
        if hasattr(attn, "q_norm"):
            q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
        kv_pool = self.pool.data[layer_idx]  # [2, nkv, NB*bs, d]
        if self.kernels is not None:  # rotate q and k, store k and v: one pass
            q = self.kernels.rope_store(q, k, v, *rope, kv_pool, inp.slot_mapping)
        else:
            q, k = self.apply_rope(q, k, *rope, unsqueeze_dim=1)
            kv_pool.index_copy_(2, inp.slot_mapping, torch.stack((k, v)).transpose(1, 2))  # [2, nkv, T, d]
        out = torch.empty_like(q)  # [T, nh, d]
        for sp in inp.spans:
            out[sp.start : sp.start + sp.length] = self._span_attention(q, kv_pool, sp)
        if inp.decode is not None:
            dec = inp.decode
            out[dec.rows] = self.kernels.decode_attention(q[dec.rows], kv_pool, dec.block_tables, dec.lens,
                                                          self.pool.block_size, self.scale)  # fmt: skip
        return w.o(out.view(T, -1))  # [T, H]

    def _span_attention(self, q, kv_pool, sp: Span) -> torch.Tensor:
        """Attention of one request's new tokens against its KV in the pool (theirs included): [length, nh, d]."""
        qs = q[sp.start : sp.start + sp.length].transpose(0, 1)  # [nh, Lq, d]
        # a view of the pool when its blocks are consecutive, else a gather
        kv = kv_pool[:, :, sp.ctx_slots] if isinstance(sp.ctx_slots, slice) else kv_pool.index_select(2, sp.ctx_slots)
        o = F.scaled_dot_product_attention(
            qs[None],  # [1, nh, Lq, d]
            kv[0][None],  # [1, nkv, Lk, d]
            kv[1][None],
            attn_mask=sp.mask,
            is_causal=sp.past == 0 and sp.length > 1,  # a first chunk; later ones carry a mask (none for one token)
            scale=self.scale,
            enable_gqa=True,
        )  # [1, nh, Lq, d]
        return o[0].transpose(0, 1)


def _cpu_kernels(setting: str, device: torch.device, dtype: torch.dtype) -> kernels.CpuKernels | None:
    """pdserve's C kernels when `setting` allows them and they apply here, else None (torch's ops)."""
    if setting == "off" or device.type != "cpu" or dtype != torch.float32:
        return None
    loaded = kernels.load()
    if loaded is None and setting == "on":
        raise RuntimeError("--cpu-kernels on: the CPU kernels could not be built here (see the log)")
    return loaded


def _token_ids(req, start: int, end: int) -> list[int]:
    """Token ids [start, end) of prompt + output, without joining the two lists."""
    prompt, n = req.prompt_token_ids, len(req.prompt_token_ids)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return req.output_token_ids[start - n : end - n]
    return prompt[start:] + req.output_token_ids[: end - n]


def _chunk_mask(past: int, n: int) -> torch.Tensor | None:
    """Causal mask of a chunk of n new tokens after `past` cached ones: [n, past + n] bool."""
    if past == 0 or n == 1:
        return None
    return torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]


def _span_to(sp: Span, device) -> Span:
    if device.type == "cpu":
        return sp
    return Span(
        sp.start,
        sp.length,
        sp.past,
        sp.ctx_slots if not isinstance(sp.ctx_slots, torch.Tensor) else sp.ctx_slots.to(device),
        None if sp.mask is None else sp.mask.to(device),
    )
