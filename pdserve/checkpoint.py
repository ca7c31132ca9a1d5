"""Built-in random-weight checkpoints and the one loader every checkpoint goes through.

`tiny` (tests), `small` (CPU benchmarks) and `qwen3-0.6b` (GPU benchmarks: Qwen3-0.6B's shape, tied
embeddings, saved in bfloat16) are Qwen3-architecture models with deterministic random weights and a
byte-level BPE tokenizer sized to the vocabulary. They are written once to a cache folder as an ordinary
Hugging Face checkpoint (config.json, model.safetensors, tokenizer files with a chat template) and
then loaded exactly like a downloaded one. Nothing here reaches for the network.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where weights are drawn: the router resolves names without it
    import torch

log = logging.getLogger("pdserve.checkpoint")
CACHE_ENV_DEFAULT = Path.home() / ".cache" / "pdserve"  # PDSERVE_CACHE overrides it
FORMAT_VERSION = 1  # bump when a built-in's weights or tokenizer change

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")  # config.json's model_type


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a built-in random model."""

    arch: str  # "qwen3" | "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    init_std: float = 0.02
    seed: int = 0
    tie_embeddings: bool = False  # the LM head is the embedding matrix (as in Qwen3-0.6B)
    dtype: str = "float32"  # of the saved weights; `--dtype` still decides the runtime dtype

    def __post_init__(self) -> None:
        if self.dtype not in SAVE_DTYPES:
            raise ValueError(f"a built-in model is saved as {' or '.join(SAVE_DTYPES)}, not {self.dtype!r}")


SAVE_DTYPES = ("float32", "bfloat16")
BUILTIN_MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec("qwen3", 512, 64, 128, 2, 4, 2, 16, 2048),
    "small": ModelSpec("qwen3", 8192, 512, 1536, 8, 8, 4, 64, 2048),
    # Qwen3-0.6B's shape (its real max length is 40k; 4096 covers the GPU benchmark): ~1.2 GB in bf16
    "qwen3-0.6b": ModelSpec("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, 4096, tie_embeddings=True, dtype="bfloat16"),
}


def cache_dir(kind: str = "models") -> Path:
    """Where pdserve keeps what it builds, by kind: "models" (built-in checkpoints), "kernels" (the engine's compiled
    C)."""
    return Path(os.environ.get("PDSERVE_CACHE", CACHE_ENV_DEFAULT)) / kind


def resolve_model(name_or_path: str) -> Path:
    """Return a checkpoint folder: a built-in name is written (once) to the cache first. Processes that ask for one
    at once (a stack's nodes, the GPU kit's build beside its install) take turns on a lock file beside it: one
    writes it, the others wait and find it written."""
    if name_or_path in BUILTIN_MODELS:
        folder = cache_dir() / f"{name_or_path}-v{FORMAT_VERSION}"
        if not (folder / "model.safetensors").exists():
            import fcntl

            folder.parent.mkdir(parents=True, exist_ok=True)
            with open(folder.with_name(folder.name + ".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
                if not (folder / "model.safetensors").exists():
                    log.info("writing the built-in model %s (random weights, once) to %s", name_or_path, folder)
                    write_random_checkpoint(folder, BUILTIN_MODELS[name_or_path])
        return folder
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        known = ", ".join(BUILTIN_MODELS)
        raise ValueError(
            f"--model {name_or_path!r} is neither a built-in model ({known}) nor a folder with a config.json"
        )
    return path


def hf_config(spec: ModelSpec):
    """The transformers config object of a spec."""
    import transformers

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=spec.vocab_size - 3,  # <|endoftext|>
        eos_token_id=spec.vocab_size - 1,  # <|im_end|>
        tie_word_embeddings=spec.tie_embeddings,
        torch_dtype=spec.dtype,
    )
    if spec.arch == "qwen3":
        return transformers.Qwen3Config(head_dim=spec.head_dim, **common)
    if spec.arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if spec.arch == "llama":
        return transformers.LlamaConfig(head_dim=spec.head_dim, **common)
    if spec.arch == "mistral":
        return transformers.MistralConfig(head_dim=spec.head_dim, sliding_window=None, **common)
    raise ValueError(f"unknown architecture {spec.arch!r}")


def write_random_checkpoint(folder: Path, spec: ModelSpec) -> None:
    """Write a deterministic random-weight checkpoint with a byte-level tokenizer to `folder`.

    The model is built on the meta device (no memory, no init) only to name and shape its parameters;
    each is drawn in turn, in name order, from one seeded CPU generator, in the spec's dtype (float32
    draws are the ones `tiny` and `small` always had), and written with safetensors. A tied LM head
    is not written: transformers ties it to the embedding when it loads the checkpoint.
    """
    folder = Path(folder)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = hf_config(spec)
    model = _meta_model(config)
    weights = random_weights(model, spec)
    config.architectures = [type(model).__name__]
    config.save_pretrained(tmp)
    from safetensors.torch import save_file

    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    _byte_level_tokenizer(spec.vocab_size).save_pretrained(tmp)
    (tmp / "pdserve_builtin.json").write_text(json.dumps({"spec": spec.__dict__}))
    if folder.exists():  # another process won the race; keep its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return
    os.replace(tmp, folder)


def _meta_model(config):
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def random_weights(model, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every parameter of `model` (a tied head once, as the embedding), drawn in name order."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    weights = {}
    for name, param in sorted(model.named_parameters()):  # tied parameters appear once
        mean, std = (1.0, 0.1) if name.endswith("norm.weight") else (0.0, spec.init_std)
        weights[name] = _draw(tuple(param.shape), mean, std, dtype, gen)
    return weights


def _draw(shape: tuple[int, ...], mean: float, std: float, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    import torch

    if dtype == torch.float32:  # exactly the draws `tiny` and `small` were always written with
        z = torch.randn(shape, generator=gen)
        return (mean + std * z) if mean else std * z
    return torch.empty(shape, dtype=dtype).normal_(mean, std, generator=gen)  # 3x faster than randn + cast


def _byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer: 256 byte tokens, merged pairs of printable ASCII, 3 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = pre_tokenizers.ByteLevel.alphabet()
    chars = sorted(byte_to_char)  # the 256 byte-level symbols
    vocab = {c: i for i, c in enumerate(chars)}
    printable = [c for c in (chr(b) for b in range(33, 127)) if c in vocab]
    merges = []
    for a in printable:
        for b in printable:
            if len(vocab) >= vocab_size - len(SPECIAL_TOKENS):
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    while len(vocab) < vocab_size - len(SPECIAL_TOKENS):
        vocab[f"<|unused{len(vocab)}|>"] = len(vocab)
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    bpe = models.BPE(vocab=vocab, merges=merges)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    return fast
