"""Selective-batching forward over a Hugging Face causal LM's own modules.

One forward runs one iteration: the new tokens of every scheduled request (prompt chunks and
single decode tokens alike) are flattened to `[T, H]`. Embedding, norms, projections, MLP and the
LM head run on those flattened tokens (the LM head only where a token is sampled); attention runs
per request against that request's own KV in the paged pool. What differs between devices (how the
inputs reach the device, the small fused ops, the attention kernels) is one backend object chosen
at start-up (`backends.py`); on a GPU, iterations replay CUDA graphs captured by token-count bucket,
prompt chunks and decode tokens alike (`cuda_graphs.py`).

Supported families: Qwen3 (q/k norms), Qwen2 (qkv bias), Llama, Mistral — all share the layer
shape input_layernorm -> self_attn -> post_attention_layernorm -> mlp.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.checkpoint import SUPPORTED_MODEL_TYPES
from pdserve.config import max_model_len
from pdserve.engine.scheduler import Batch
from pdserve.kv.block_allocator import blocks_for, cdiv
from pdserve.kv.pool import DTYPES, KVLayout, KVPool
from pdserve.runner import decoder
from pdserve.runner.backends import Chunk, ForwardInputs, StepInputs, make_backend
from pdserve.runner.copies import to_device

log = logging.getLogger("pdserve.model")


def load_model(path: Path, dtype: str, device: str = "cpu"):
    """Load a checkpoint folder (no network): the model's modules built on the meta device (no memory, no random
    init), then each tensor of its safetensors files read straight onto `device` in `dtype` and put in place (no
    second copy). A checkpoint this cannot place whole (`.bin` files, names the modules lack) goes through
    transformers' own `from_pretrained`."""
    config = decoder.read_config(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {config.model_type!r} is not supported ({', '.join(SUPPORTED_MODEL_TYPES)})")
    model = _load_direct(path, config, DTYPES[dtype], torch.device(device))
    if model is None:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # a node's log says what it does in a line, not a bar
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], local_files_only=True, attn_implementation="sdpa"
        )
    return model.to(device).eval()


def _load_direct(path: Path, config, dtype: torch.dtype, device: torch.device):
    """The model with its safetensors weights read onto `device` in `dtype`, or None when the files do not name
    exactly the model's parameters (a tied LM head may be absent). Its modules are pdserve's own (`decoder.py`: no
    import of transformers' modeling code) where they cover the config, else transformers'."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    with torch.device("meta"):
        model = _meta_modules(config, dtype)
    names = {n for n, _ in model.named_parameters()}  # a tied head once, as the embedding
    state = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                state[key] = f.get_tensor(key).to(dtype)  # a no-op where the file holds `dtype` already
    if set(state) - names - {"lm_head.weight"} or names - set(state):
        return None
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    rotary = type(model.model.rotary_emb)  # its buffers are computed, not stored: on the CPU, as transformers does
    with torch.device("cpu"):
        model.model.rotary_emb = rotary(model.config).to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{path}: no weights for {', '.join(left[:4])}")
    return model


def _meta_modules(config, dtype: torch.dtype) -> nn.Module:
    """The model's modules (on the current device: meta) with its parameters' names and shapes."""
    if decoder.covers(config):
        return decoder.CausalLM(config)
    import transformers

    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")


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


class Linear:
    """`x @ W.T + b` over one or more HF `nn.Linear`s fused along the output dim (QKV, gate+up).

    On the CPU in float32 the weight is reordered once into oneDNN's blocked layout, which measured
    1.4-2.5x faster than `F.linear` at decode sizes (M = 1..40 rows, 2 threads) and the same at
    prefill sizes; elsewhere it is a plain `F.linear`. oneDNN builds (and keeps) code per row count:
    rows beyond UNPADDED_ROWS are padded up to a bucket (`padded_rows`), so that the iterations' many
    token counts make a bounded set of shapes (each new one cost a node about 1 MB for good), and the
    runner builds them all at start (`ModelRunner.warm_up`).
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
        self.in_features = weight.shape[1]
        self.packed = (
            weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
        )
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if padded_rows(rows) != rows:
            x = F.pad(x, (0, 0, 0, padded_rows(rows) - rows))  # [T', K], zero rows after the real ones
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[:rows]


WARM_UP_ROWS = 512  # beyond, the few buckets (32+ rows wide) are built when first met
UNPADDED_ROWS = 16  # row counts up to this (decode batches of the default --max-num-seqs) run as they are


def padded_rows(rows: int) -> int:
    """`rows` rounded up to a bucket: 16 buckets an octave (at most 1/16 more rows), multiples of 8."""
    if rows <= UNPADDED_ROWS:
        return rows
    step = max(8, (1 << (rows.bit_length() - 1)) // 16)
    return cdiv(rows, step) * step


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
        weights = cls(
            Linear(attn.q_proj, attn.k_proj, attn.v_proj),
            Linear(attn.o_proj),
            Linear(mlp.gate_proj, mlp.up_proj),
            Linear(mlp.down_proj),
        )
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            m.weight, m.bias = None, None
        return weights


def captures_graphs(config, graphs: bool, device: torch.device, backend: str) -> bool:
    """Whether a runner captures its steps as CUDA graphs: asked to, on a GPU, with the Triton backend, and for a
    RoPE that needs nothing of the host (a runtime one, `decoder.runtime_rope`, runs eagerly, with a warning)."""
    if not (graphs and device.type == "cuda" and backend == "triton"):
        return False
    if decoder.runtime_rope(config):
        log.warning("no CUDA graphs: this checkpoint's RoPE (%s) is recomputed each step", config.rope_parameters)
        return False
    return True


class ModelRunner:
    def __init__(
        self,
        model,
        pool: KVPool,
        attention_backend: str = "auto",
        cpu_kernels: str = "auto",
        graphs: bool = False,
        max_seqs: int = 0,
        max_tokens: int = 0,
    ) -> None:
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
        apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.backend = make_backend(
            attention_backend, cpu_kernels, pool, model.config, attn.scaling, apply_rope, self.device
        )
        self.head_dim = pool.layout.head_dim
        self.graphs = None  # a cuda_graphs.StepGraphs: on a GPU, unless --enforce-eager
        if captures_graphs(model.config, graphs, self.device, self.backend.name):
            from pdserve.runner.cuda_graphs import CudaRecorder, StepGraphs

            self.graphs = StepGraphs.planned(self, max_tokens, max_seqs)
            self.graphs.capture(CudaRecorder(self.device))

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured since start."""
        return self.graphs.captures if self.graphs is not None else 0

    def max_blocks(self) -> int:
        """Block-table columns the longest request can use."""
        longest = blocks_for(max_model_len(self.model.config), self.pool.block_size)
        return min(self.pool.num_blocks, longest)

    @torch.inference_mode()
    def warm_up(self, max_rows: int, max_samples: int) -> None:
        """Run each distinct packed projection once at every padded row count it will see (the layers' up to
        `max_rows` = the token budget, capped at WARM_UP_ROWS; the LM head's up to `max_samples`), so that oneDNN
        builds the code it keeps now, at start, and a node's memory does not grow with the shapes it meets. On the
        Triton backend, run one mixed step (`warm_up_step`): every kernel variant is built then."""
        layers = {lin.weight.shape: lin for w in self.weights for lin in (w.qkv, w.o, w.gate_up, w.down)}
        limits = [(lin, min(max_rows, WARM_UP_ROWS)) for lin in layers.values()] + [(self.lm_head, max_samples)]
        for lin, limit in limits:
            for rows in sorted({padded_rows(t) for t in range(1, limit + 1)}) if lin.packed else ():
                lin(torch.zeros(rows, lin.in_features))  # [rows, K]
        if self.backend.name == "triton":
            self.forward(self.backend.inputs(*warm_up_step(self.pool.block_size)))

    # ---- inputs ----------------------------------------------------------------------------------
    @staticmethod
    def flatten(batch: Batch, block_size: int) -> tuple[list[int], list[int], list[int], list[int], list[Chunk]]:
        """The iteration's flat inputs in plain Python: token ids, positions, KV slots, the rows whose logits are
        computed (each sampling request's last, then the prompt rows echo scores), chunks."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample: list[int] = []
        chunks: list[Chunk] = []
        for s in batch.scheduled:
            req, past, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            blocks = req.block_ids
            chunks.append(Chunk(len(ids), n, past, blocks))
            ids.extend(_token_ids(req, past, past + n))
            positions.extend(range(past, past + n))
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(past, past + n))
            if s.samples:
                sample.append(len(ids) - 1)
        sample.extend(row for row, _, _ in batch.prompt_logprob_rows())
        return ids, positions, slots, sample, chunks

    @staticmethod
    def gather(batch: Batch, block_size: int) -> StepInputs:
        """The iteration's flat inputs gathered from the running requests' persistent rows (`engine/rows.py`) with
        vectorised numpy: the same values as `flatten`, in the same order. A decode row's token is its row's last
        known token (a pending one: fed from the device); only the prompt chunks' tokens are copied from lists."""
        table, reqs = batch.table, batch.requests
        rows, q_len, samples, past = batch.arrays  # [R] each
        ends = np.cumsum(q_len)  # [R]
        q_start = ends - q_len
        T = int(ends[-1]) if len(reqs) else 0
        if T == len(reqs):  # one token each (a decode step)
            tok_rows, positions = rows, past.copy()  # [T]
        else:
            of_token = np.repeat(np.arange(len(reqs)), q_len)  # [T] each token's request
            tok_rows, positions = rows[of_token], past[of_token] + np.arange(T) - q_start[of_token]
        slots = table.table[tok_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
        ids = table.last[tok_rows]  # [T]: right for a request's newest token, the one a decode row computes
        for i in np.flatnonzero((q_len > 1) | ~samples):  # prompt chunks: their tokens from the lists
            ids[q_start[i] : ends[i]] = _token_ids(reqs[i], int(past[i]), int(past[i] + q_len[i]))
        scored = [row for row, _, _ in batch.prompt_logprob_rows()]
        sample = np.concatenate([ends[samples] - 1, np.asarray(scored, dtype=np.int64)])  # [S]
        width = int(table.num_blocks[rows].max(initial=1))
        return StepInputs(ids, positions, slots, sample, q_start, q_len, past, table.table[rows, :width])

    def step_inputs(self, batch: Batch) -> StepInputs:
        """The iteration's flat inputs as arrays: gathered from the rows, or (a batch built by hand) from lists."""
        bs = self.pool.block_size
        if batch.table is not None:
            return self.gather(batch, bs)
        return StepInputs.of_chunks(*self.flatten(batch, bs), bs)

    def prepare(self, batch: Batch) -> ForwardInputs:
        """The iteration's inputs on the device (one tensor each, or one packed copy on a GPU)."""
        if self.backend.name == "triton":
            return self.backend.step_inputs(self.step_inputs(batch))
        return self.backend.inputs(*self.flatten(batch, self.pool.block_size))

    def device_works(self) -> bool:
        """Whether the device still runs work after a step's error: a sticky CUDA error (an illegal address, a
        device-side assert) left the context unusable and raises again here; a launch refused for its arguments, or
        the CPU, does not."""
        if self.device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(self.device)
            return torch.ones(1, device=self.device).add_(1).item() == 2.0
        except Exception:  # noqa: BLE001 - whichever error: the device did not run it
            return False

    def run(self, batch: Batch, feed: DeviceFeed | None = None) -> tuple[torch.Tensor, bool]:
        """One iteration: a replayed CUDA graph when a bucket holds the step, else an eager forward. Returns the logits
        of the rows `flatten` names, [S, V] float32, and whether a graph computed them. `feed`: input rows whose token
        the host does not know yet, read from the previous step's sampled ids on the device."""
        if self.graphs is not None:
            logits = self.graphs.run(self.step_inputs(batch), feed=feed)
            if logits is not None:
                return logits, True
        inp = self.prepare(batch)  # outside every bucket (rare): gathered once more
        if feed is not None:
            feed.into(inp.input_ids)
        return self.forward(inp), False

    @staticmethod
    def feed(draw, rows: list[int], index: list[int]) -> DeviceFeed:
        """Input rows `rows` of the next step take the sampled ids `index` of a launched step's `draw`."""
        return DeviceFeed(draw.ids, rows, index)

    # ---- forward ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, inp: ForwardInputs, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run one iteration; return the logits of the sampled positions, [S, V] in float32 (written into `out` if
        given: a captured graph's fixed output)."""
        b = self.backend
        h = self.embed(inp.input_ids)  # [T, H]: the residual stream, updated in place
        cos, sin = self.rotary(h, inp.positions[None])  # [1, T, d]
        rope = (cos[0], sin[0])  # [T, d]
        x = b.norm(self.layers[0].input_layernorm, h)
        for i, (layer, w) in enumerate(zip(self.layers, self.weights, strict=True)):
            x = b.add_norm(h, self._attention(layer.self_attn, w, x, rope, i, inp), layer.post_attention_layernorm)
            mlp = w.down(b.act(layer.mlp, w.gate_up(x)))  # [T, H]
            if i + 1 < len(self.layers):
                x = b.add_norm(h, mlp, self.layers[i + 1].input_layernorm)
            else:
                h += mlp
        if inp.sample_index is not None:
            h = h.index_select(0, inp.sample_index)  # [S, H]
        logits = self.lm_head(b.norm(self.norm, h))  # [S, V]
        return logits.float() if out is None else out.copy_(logits)

    def _attention(
        self, attn, w: LayerWeights, x: torch.Tensor, rope, layer_idx: int, inp: ForwardInputs
    ) -> torch.Tensor:
        out = self.backend.attention(attn, w.qkv(x), w.qkv.splits, rope, self.pool.data[layer_idx], inp)  # [T, nh, d]
        return w.o(out.view(x.shape[0], -1))  # [T, H]


def warm_up_step(block_size: int) -> tuple[list[int], list[int], list[int], list[int], list[Chunk]]:
    """Flat inputs of a step with a decode and a prompt chunk that store nothing (every slot -1) and read
    only block 0: run once at start, it meets every Triton kernel variant a step can (the packed inputs'
    pointers are always aligned alike), so that on a GPU each is compiled then, not while serving."""
    n = 2 * block_size  # the chunk, over two blocks
    chunks = [Chunk(0, 1, 1, [0]), Chunk(1, n, 0, [0] * blocks_for(n, block_size))]
    return [0] * (n + 1), [1, *range(n)], [-1] * (n + 1), [0, n], chunks


@dataclass
class DeviceFeed:
    """Input rows of a step whose tokens are still on the device: row `rows[i]` of the step's flat tokens takes
    `ids[index[i]]`, the previous step's sampled ids ([S'] on the device)."""

    ids: torch.Tensor
    rows: list[int]
    index: list[int]

    def into(self, input_ids: torch.Tensor) -> None:
        """Write the fed tokens into a step's input ids ([T] on the device), queued on its stream."""
        dev = input_ids.device
        src = self.ids.index_select(0, to_device(self.index, dev, torch.long))  # [F]
        input_ids.index_copy_(0, to_device(self.rows, dev, torch.long), src.to(input_ids.dtype))


def _token_ids(req, start: int, end: int) -> list[int]:
    """Token ids [start, end) of prompt + output, without joining the two lists; a token still on the device
    (pending) is a 0 here, overwritten on the device (`DeviceFeed`)."""
    prompt, n = req.prompt_token_ids, len(req.prompt_token_ids)
    known = n + len(req.output_token_ids)
    if end > known:
        return _token_ids(req, start, known) + [0] * (end - max(start, known))
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return req.output_token_ids[start - n : end - n]
    return prompt[start:] + req.output_token_ids[: end - n]
