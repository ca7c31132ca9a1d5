"""Shared helpers: reference outputs from transformers, and a mixed workload."""

from __future__ import annotations

import random

import torch
import transformers


def hf_greedy(model_path, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """transformers `generate`, greedy, one request at a time (no padding), EOS ignored."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_new, strict=True):
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def mixed_workload(n: int, vocab: int, seed: int = 0, max_prompt: int = 300, max_out: int = 24):
    """n prompts of 1..max_prompt random token ids and output lengths 1..max_out (always some extremes)."""
    rng = random.Random(seed)
    lens = [1, max_prompt] + [rng.randint(1, max_prompt) for _ in range(n - 2)]
    outs = [max_out, 1] + [rng.randint(1, max_out) for _ in range(n - 2)]
    prompts = [[rng.randrange(vocab - 3) for _ in range(L)] for L in lens]
    return prompts, outs


def export_tokens(pool, block_ids: list[int], num_tokens: int):
    """One request's first `num_tokens` tokens of KV in `pool` as a contiguous [L, 2, nkv, n, d] tensor."""
    idx = pool.slots(block_ids, 0, num_tokens).to(pool.data.device)
    return pool.data.index_select(3, idx)


def import_tokens(pool, block_ids: list[int], kv) -> None:
    """Write a [L, 2, nkv, n, d] tensor into the blocks `block_ids` of `pool`."""
    idx = pool.slots(block_ids, 0, kv.shape[3]).to(pool.data.device)
    pool.data.index_copy_(3, idx, kv.to(pool.data.device))
