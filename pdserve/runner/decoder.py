"""A checkpoint's modules without transformers' modeling code: Qwen3, Qwen2, Llama and Mistral decoders as the
runner reads them, built from the checkpoint's transformers config.

Importing a family's `modeling_*.py` costs a node about 2 s of CPU at start (transformers' generation, masking and
hub-kernel machinery: torch._dynamo, torch.distributed.tensor) for modules the runner never calls whole: it runs the
projections, attention and the LM head itself (`model.py`). These classes hold the same parameters under the same
names and shapes, and the few pieces the runner does call (`RMSNorm`, `RotaryEmbedding`, `SiLU`,
`apply_rotary_pos_emb`) run the same ops in the same order as transformers' own, so the outputs are bitwise
theirs. A config these do not cover (another activation, a RoPE type that is updated while it runs) is loaded by
transformers instead (`covers`).

    CausalLM: .model (Decoder), .lm_head
    Decoder: .embed_tokens, .layers[i] (DecoderLayer), .norm, .rotary_emb
    DecoderLayer: .input_layernorm, .self_attn (Attention: q/k/v/o_proj, Qwen3's q_norm, k_norm),
                  .post_attention_layernorm, .mlp (MLP: gate/up/down_proj, act_fn)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

FAMILIES = ("qwen3", "qwen2", "llama", "mistral")
RUNTIME_ROPE = ("dynamic", "longrope")  # transformers recomputes these as sequences grow (`dynamic_rope_update`)
# what the runner reads of a config, where transformers' config classes would fill in a default of their own
STATED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "hidden_act",
)
STATED_BY_FAMILY = {"qwen3": ("head_dim",), "mistral": ("sliding_window",)}  # their classes' defaults: 128, 4096


class DecoderConfig:
    """A covered checkpoint's config.json as attributes, read without transformers (whose config classes import its
    models package, which scans every model's source files: about 0.9 s of a node's start). Only a config that
    states every value the runner reads (`STATED`) and a plain RoPE is read so (`read_config`); the values are the
    file's, as transformers' class would hold them."""

    def __init__(self, values: dict) -> None:
        self.values = values
        self.__dict__.update(values)

    @classmethod
    def of(cls, values: dict) -> DecoderConfig | None:
        """The config of these config.json values, or None where transformers' own reading is needed."""
        family = values.get("model_type")
        stated = all(values.get(k) is not None for k in STATED)
        if family not in FAMILIES or not stated or any(k not in values for k in STATED_BY_FAMILY.get(family, ())):
            return None
        rope = values.get("rope_parameters")
        if rope is None and values.get("rope_scaling") is None and isinstance(values.get("rope_theta"), int | float):
            rope = {"rope_type": "default", "rope_theta": values["rope_theta"]}  # the format before transformers 5
        if not isinstance(rope, dict) or set(rope) != {"rope_type", "rope_theta"} or rope["rope_type"] != "default":
            return None
        config = cls({**values, "rope_parameters": rope})
        return config if covers(config) else None

    def to_json_string(self, use_diff: bool = False) -> str:
        return json.dumps(self.values, sort_keys=True)


def read_config(path: Path):
    """The checkpoint's config: a `DecoderConfig` where one covers it, else transformers' `AutoConfig`."""
    config = DecoderConfig.of(json.loads((Path(path) / "config.json").read_text()))
    if config is not None:
        return config
    import transformers

    return transformers.AutoConfig.from_pretrained(path, local_files_only=True)


def covers(config) -> bool:
    """Whether `CausalLM(config)` holds what transformers' model of `config` holds and computes what it computes."""
    return config.model_type in FAMILIES and getattr(config, "hidden_act", None) == "silu" and not runtime_rope(config)


def runtime_rope(config) -> bool:
    """Whether the checkpoint's RoPE is recomputed from the positions as they come (RUNTIME_ROPE): transformers reads
    the longest position on the host to do so, which a captured CUDA graph cannot."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("rope_type", "default") in RUNTIME_ROPE


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        """No random init: every weight comes from the checkpoint (and drawing one on the meta device imports
        torch._dynamo, over a second)."""


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """No random init, as `Linear`."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D], as transformers' RMSNorm
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class SiLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(x)


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's angles, as transformers' rotary embedding of these families."""

    def __init__(self, config) -> None:
        super().__init__()
        with torch.device("cpu"):  # computed, not loaded: on the CPU, as transformers does (and no meta arange)
            inv_freq = self._inv_freq(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)  # transformers keeps it too

    def _inv_freq(self, config) -> torch.Tensor:
        rope = config.rope_parameters
        if rope["rope_type"] == "default":
            dim = head_dim(config)
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [d/2]
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
        return inv_freq  # [d/2]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)  # [B, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, d]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """q and k rotated by each position's angles (transformers' function of the same name)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, heads, kv_heads = head_dim(config), config.num_attention_heads, config.num_key_value_heads
        hidden = config.hidden_size
        # Qwen2: biased q, k, v; Mistral: no biases; Qwen3 and Llama: as `attention_bias` says, o_proj too
        biased = config.model_type in ("qwen3", "llama") and bool(getattr(config, "attention_bias", False))
        qkv_bias, o_bias = biased or config.model_type == "qwen2", biased
        self.scaling = d**-0.5
        self.q_proj = Linear(hidden, heads * d, bias=qkv_bias)
        self.k_proj = Linear(hidden, kv_heads * d, bias=qkv_bias)
        self.v_proj = Linear(hidden, kv_heads * d, bias=qkv_bias)
        self.o_proj = Linear(heads * d, hidden, bias=o_bias)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiLU()


class DecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class Decoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None))
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()  # a tied head is one parameter, named once (as the embedding), as transformers' is

    def tie_weights(self) -> None:
        """The LM head is the embedding matrix where the config ties them."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
